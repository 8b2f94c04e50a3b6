"""Each bound in core/limits.py is enforced where it is documented: one example that must
be refused, naming the file, unit and field, and one just inside the bound that passes."""

from __future__ import annotations

import itertools
import os
import textwrap
from pathlib import Path

import pytest

from dynamod.core import limits, spec, statedir, template, tomlfile
from dynamod.core.errors import SpecError, SpecErrors, StateDirError


def write(tmp_path: Path, text: str, name: str = "stack.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(path: Path, allocate: object = None) -> spec.Stack:
    counter = itertools.count(40000)
    return spec.load(path, state_dir=path.parent / "state",
                     allocate_port=allocate or (lambda: next(counter)))  # type: ignore[arg-type]


def refusal(path: Path, allocate: object = None) -> SpecError:
    with pytest.raises((SpecError, SpecErrors)) as info:
        load(path, allocate)
    err = info.value
    return err.errors[0] if isinstance(err, SpecErrors) else err


# ------------------------------------------------------------------------- files


def test_file_size_limit(tmp_path: Path) -> None:
    body = '[units.a]\ncommand = ["true"]\n'
    path = write(tmp_path, body + "#" * (limits.MAX_FILE_BYTES - len(body) - 1) + "\n")
    assert load(path).units  # exactly at the limit
    path.write_text(body + "#" * limits.MAX_FILE_BYTES)
    err = refusal(path)
    assert f"may be at most {limits.MAX_FILE_BYTES} bytes" in err.message


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null", "/proc/self"])
def test_devices_and_directories_are_not_read(tmp_path: Path, target: str) -> None:
    err = refusal(Path(target))
    assert "expected a TOML file" in err.message and err.file == str(Path(target).resolve())


def test_fifo_is_not_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "stack.toml"
    os.mkfifo(fifo)  # opening it for reading would block forever
    assert "is a FIFO" in refusal(fifo).message


def test_non_utf8_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "stack.toml"
    path.write_bytes(b'[units.a]\ncommand = ["\xff"]\n')
    assert refusal(path).message.startswith("not UTF-8 text: byte 0xff at line 2, column 13")


def test_nesting_limit(tmp_path: Path) -> None:
    ok = "[" * (limits.MAX_NESTING - 2) + "]" * (limits.MAX_NESTING - 2)
    path = write(tmp_path, f'[units.a]\ncommand = ["true"]\ndescription = {ok}\n')
    err = refusal(path)  # refused as a list where a string belongs, not for its depth
    assert err.field == "description" and "nested" not in err.message
    deep = "[" * 5000 + "]" * 5000  # tomllib itself would recurse to death
    path = write(tmp_path, f'[units.a]\ncommand = ["true"]\nx = {deep}\n')
    assert "nested more than" in refusal(path).message
    dotted = ".".join(["x"] * 5000)  # dotted keys nest without recursion in the parser
    path = write(tmp_path, f'[units.a]\ncommand = ["true"]\n[{dotted}]\n')
    assert "nested more than" in refusal(path).message


def test_nul_in_a_string_or_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[units.a]\ncommand = ["tr\\u0000ue"]\n')
    err = refusal(path)
    assert err.field == "units.a.command[0]" and "NUL" in err.message


def test_include_depth_and_file_count(tmp_path: Path) -> None:
    for i in range(limits.MAX_INCLUDE_DEPTH + 2):
        write(tmp_path, f'[stack]\ninclude = ["f{i + 1}.toml"]\n', name=f"f{i}.toml")
    write(tmp_path, "", name=f"f{limits.MAX_INCLUDE_DEPTH + 2}.toml")
    err = refusal(tmp_path / "f0.toml")
    assert err.field == "stack.include" and "nest more than" in err.message
    assert load(tmp_path / "f2.toml").units == {}  # MAX_INCLUDE_DEPTH levels below it: fine

    # a diamond: each level includes the next twice -> 2^n reads without a file bound
    for i in range(8):
        write(tmp_path, f'[stack]\ninclude = ["d{i + 1}.toml", "d{i + 1}.toml"]\n',
              name=f"d{i}.toml")
    write(tmp_path, "", name="d8.toml")
    assert f"more than {limits.MAX_FILES} files" in refusal(tmp_path / "d0.toml").message


def test_symlink_loop_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.toml").symlink_to(tmp_path / "b.toml")
    (tmp_path / "b.toml").symlink_to(tmp_path / "a.toml")
    assert "cannot resolve path" in refusal(tmp_path / "a.toml").message


# ------------------------------------------------------------------------- units


def test_instance_limit(tmp_path: Path) -> None:
    at_limit = f'[units.w]\nreplicas = {limits.MAX_INSTANCES}\ncommand = ["true"]\n'
    assert len(load(write(tmp_path, at_limit)).units) == limits.MAX_INSTANCES
    over = at_limit + '[units.x]\nreplicas = 1\ncommand = ["true"]\n'
    err = refusal(write(tmp_path, over))
    assert (err.unit, err.field) == ("x", "replicas") and "more than" in err.message
    huge = '[units.w]\nreplicas = 100000000000\ncommand = ["true"]\n'
    err = refusal(write(tmp_path, huge))
    assert err.message == f"must be between 0 and {limits.MAX_INSTANCES}, got 100000000000"


@pytest.mark.parametrize("value", ["2.5", "4.0", "true", '"many"', '"1e3"', "nan", "inf"])
def test_replicas_must_be_an_integer(tmp_path: Path, value: str) -> None:
    err = refusal(write(tmp_path, f'[units.w]\nreplicas = {value}\ncommand = ["true"]\n'))
    assert err.field == "replicas" and err.message.startswith("must be an integer")


def test_unit_name_length_and_count(tmp_path: Path) -> None:
    name = "n" * limits.MAX_NAME_LENGTH
    assert load(write(tmp_path, f'[units.{name}]\ncommand = ["true"]\n')).units
    err = refusal(write(tmp_path, f'[units.{name}x]\ncommand = ["true"]\n'))
    assert "at most" in err.message
    many = "".join(f'[units.u{i}]\ncommand = ["true"]\n' for i in range(limits.MAX_INSTANCES + 1))
    assert f"more than {limits.MAX_INSTANCES} units" in refusal(write(tmp_path, many)).message


def test_fixed_base_port_plus_index_stays_in_range(tmp_path: Path) -> None:
    err = refusal(write(tmp_path, '[units.w]\nreplicas = 2\ncommand = ["t"]\n'
                                   'ports = { p = 65535 }\n'))
    assert (err.unit, err.field) == ("w@1", "ports.p") and "above 65535" in err.message


def test_port_limits(tmp_path: Path) -> None:
    ports = ", ".join(f"p{i} = 0" for i in range(limits.MAX_PORTS_PER_UNIT + 1))
    err = refusal(write(tmp_path, f'[units.a]\ncommand = ["t"]\nports = {{ {ports} }}\n'))
    assert err.field == "ports" and f"at most {limits.MAX_PORTS_PER_UNIT}" in err.message
    ports = ", ".join(f"p{i} = 0" for i in range(limits.MAX_PORTS_PER_UNIT))
    units = "".join(f'[units.u{i}]\ncommand = ["t"]\nports = {{ {ports} }}\n' for i in range(17))
    err = refusal(write(tmp_path, units))
    assert f"more than {limits.MAX_ALLOCATED_PORTS} ports to allocate" in err.message


def test_allocator_running_dry_is_a_spec_error(tmp_path: Path) -> None:
    def exhausted() -> int:
        raise OSError("no free loopback port in 20000-32767 after 500 tries")

    err = refusal(write(tmp_path, '[units.a]\ncommand = ["t"]\nports = { p = 0 }\n'), exhausted)
    assert err.field == "ports.p" and "cannot allocate a free port" in err.message


@pytest.mark.parametrize("field", ["stop.timeout", "ready.timeout", "ready.interval",
                                   "ready.deadline", "restart.backoff_max",
                                   "restart.limit_interval", "restart.first_delay"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "86400.5", "1e300"])
def test_durations_are_finite_and_bounded(tmp_path: Path, field: str, value: str) -> None:
    table, key = field.split(".")
    extra = 'kind = "tcp"\nport = 1\n' if table == "ready" else ""
    text = f'[units.a]\ncommand = ["t"]\n[units.a.{table}]\n{extra}{key} = {value}\n'
    err = refusal(write(tmp_path, text))
    assert (err.unit, err.field) == ("a", field), err
    text = text.replace(f"{key} = {value}", f"{key} = {limits.MAX_SECONDS}")
    assert load(write(tmp_path, text)).units["a"]


def test_env_names(tmp_path: Path) -> None:
    err = refusal(write(tmp_path, '[units.a]\ncommand = ["t"]\nenv = { "A=B" = "x" }\n'))
    assert err.field == "env" and "'A=B'" in err.message


def test_stack_name_is_a_name(tmp_path: Path) -> None:
    err = refusal(write(tmp_path, '[stack]\nname = "my\\nstack"\n'))
    assert err.field == "stack.name"


# ------------------------------------------------------------------------- templates


def test_template_output_length_is_bounded_before_it_is_built() -> None:
    context = {"vars": {"a": "x" * 1000}}
    assert len(template.render("{vars.a}" * 64, context, 64 * 1024)) == 64000
    with pytest.raises(template.TemplateTooLong):
        template.render("{vars.a}" * 66, context, 64 * 1024)


def test_rendered_string_limit(tmp_path: Path) -> None:
    big = "y" * 4000
    refs = "{vars.big}" * 17  # 68,000 characters
    err = refusal(write(tmp_path, f'[vars]\nbig = "{big}"\n[units.a]\ncommand = ["{refs}"]\n'))
    assert err.field == "command[0]" and "renders to more than" in err.message


def test_rendered_total_limit(tmp_path: Path) -> None:
    """256 replicas x 16 arguments x 60,000 characters would be 245 MB of command lines."""
    refs = "{vars.big}" * 15
    command = ", ".join(f'"{refs}"' for _ in range(16))
    text = (f'[vars]\nbig = "{"z" * 4000}"\n'
            f"[units.a]\nreplicas = 256\ncommand = [{command}]\n")
    err = refusal(write(tmp_path, text))
    assert f"renders to more than {limits.MAX_RENDERED_TOTAL} characters" in err.message


def test_self_reference_does_not_recurse(tmp_path: Path) -> None:
    text = '[vars]\na = "{vars.a}"\n[units.u]\ncommand = ["echo", "{vars.a}"]\n'
    assert load(write(tmp_path, text)).units["u"].command == ["echo", "{vars.a}"]


def test_problem_count_is_capped(tmp_path: Path) -> None:
    deps = ", ".join(f'"nope{i}"' for i in range(200))
    text = f'[units.a]\nreplicas = 200\ncommand = ["t"]\ndepends_on = [{deps}]\n'
    with pytest.raises(SpecErrors) as info:
        load(write(tmp_path, text))
    assert len(info.value.errors) <= limits.MAX_COLLECTED_ERRORS + 200
    lines = str(info.value).splitlines()
    assert lines[0].endswith("+ problems in the stack:")
    assert len(lines) == limits.MAX_REPORTED_ERRORS + 2 and lines[-1].startswith("  ... and")


def test_messages_stay_on_one_line(tmp_path: Path) -> None:
    err = SpecError("bad\nvalue \x1b[31m", file="a\nb.toml", unit="u\u202e", field="f")
    text = str(err)
    assert "\n" not in text and "\x1b" not in text and "\u202e" not in text
    assert text == "a\\nb.toml, unit 'u\\u202e', field 'f': bad value \\x1b[31m"


# ------------------------------------------------------------------------- state dir


def test_state_dir_checks_create_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StateDirError, match="exists and is not a directory"):
        statedir.check(blocker, will_create=False)
    with pytest.raises(StateDirError, match=f"cannot be created: {blocker} is not a directory"):
        statedir.check(blocker / "a" / "b", will_create=True)
    with pytest.raises(StateDirError, match="too deep for a unix socket path"):
        statedir.check(tmp_path / ("d" * 120), will_create=True)
    statedir.check(tmp_path / "new" / "deeper", will_create=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_state_dir_create_reports_the_os_refusal(tmp_path: Path) -> None:
    with pytest.raises(StateDirError, match="cannot be created"):
        statedir.create(Path("/proc/self/dynamod-state"))
    statedir.create(tmp_path / "s")
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700


def test_tomlfile_resolve_refuses_nul(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="NUL"):
        tomlfile.resolve(Path("a\0b"))


@pytest.mark.parametrize("url", ["127.0.0.1:80/health", "ftp://h/", "http://", "http://h:99999/",
                                 "http://h:port/"])
def test_probe_urls_are_http_urls(tmp_path: Path, url: str) -> None:
    text = f'[units.a]\ncommand = ["t"]\n[units.a.ready]\nkind = "http"\nurl = "{url}"\n'
    err = refusal(write(tmp_path, text))
    assert err.field == "ready.url" and "URL" in err.message and "Value error" not in err.message
    text = text.replace(url, "https://127.0.0.1:8443/health")
    assert load(write(tmp_path, text)).units["a"].ready is not None
