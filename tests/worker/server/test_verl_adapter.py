"""VeRL's HTTP adapter (``verl/workers/rollout/sglang_rollout/http_server_engine.py``), imported unchanged
from the ``verl`` wheel that ``make setup`` downloads, against our server: every method it has. Its ``sglang``
imports are stubbed here (the real ones need a GPU build of SGLang); the stub ``launch_server`` execs
``rolloutctl serve`` in the process VeRL starts, so VeRL's own start-up (``launch_server_process``: health,
then flush) and shutdown (``kill_process_tree``) run too."""

from __future__ import annotations

import abc
import asyncio
import importlib.util
import logging
import os
import signal
import sys
import threading
import types
import zipimport
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import torch
from rollout_worker.proc import die_with_parent, free_port, rolloutctl
from safetensors.torch import load_file

from tests.waiting import wait_until
from tests.worker.server.served import alive, descendants
from tests.worker.server.sglang_tensors import file_system_sharing, flattened_buckets, per_rank
from tests.worker.server.test_control import LONG, _static

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).parents[3]
WHEEL = ROOT / "build" / "wheels" / "verl-0.9.1-py3-none-any.whl"
MODULE = "verl/workers/rollout/sglang_rollout/http_server_engine.py"
PROMPTS = [[1, 2, 3], [40, 41], [200, 100, 50, 25]]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


# -- the stubs of what the module imports from sglang ----------------------------------------------------


class EngineBase(abc.ABC):  # sglang.srt.entrypoints.EngineBase: the six verbs an engine must have
    @abc.abstractmethod
    def generate(self, *args: Any, **kwargs: Any) -> Any: ...
    @abc.abstractmethod
    def flush_cache(self) -> Any: ...
    @abc.abstractmethod
    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> Any: ...
    @abc.abstractmethod
    def release_memory_occupation(self, *args: Any, **kwargs: Any) -> Any: ...
    @abc.abstractmethod
    def resume_memory_occupation(self, *args: Any, **kwargs: Any) -> Any: ...
    @abc.abstractmethod
    def shutdown(self) -> Any: ...


@dataclass
class UpdateWeightsFromTensorReqInput:  # sglang.srt.managers.io_struct
    serialized_named_tensors: list[bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class ServerArgs:  # sglang.srt.server_args: the fields the adapter reads, plus our server's own flags
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    node_rank: int = 0
    is_embedding: bool = False
    api_key: str | None = None
    rollout_args: tuple[str, ...] = ()
    log: str = os.devnull

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def launch_server(args: ServerArgs) -> None:
    """sglang.srt.entrypoints.http_server.launch_server, run by VeRL in a process it forks: our server."""
    die_with_parent()  # (kept across exec: a killed test leaves no server behind)
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    argv = [*rolloutctl(), "serve", "--model", args.model_path, "--host", args.host, "--port", str(args.port)]
    os.execv(argv[0], [*argv, *args.rollout_args])


def kill_process_tree(pid: int) -> None:
    """sglang.srt.utils.kill_process_tree: SIGTERM (the server stops its ranks), then wait for the exit."""
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not alive([pid]), what=f"process {pid} to exit", timeout=60)


def _stubs() -> dict[str, types.ModuleType]:
    names = {
        "sglang.srt.entrypoints.EngineBase": {"EngineBase": EngineBase},
        "sglang.srt.entrypoints.http_server": {"launch_server": launch_server},
        "sglang.srt.managers.io_struct": {"UpdateWeightsFromTensorReqInput": UpdateWeightsFromTensorReqInput},
        "sglang.srt.server_args": {"ServerArgs": ServerArgs},
        "sglang.srt.utils": {"kill_process_tree": kill_process_tree},
    }
    mods = {
        p: types.ModuleType(p)
        for p in ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.managers")
    }
    for name, attrs in names.items():
        mods[name] = types.ModuleType(name)
        mods[name].__dict__.update(attrs)
    return mods


def load_adapter_module() -> types.ModuleType:
    """The module, from the wheel as it is (no copy, no edit), with the sglang stubs in sys.modules while it
    imports (the real sglang, installed for the frontend tests, is put back after)."""
    if not WHEEL.is_file():
        pytest.fail(f"{WHEEL} is missing: run `make setup` (it downloads the verl wheel)", pytrace=False)
    folder, name = MODULE.rsplit("/", 1)
    spec = zipimport.zipimporter(f"{WHEEL}/{folder}/").find_spec(name.removesuffix(".py"))
    assert spec is not None and spec.loader is not None, f"{MODULE} is not in {WHEEL.name}"
    module = importlib.util.module_from_spec(spec)
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(_stubs())
    try:
        spec.loader.exec_module(module)
    finally:
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return module


