"""slime's own code (THUDM/slime at the commit ``SLIME_COMMIT`` names, Apache-2.0: the tarball beside this
file, with its LICENSE), unchanged, imported on a CPU machine that has neither ray, Megatron nor a GPU build
of SGLang.

What slime imports from those three is stubbed here, by name: a module of the stubbed packages hands out a
placeholder for any name (a class that refuses to be used), so importing slime's modules works and any call
into a stub these tests did not mean to make fails loudly. Only what the tests do make work for real:

- ray: ``ray.remote`` actors run in this process (``.remote()`` of a method returns a future from a thread
  pool, ``ray.get`` waits for it) and ``get_node_ip_address`` is loopback, so slime's own calls between its
  driver, its ``SGLangEngine`` actors and its weight updater run as slime makes them;
- Megatron's argument parser: slime's ``parse_args`` parses slime's own arguments through it; the stub adds
  the few Megatron arguments slime's parsing reads, at Megatron's defaults;
- SGLang: ``ServerArgs`` names the server arguments slime sets (its field names, so slime keeps them), with
  ``add_cli_args`` adding none of SGLang's own flags.

Everything slime sends over HTTP and torch.distributed is real. Import it in a process of its own (the
``slime_driver`` script): the stubs stay in ``sys.modules``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import sys
import tarfile
import types
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

SLIME_COMMIT = "624b824"  # THUDM/slime's commit whose source the tarball holds
TARBALL = Path(__file__).with_name(f"slime-{SLIME_COMMIT}.tar.gz")
STUBBED = ("ray", "megatron", "sglang.srt", "wandb")  # packages slime imports that this machine does not have


def extract(into: Path) -> Path:
    """Unpack the tarball under ``into``; returns the directory to put on ``sys.path``."""
    with tarfile.open(TARBALL) as tar:
        tar.extractall(into, filter="data")
    (root,) = into.iterdir()
    assert (root / "slime" / "__init__.py").is_file(), f"no slime package in {TARBALL}"
    return root


# -- stubbed packages ---------------------------------------------------------------------------------------


def _placeholder(name: str) -> type:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{name} is a stub (slime's tests on CPU do not run it)")

    return type(name.rsplit(".", 1)[-1], (), {"__init__": refuse, "__module__": name.rsplit(".", 1)[0]})


class StubModule(types.ModuleType):
    """A module of a stubbed package: any name it lacks is a placeholder class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if any(k == full or k.startswith(full + ".") for k in _WORKING):  # a module with working names
            value: Any = importlib.import_module(full)
        else:
            value = _placeholder(full)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == p or fullname.startswith(p + ".") for p in STUBBED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StubModule(spec.name)
        module.__path__ = []
        module.__dict__.update(_WORKING.get(spec.name, {}))
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


# -- the parts that work -----------------------------------------------------------------------------------

_POOL = ThreadPoolExecutor(16, thread_name_prefix="ray-stub")


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Future[Any]:
        return _POOL.submit(self.fn, *args, **kwargs)


