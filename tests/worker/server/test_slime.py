"""slime's own code, unchanged, with its default arguments, against two engines (2 ranks each: one at 2x1, one
at 1x2) behind the real sglang-router that slime starts itself: slime's argument parsing and its checks of
each external engine's ``/server_info``, registration with the router, two rollouts of its
``generate_rollout`` with partial rollout (the unfinished groups aborted slime's way at the end of the first
and continued in the second), and between them its distributed weight update (a process group of the
trainer and every engine rank, sized from ``/server_info``'s ``num_gpus``).

slime runs in a process of its own (``slime_driver``). Its sampling is greedy (``--rollout-top-k 1``: slime
refuses temperature 0), so every token it reports can be checked against the engine library's own run of
the same request on the same weights, float64."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from transformers import AutoTokenizer

from tests.worker.server.served import Served, start

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).parents[3]
MAX_NEW = 160  # slime's --rollout-max-response-len
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
CANDIDATES = [f"Question {i}" for i in range(64)]


@pytest.fixture(scope="module")
def engines(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Served]]:
    """Checkpoint a, float64, no API key (slime sends none; loopback), at 2x1 and at 1x2."""
    tmp = tmp_path_factory.mktemp("slime-engines")
    args = ("--ranks", "2", "--dtype", "float64")
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda lay: start(root / "a", tmp, *args, "--layout", lay), ["2x1", "1x2"]))
    yield started
    for e in started:
        e.stop()


def _greedy(model: Path, requests: dict[str, tuple[list[int], int]], stop: int) -> dict[str, list[int]]:
    """The engine library's own greedy run (one rank) of each request id -> (prompt ids, max new tokens)."""
    cfg = EngineConfig.load(str(model), 1, dtype="float64")
    specs = [
        RequestSpec(rid, tuple(p), n, Sampling(), stop_token_ids=(stop,)) for rid, (p, n) in requests.items()
    ]
    return run_batch(cfg, specs).tokens()


def _workload(root: Path) -> tuple[int, list[str]]:
    """A stop token and prompts in which it makes half the groups short: four prompts whose greedy output
    meets the token within a few tokens, four whose output never does, alternating, then more long ones.
    The short groups end the first rollout while the long ones are mid-decode, so slime's abort leaves
    partial responses to continue (what partial rollout is for)."""
    tok = AutoTokenizer.from_pretrained(str(root / "a"))
    prompts = {t: tok.encode(t, add_special_tokens=False) for t in CANDIDATES}
    eos = int(json.loads((root / "a" / "config.json").read_text())["eos_token_id"])
    out = _greedy(root / "a", {t: (p, MAX_NEW) for t, p in prompts.items()}, eos)
    for stop in sorted({x for o in out.values() for x in o[2:6]} - {eos}):
        short = [t for t in CANDIDATES if stop in out[t][2:6] and stop not in out[t][:2]]
        long = [t for t in CANDIDATES if stop not in out[t] and len(out[t]) == MAX_NEW]
        if len(short) >= 4 and len(long) >= 8:
            return stop, [x for pair in zip(short[:4], long[:4], strict=True) for x in pair] + long[4:8]
    raise AssertionError("no token stops four prompts early (the tiny checkpoint changed?)")


def _run_slime(engines: list[Served], root: Path, stop: int, prompts: list[str], tmp: Path) -> dict[str, Any]:
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    args = ["--num-rollout", "2", "--rollout-batch-size", "4", "--over-sampling-batch-size", "8"]
    args += ["--n-samples-per-prompt", "2", "--rollout-max-response-len", str(MAX_NEW)]
    args += ["--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label"]
    args += ["--rm-type", "deepscaler", "--partial-rollout", "--rollout-top-k", "1"]
    args += ["--rollout-stop-token-ids", str(stop)]
    spec = {
        "engines": [e.url.removeprefix("http://") for e in engines],
        "hf_checkpoint": str(root / "a"),
        "update": str(root / "b" / "model.safetensors"),
        "args": args,
        "out": str(tmp / "report.json"),
    }
    return _driver("slime_driver", spec, tmp)