@dataclass
class Verl:
    module: types.ModuleType
    adapter: Any  # HttpServerAdapter
    aio: Any  # AsyncHttpServerAdapter, same server
    url: str
    log: Path


@pytest.fixture(scope="module")
def verl(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Verl]:
    """Our server (2 ranks, float64, checkpoint a; pickled tensors trusted, no API key: the adapter sends
    none), started by the adapter itself."""
    module = load_adapter_module()
    log = tmp_path_factory.mktemp("verl") / "server.log"
    port = free_port()
    args = ("--ranks", "2", "--dtype", "float64", "--weights-root", str(root), "--trust-pickled-tensors")
    kw = dict(model_path=str(root / "a"), port=port, rollout_args=args, log=str(log), timeout=60.0)
    adapter = module.HttpServerAdapter(first_rank_in_node=True, max_start_wait_time=240.0, **kw)
    aio = module.AsyncHttpServerAdapter(launch_server=False, **kw)
    try:
        yield Verl(module, adapter, aio, f"http://127.0.0.1:{port}", log)
    finally:
        if adapter.process.is_alive():
            adapter.shutdown()


def _outputs(v: Verl) -> list[list[int]]:
    return [v.adapter.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]


def test_the_adapter_is_verls_own(verl: Verl) -> None:
    assert verl.module.__file__ == f"{WHEEL}/{MODULE}"
    assert issubclass(verl.module.AsyncHttpServerAdapter, EngineBase)
    assert verl.adapter.process.is_alive()  # launch_server_process: /health_generate, then /flush_cache


def test_generate(verl: Verl, root: Path) -> None:
    static = _static(root / "a", PROMPTS)
    assert _outputs(verl) == static
    out = verl.adapter.generate(
        input_ids=PROMPTS[0],
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == static[0]
    assert len(meta["input_token_logprobs"]) == 3 and meta["input_token_logprobs"][0][0] is None
    assert all(len(x) == 2 for x in meta["output_top_logprobs"])

    async def both() -> list[Any]:
        return await asyncio.gather(
            verl.aio.generate(input_ids=PROMPTS[1], sampling_params=GREEDY),
            verl.aio.async_generate(input_ids=PROMPTS[2], sampling_params=GREEDY, return_logprob=True),
        )

    got = asyncio.run(both())
    assert [g["output_ids"] for g in got] == static[1:]


def test_models_flush_and_memory(verl: Verl) -> None:
    models = asyncio.run(verl.aio.available_models())
    assert models["data"][0]["id"]
    assert verl.adapter.flush_cache()["success"] is True
    assert asyncio.run(verl.aio.flush_cache())["success"] is True
    before = _outputs(verl)
    # VeRL's sleep and wake: release kv_cache and weights, then resume the weights (to load new ones), then
    # the KV cache
    assert verl.adapter.release_memory_occupation(["kv_cache", "weights"])["success"] is True
    with pytest.raises(Exception, match="503"):
        verl.adapter.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert verl.adapter.resume_memory_occupation(["weights"])["success"] is True
    assert asyncio.run(verl.aio.resume_memory_occupation(["kv_cache"]))["success"] is True
    assert _outputs(verl) == before
    assert asyncio.run(verl.aio.release_memory_occupation())["success"] is True  # tags None: all of them
    assert verl.adapter.resume_memory_occupation()["success"] is True
    assert _outputs(verl) == before


def _long(v: Verl, out: list[Any], rid: str | None = None) -> threading.Thread:
    body = {"input_ids": [1, 2], "sampling_params": LONG, **({"rid": rid} if rid else {})}

    def run() -> None:
        out.append(httpx.post(v.url + "/generate", json=body, timeout=120).json())

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: _busy(v), what="a request running")
    return t


def _busy(v: Verl) -> bool:
    return sum(x["num_reqs"] for x in httpx.get(v.url + "/get_load").json()) > 0


def test_abort(verl: Verl) -> None:
    out: list[Any] = []
    t = _long(verl, out)
    assert verl.adapter.abort_request(abort_all=True)["success"] is True
    t.join(60)
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    t = _long(verl, out, rid="verl-long")
    assert asyncio.run(verl.aio.abort_request(rid="verl-long"))["aborted"] == 1
    t.join(60)
    assert out[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert verl.adapter.abort_request(rid="no-such-request")["aborted"] == 0


def _tensors(model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model / "model.safetensors"))