class _Actor:
    """A ray actor handle: every method has ``.remote`` (run in a thread here)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


class _ActorClass:
    def __init__(self, cls: type) -> None:
        self.cls = cls

    def options(self, **_: Any) -> _ActorClass:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> _Actor:
        return _Actor(self.cls(*args, **kwargs))


def _ray_remote(*args: Any, **_: Any) -> Any:
    if len(args) == 1 and isinstance(args[0], type):
        return _ActorClass(args[0])
    return lambda cls: _ActorClass(cls)


def _ray_get(refs: Any, timeout: float | None = None) -> Any:
    if isinstance(refs, Sequence):
        return [r.result(timeout) for r in refs]
    return refs.result(timeout)


@dataclasses.dataclass
class ServerArgs:
    """SGLang's ServerArgs, by the names of the fields slime sets (so that slime keeps and checks them)."""

    model_path: str = ""
    trust_remote_code: bool = False
    random_seed: int | None = None
    enable_memory_saver: bool = False
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    gpu_id_step: int = 1
    base_gpu_id: int = 0
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    skip_server_warmup: bool = False
    enable_draft_weights_cpu_backup: bool = False
    enable_metrics: bool = False
    dtype: str = "auto"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """SGLang's flags of these fields, at SGLang's defaults (slime adds them as ``--sglang-*``, except
        those it sets itself)."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                parser.add_argument(flag, action="store_true", default=f.default)
            else:
                kind = str if f.default is None else type(f.default)
                parser.add_argument(flag, type=kind, default=f.default)


def _megatron_parse_args(extra_args_provider: Callable[..., Any], ignore_unknown_args: bool = False) -> Any:
    """Megatron's ``parse_args``: slime's own arguments (``extra_args_provider``) and the Megatron ones that
    slime's parsing reads, at Megatron's defaults."""
    parser = extra_args_provider(argparse.ArgumentParser(allow_abbrev=False))
    for flag, kw in _MEGATRON_ARGS.items():
        if flag not in parser._option_string_actions:  # (slime redefines some of Megatron's)
            parser.add_argument(flag, **kw)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    return args


_MEGATRON_ARGS: dict[str, dict[str, Any]] = {
    "--fp16": {"action": "store_true"},
    "--bf16": {"action": "store_true"},
    "--seq-length": {"type": int, "default": None},
    "--max-position-embeddings": {"type": int, "default": None},
    "--multi-latent-attention": {"action": "store_true"},
    "--vocab-size": {"type": int, "default": None},
    "--tokenizer-model": {"type": str, "default": None},
    "--tokenizer-type": {"type": str, "default": None},
    "--micro-batch-size": {"type": int, "default": None},
    "--global-batch-size": {"type": int, "default": None},
    "--tensor-model-parallel-size": {"type": int, "default": 1},
    "--pipeline-model-parallel-size": {"type": int, "default": 1},
    "--context-parallel-size": {"type": int, "default": 1},
    "--expert-model-parallel-size": {"type": int, "default": 1},
    "--seed": {"type": int, "default": 1234},
    "--load": {"type": str, "default": None},
    "--save": {"type": str, "default": None},
    "--save-interval": {"type": int, "default": None},
    "--lr": {"type": float, "default": None},
    "--use-dynamic-batch-size": {"action": "store_true"},
}


def _get_node_ip_address() -> str:
    return "127.0.0.1"


def _rank_zero(*args: Any, **kwargs: Any) -> int:
    return 0


# Megatron's parallel state of a trainer of one process: it is rank 0 of data, tensor and pipeline parallelism
_MPU = types.SimpleNamespace(
    get_data_parallel_rank=_rank_zero,
    get_tensor_model_parallel_rank=_rank_zero,
    get_pipeline_model_parallel_rank=_rank_zero,
)


_WORKING: dict[str, dict[str, Any]] = {
    "ray": {"remote": _ray_remote, "get": _ray_get, "ObjectRef": Future},
    "ray._private.services": {"get_node_ip_address": _get_node_ip_address},
    "sglang.srt.server_args": {"ServerArgs": ServerArgs},
    "megatron.training.arguments": {"parse_args": _megatron_parse_args},
    "megatron.core": {"mpu": _MPU},
}


def install(root: Path, working: dict[str, dict[str, Any]] | None = None) -> None:
    """Put slime (unpacked at ``root``) and the stubs on the import path of this process; ``working`` adds
    or replaces the working names of stubbed modules (module name -> {name: value})."""
    for name, attrs in (working or {}).items():
        _WORKING.setdefault(name, {}).update(attrs)
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, str(root))


def install_cpu_accelerator() -> None:
    """slime's accelerator for this CPU: slime selects one among those registered (CUDA, MUSA) and has none
    for a CPU; this one is installed through slime's own hook (``accelerator.set_accelerator``). Weight
    updates then go over gloo, as slime would send them over NCCL."""
    import torch
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    class CPUAccelerator(Accelerator):
        name = "cpu"
        device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index: Any = None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index: Any = None) -> str:
            return "cpu"

        def set_device(self, index: Any) -> None:
            pass

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def synchronize(self, device: Any = None) -> None:
            pass

        def current_stream(self, device: Any = None) -> None:
            return None

        def empty_cache(self) -> None:
            pass

        def mem_get_info(self, device: Any = None) -> tuple[int, int]:
            return (0, 0)

        def memory_allocated(self, device: Any = None) -> int:
            return 0

        def memory_reserved(self, device: Any = None) -> int:
            return 0

    accelerator.set_accelerator(CPUAccelerator())
