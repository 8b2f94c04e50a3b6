"""verl's `cpu` platform: what verl 0.9.1 lacks to train on a machine without an accelerator.

verl resolves its platform once (`verl.plugin.platform.get_platform`): it probes the
registered platforms in order and falls back to `nvidia`, so on a CPU-only host every
`get_torch_device()` is `torch.cuda` and `auto_set_device` turns `trainer.device=cpu`
into `cuda`. `PlatformCPU` is registered last, so an accelerator that is present still
wins the probe; on a host with none it is chosen: device `cpu`, collective backend
`gloo`, `current_device()` = "cpu", Ray resource `GPU` (verl's resource pools ask for one
accelerator per rank: on CPU that is Ray's logical `num_gpus`, which the stack's Ray head
advertises), and a device module whose cache, memory and stream calls do nothing.

Two more places in verl assume an accelerator; `install()` patches them, and only on the
`cpu` platform (docs/verl.md says which belong upstream):

* `verl.utils.distributed` builds the process-group backend as
  `"cpu:gloo,<device>:<backend>"`: on CPU that is `"cpu:gloo,cpu:gloo"`, which torch
  refuses (`Duplicate device type cpu`). `init_process_group` is given `gloo` instead.
* `EngineRegistry.get_engine_cls` looks engines up by device, and the FSDP engines are
  registered for `cuda` and `npu` only. On CPU the lookup uses `cuda`'s entry (what
  `VERL_ENGINE_DEVICE=cuda` does by hand); FSDP2 then runs on the CPU over gloo.

Must run before anything calls `get_platform()`: the `verl.plugins` entry point loads it
from `import verl`, in the driver and in every Ray worker.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM = "cpu"
GLOO = "gloo"
PATCHED = "_dynamod_cpu"


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    """(free, total) host memory: what verl logs and sizes caches by."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free, pages


def cpu_device_module() -> types.ModuleType:
    """`torch.cpu` with the accelerator calls verl makes answered harmlessly."""
    module = types.ModuleType("dynamod_verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    calls: dict[str, Callable[..., Any]] = {
        "empty_cache": _nothing,
        "ipc_collect": _nothing,
        "reset_peak_memory_stats": _nothing,
        "set_per_process_memory_fraction": _nothing,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "mem_get_info": _mem_get_info,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
        "get_device_name": lambda *a, **k: "cpu",
        "current_device": lambda: "cpu",
    }
    for name, call in calls.items():
        setattr(module, name, call)
    return module


class PlatformCPU(PlatformBase):  # type: ignore[misc]
    """verl's platform on a host with no accelerator (the probe's last resort)."""

    _module = cpu_device_module()

    @property
    def device_name(self) -> str:
        return PLATFORM

    @property
    def vendor_name(self) -> str:
        return PLATFORM

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True  # probed last: reached only when no accelerator answered

    def current_device(self) -> Any:
        return PLATFORM  # torch.device("cpu"), not an index: verl builds devices from it

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return GLOO

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # Ray sets it for logical GPUs; nothing reads it here

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def on_cpu() -> bool:
    from verl.plugin.platform import get_platform

    return bool(get_platform().device_name == PLATFORM)


def cpu_backend(backend: Any) -> Any:
    """The process-group backend verl asks for, made one torch accepts on CPU."""
    if isinstance(backend, str) and backend.replace(" ", "") == "cpu:gloo,cpu:gloo":
        return GLOO
    return backend


def _patch_distributed() -> None:
    """torch.distributed.init_process_group given verl's CPU backend string, fixed.

    Only the string torch refuses anyway is rewritten, so the patch is inert elsewhere."""
    import torch.distributed

    original = torch.distributed.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (cpu_backend(args[0]), *args[1:])
        elif "backend" in kwargs:
            kwargs["backend"] = cpu_backend(kwargs["backend"])
        return original(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group


def _patch_engine_registry() -> None:
    with warnings.catch_warnings():
        # verl.workers.engine warns once per optional engine it cannot import (megatron,
        # torchtitan, ...); importing it here, in every process, would print them before
        # anything runs, refusals included. On CPU only FSDP is used.
        warnings.filterwarnings("ignore", ".* engine is not available", UserWarning)
        from verl.workers.engine.base import EngineRegistry

    registry: Any = EngineRegistry
    original = registry.get_engine_cls.__func__

    def get_engine_cls(cls: Any, model_type: str, backend: str) -> Any:
        if on_cpu() and not os.environ.get("VERL_ENGINE_DEVICE"):
            os.environ["VERL_ENGINE_DEVICE"] = "cuda"
            try:
                return original(cls, model_type, backend)
            finally:
                del os.environ["VERL_ENGINE_DEVICE"]
        return original(cls, model_type, backend)

    registry.get_engine_cls = classmethod(get_engine_cls)


def stack_offer(config: Any) -> Any:
    """What the dynamod stack's Ray head offers, if main_ppo joins it; None if unknown."""
    from dynamod.core.paths import STATE_DIR_ENV
    from dynamod.integrations.verl.errors import StackNotReadyError
    from dynamod.integrations.verl.preflight import RayOffer, get
    from dynamod.integrations.verl.stack import read_stack

    kwargs = get(config, "actor_rollout_ref.rollout.engine_kwargs") or {}
    section = next((kwargs.get(s) for s in ("dynamod", "dynamo") if kwargs.get(s)), None) or {}
    state_dir = get(section, "state_dir") or os.environ.get(STATE_DIR_ENV)
    if not state_dir:
        return None
    try:
        view = read_stack(Path(str(state_dir)))
    except StackNotReadyError:
        return None  # the replica says why when it attaches
    if view.ray_address != get(config, "ray_kwargs.ray_init.address"):
        return None
    var = f"the stack's var {{}} (dynamod up {view.stack} ... --var {{}}=N)"
    return RayOffer(
        cpus=view.ray_cpus if view.ray_cpus is not None else float("inf"),
        gpus=view.ray_gpus if view.ray_gpus is not None else float("inf"),
        where=var.format("ray_num_cpus", "ray_num_cpus"),
        gpus_where=var.format("ray_num_gpus", "ray_num_gpus"),
    )


def refuse_unrunnable(config: Any) -> None:
    """On CPU: the preflight's one line on stderr and exit status 2, before Ray starts."""
    from dynamod.integrations.verl import preflight
    from dynamod.integrations.verl.errors import RolloutConfigError

    try:
        offer = preflight.offer_of(config, os.cpu_count() or 1, stack_offer(config))
        preflight.check(config, offer)
    except RolloutConfigError as exc:
        print(f"verl on CPU (dynamod): refused before Ray starts: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _guard_auto_set_device() -> None:
    """main_ppo calls auto_set_device(config) on the parsed config, before ray.init."""
    from verl.utils import device

    original = device.auto_set_device

    def auto_set_device(config: Any) -> None:
        original(config)
        if on_cpu():
            refuse_unrunnable(config)

    device.auto_set_device = auto_set_device


def install() -> None:
    """Register the platform (last, so an accelerator wins) and patch verl for CPU. Once."""
    if getattr(PlatformRegistry, PATCHED, False):
        return
    PlatformRegistry.register(platform=PLATFORM)(PlatformCPU)
    _patch_distributed()
    _patch_engine_registry()
    _guard_auto_set_device()
    setattr(PlatformRegistry, PATCHED, True)
