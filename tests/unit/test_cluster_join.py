"""`up --join`'s published stack (pure, files only): what is carried, where it is written,
and what is refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamod.cluster import join
from dynamod.cluster.join import JoinError, StackBundle


def _stack(root: Path, cluster_extra: str = "") -> Path:
    (root / "stacks").mkdir(parents=True)
    (root / "trainer.toml").write_text('[stack]\ninclude = ["parts/infra.toml"]\n')
    (root / "parts").mkdir()
    (root / "parts" / "infra.toml").write_text("[vars]\nx = 1\n")
    main = root / "stacks" / "c.toml"
    main.write_text('[stack]\nname = "c"\ninclude = ["../trainer.toml", "/abs/elsewhere.toml"]\n'
                    f'[cluster]\nnodes = {{ head = "10.0.0.1" }}\n{cluster_extra}')  # fmt: skip
    return main


def test_relative_includes_are_carried_and_unpacked_in_place(tmp_path: Path) -> None:
    main = _stack(tmp_path / "src")
    bundle = join.bundle(main, "c", {"workers": 1, "ratio": 0.5, "d": "{cache_dir}/m"},
                         {"head": "10.0.0.1"})  # fmt: skip
    assert bundle.main == "stacks/c.toml"
    assert sorted(bundle.files) == ["parts/infra.toml", "stacks/c.toml", "trainer.toml"]
    assert bundle.variables == {"workers": 1, "d": "{cache_dir}/m"}  # as --var can say them
    again = StackBundle.decode(bundle.encode())
    out = join.unpack(again, tmp_path / "joined")
    assert out == tmp_path / "joined" / "stacks" / "c.toml"
    assert (tmp_path / "joined" / "parts" / "infra.toml").read_text() == "[vars]\nx = 1\n"


def test_a_stack_with_secrets_or_a_file_outside_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    main = _stack(tmp_path / "src", 'secrets = "c.secrets"\n')
    with pytest.raises(JoinError, match="secrets directory, which is never published"):
        join.unpack(join.bundle(main, "c", {}, {}), tmp_path / "joined")
    sneaky = StackBundle("c", "c.toml", {"c.toml": "", "../../etc/x": "y"}, {}, {})
    with pytest.raises(JoinError, match=r"outside it: '\.\./\.\./etc/x'"):
        join.unpack(sneaky, tmp_path / "joined")
    assert not (tmp_path / "joined").exists()


def test_this_node_is_the_one_whose_address_this_machine_holds() -> None:
    bundle = StackBundle("c", "c.toml", {}, {}, {"head": "203.0.113.1", "n1": "127.0.0.1"})
    assert join.this_node(bundle) == "n1"
    none = StackBundle("c", "c.toml", {}, {}, {"head": "203.0.113.1", "n1": "203.0.113.2"})
    with pytest.raises(JoinError, match="holds none of them: say which with --node"):
        join.this_node(none)


def test_a_stack_on_a_base_carries_the_base_and_its_base_s_secrets_refuse_it(
    tmp_path: Path,
) -> None:
    base = _stack(tmp_path / "src")
    mine = base.parent / "mine.toml"
    mine.write_text('[stack]\nbase = "c.toml"\ninclude = ["../ray.toml"]\n')
    (tmp_path / "src" / "ray.toml").write_text("[vars]\nray = 1\n")
    bundle = join.bundle(mine, "mine", {}, {"head": "10.0.0.1"})
    assert bundle.main == "stacks/mine.toml"
    assert sorted(bundle.files) == ["parts/infra.toml", "ray.toml", "stacks/c.toml",
                                    "stacks/mine.toml", "trainer.toml"]
    assert join.unpack(bundle, tmp_path / "joined") == tmp_path / "joined" / "stacks" / "mine.toml"
    base.write_text(base.read_text() + 'secrets = "c.secrets"\n')  # in the base's [cluster]
    with pytest.raises(JoinError, match="secrets directory, which is never published"):
        join.unpack(join.bundle(mine, "mine", {}, {}), tmp_path / "joined-2")
    assert not (tmp_path / "joined-2").exists()