def test_update_weights_from_tensor(verl: Verl, root: Path) -> None:
    """VeRL's weight sync: the trainer's tensors (SGLang's pickled form, per TP rank) through the adapter;
    after it, outputs equal a static run of the new checkpoint."""
    a, b = _tensors(root / "a"), _tensors(root / "b")
    static_a, static_b = _static(root / "a", PROMPTS), _static(root / "b", PROMPTS)
    assert static_a != static_b and _outputs(verl) == static_a
    req = verl.module.UpdateWeightsFromTensorReqInput
    with file_system_sharing():
        r = verl.adapter.update_weights_from_tensor(
            req(serialized_named_tensors=per_rank(b), flush_cache=True)
        )
        assert r["success"] is True, r
        assert _outputs(verl) == static_b
        names = sorted(a)  # back to a in two buckets, as VeRL sends a large model
        for bucket in (names[: len(names) // 2], names[len(names) // 2 :]):
            tensors = per_rank({n: a[n] for n in bucket})
            r = asyncio.run(verl.aio.update_weights_from_tensor(req(serialized_named_tensors=tensors)))
            assert r["success"] is True, r
    assert _outputs(verl) == static_a


def test_update_weights_from_tensor_in_a_flattened_bucket(verl: Verl, root: Path) -> None:
    """The adapter posting ``load_format: "flattened_bucket"``, each entry SGLang's serialized
    ``{"flattened_tensor", "metadata"}`` (one per TP rank, as SGLang's ``Engine.update_weights_from_tensor``
    takes them): after it, outputs equal a disk load of the same checkpoint."""

    def disk(name: str) -> None:
        r = httpx.post(
            verl.url + "/update_weights_from_disk", json={"model_path": str(root / name)}, timeout=120
        )
        assert r.status_code == 200, r.text

    disk("b")
    from_disk = _outputs(verl)
    disk("a")
    assert _outputs(verl) != from_disk
    req = verl.module.UpdateWeightsFromTensorReqInput
    with file_system_sharing():
        (payloads,) = flattened_buckets(_tensors(root / "b"))
        r = verl.adapter.update_weights_from_tensor(
            req(serialized_named_tensors=payloads, load_format="flattened_bucket")
        )
        assert r["success"] is True, r
        assert _outputs(verl) == from_disk
        for payloads in flattened_buckets(_tensors(root / "a"), older=True):  # the older bucket, per dtype
            bucket = req(serialized_named_tensors=payloads, load_format="flattened_bucket")
            assert asyncio.run(verl.aio.update_weights_from_tensor(bucket))["success"] is True
    assert _outputs(verl) == _static(root / "a", PROMPTS)


def test_what_sglang_refuses_without_lora_or_a_reward_model(
    verl: Verl, caplog: pytest.LogCaptureFixture
) -> None:
    """LoRA and /classify answer as SGLang does when LoRA is off and the model generates: 400 and a reason."""
    caplog.set_level(logging.ERROR)
    lora = types.SimpleNamespace(lora_name="l", config_dict={"r": 8}, serialized_named_tensors=[b"x"])
    calls = {
        "LoRA": lambda: verl.aio.load_lora_adapter_from_tensor(lora),
        "LoRA ": lambda: verl.aio.unload_lora_adapter("l"),
        "embedding": lambda: verl.aio.reward_score(input_ids=[1, 2, 3]),
        "embedding ": lambda: verl.aio.async_reward_score(input_ids=[1, 2, 3]),
    }
    for words, call in calls.items():
        caplog.clear()
        with pytest.raises(aiohttp.ClientResponseError) as err:
            asyncio.run(call())
        assert err.value.status == 400, words
        assert words.strip() in caplog.text, caplog.text
    for path, body in (
        ("/load_lora_adapter", {"lora_name": "l", "lora_path": "/x"}),
        ("/encode", {"text": "a"}),
    ):
        r = httpx.post(verl.url + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, (path, r.text)
    assert httpx.post(verl.url + "/load_lora_adapter", timeout=30).json()["success"] is False
    with pytest.raises(AssertionError, match="embedding"):  # the sync adapter checks before it asks
        verl.adapter.reward_score(input_ids=[1, 2, 3])


def test_shutdown(verl: Verl) -> None:
    pid = verl.adapter.process.pid
    ranks = descendants(pid)
    assert len(ranks) >= 2
    verl.adapter.shutdown()
    verl.adapter.process.join(30)
    assert verl.adapter.process.exitcode == 0
    wait_until(lambda: not alive(ranks), what="the ranks to exit")