def _driver(module: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run ``tests.worker.server.<module>`` on ``spec`` (slime in a process of its own); its report."""
    (tmp / "spec.json").write_text(json.dumps(spec))
    log = tmp / "slime.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"tests.worker.server.{module}", str(tmp / "spec.json")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,  # its own group: slime's router process goes with it
        )
        try:
            code = proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert code == 0, f"slime failed (exit {code}):\n{tail}"
    report: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    return report


def test_slime_with_its_defaults_against_2x1_and_1x2_engines(
    engines: list[Served], root: Path, tmp_path: Path
) -> None:
    stop, prompts = _workload(root)
    report = _run_slime(engines, root, stop, prompts, tmp_path)

    # start-up: slime's defaults (no rollout offload) passed its /server_info check of each engine, it sized
    # the engines by their num_gpus (2 ranks each), and both registered with the router slime started
    assert report["args"]["offload_rollout"] is False
    assert [i["num_gpus"] for i in report["args"]["engine_infos"]] == [2, 2]
    assert [i["server_info"]["enable_memory_saver"] for i in report["args"]["engine_infos"]] == [False, False]
    assert report["args"]["rollout_num_gpus"] == 4
    assert sorted(w["url"] for w in report["router_workers"]) == sorted(e.url for e in engines)

    first, second = report["rollout_0"], report["rollout_1"]
    for rollout in (first, second):
        assert rollout["loads_after"] == [0, 0]  # slime's abort left the engines idle
        for s in rollout["samples"] + rollout["buffered"]:
            assert len(s["log_probs"]) == s["response_length"] <= MAX_NEW  # one logprob per token
    assert len(first["samples"]) == 8
    assert {s["status"] for s in first["samples"]} <= {"completed", "truncated"}

    # the weight update: a group of 1 + 2 + 2 ranks, both engines on version 1 after it
    assert report["update"]["world_size"] == 5 and report["update"]["versions"] == ["1", "1"]

    # every token checked against the engine library's greedy run: on checkpoint a before the update, on b
    # after it; a continued sample is its prefix (a) then the continuation of prompt + prefix (b)
    partial = {s["index"]: s for s in first["buffered"]}
    refs_a: dict[str, tuple[list[int], int]] = {}
    refs_b: dict[str, tuple[list[int], int]] = {}
    checks: list[tuple[dict[str, Any], int, list[int]]] = []  # (sample, prompt length, prefix from a)
    for s in first["samples"] + first["buffered"]:
        plen = len(s["tokens"]) - s["response_length"]
        refs_a[f"a{s['index']}"] = (s["tokens"][:plen], MAX_NEW)
    for s in second["samples"]:
        before = partial.get(s["index"])
        if before is not None and before["status"] != "aborted":  # finished in its group's first rollout
            assert s == before
            continue
        if before is None:  # a fresh sample, all on b
            plen = len(s["tokens"]) - s["response_length"]
            prefix: list[int] = []
        else:  # continued: the prefix it had when slime aborted it
            plen = len(before["tokens"]) - before["response_length"]
            prefix = before["tokens"][plen:]
            assert s["tokens"][: len(before["tokens"])] == before["tokens"]
            assert s["log_probs"][: len(prefix)] == before["log_probs"]
        refs_b[f"b{s['index']}"] = (s["tokens"][:plen] + prefix, MAX_NEW - len(prefix))
        checks.append((s, plen, prefix))
    got_a = _greedy(root / "a", refs_a, stop)
    got_b = _greedy(root / "b", refs_b, stop)

    for s in first["samples"]:
        plen = len(s["tokens"]) - s["response_length"]
        assert s["tokens"][plen:] == got_a[f"a{s['index']}"], s["index"]
        assert s["weight_versions"] == ["default"]
    for s in first["buffered"]:  # what the abort left: a prefix of the uninterrupted run
        plen = len(s["tokens"]) - s["response_length"]
        assert s["tokens"][plen:] == got_a[f"a{s['index']}"][: s["response_length"]], s["index"]
    continued = 0
    for s, plen, prefix in checks:
        assert s["tokens"][plen:] == prefix + got_b[f"b{s['index']}"], s["index"]
        assert s["weight_versions"][-1] == "1"
        continued += 0 < len(prefix) < s["response_length"]
    assert continued >= 2, "no partial rollout continued a response that had tokens"


# -- slime's colocated weight update: flattened buckets through update_weights_from_tensor -------------------


@pytest.fixture(scope="module")
def colocated(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """An engine on checkpoint a, float64, 2 ranks, that trusts pickled tensors (slime's colocated trainer is
    on its host) and loads checkpoints below ``root``; no API key (slime sends none)."""
    args = ("--ranks", "2", "--dtype", "float64", "--weights-root", str(root), "--trust-pickled-tensors")
    s = start(root / "a", tmp_path_factory.mktemp("slime-colocated"), *args)
    yield s
    s.stop()


@pytest.mark.parametrize("older", [False, True], ids=["current-bucket", "older-bucket"])
def test_slimes_colocated_path_loads_flattened_buckets(
    colocated: Served, root: Path, tmp_path: Path, older: bool
) -> None:
    """slime's own ``_send_to_colocated_engine`` sends checkpoint b in two chunks of flattened buckets
    (``load_format: "flattened_bucket"``, weight version 1) through its ``SGLangEngine``; the engine's outputs
    then equal a disk load of b."""
    prompts = {"input_ids": [[1, 2, 3], [40, 41], [200, 100, 50, 25]], "sampling_params": GREEDY}

    def outputs() -> list[list[int]]:
        r = colocated.post("/generate", prompts)
        assert r.status_code == 200, r.text
        return [o["output_ids"] for o in r.json()]

    def disk(name: str) -> None:
        assert (
            colocated.post("/update_weights_from_disk", {"model_path": str(root / name)}).status_code == 200
        )

    disk("b")
    from_disk = outputs()
    disk("a")
    assert outputs() != from_disk
    spec = {
        "engine": colocated.url.removeprefix("http://"),
        "hf_checkpoint": str(root / "a"),
        "update": str(root / "b" / "model.safetensors"),
        "older": older,
        "out": str(tmp_path / "report.json"),
    }
    report = _driver("slime_colocated", spec, tmp_path)
    # one request per chunk (the older bucket: per dtype, and the checkpoint has one), each a success
    assert len(report["responses"]) == 2 and all(r["success"] for r in report["responses"]), report
    assert report["version"] == "1" and report["multi_dtypes"] is not older
    assert outputs() == from_disk
