"""Job mode end to end, real processes and HTTP: a real engine server (2 ranks) and `rolloutctl sidecar`.

Every prompt x sample exactly once with its fields; pods take disjoint shards; SIGKILL mid-run and a torn
last line, then a restart: the file equals an uninterrupted run's; samples paged as they complete;
progress and state counts; aborted samples are not written but sent again."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_worker.api.sampling import sample_seed
from rollout_worker.api.sidecar import Progress, Sample, SamplesPage, SidecarState
from rollout_worker.data.prompts import ChatTemplate
from rollout_worker.data.reward import reward_of

from tests.waiting import wait_until
from tests.worker.server.served import Served
from tests.worker.sidecar.proc import SidecarProc, lines, sidecar_env, start_sidecar

pytestmark = pytest.mark.multiproc
N_PROMPTS, SAMPLES, SEED = 12, 2, 7
IDS = [f"q{i}" for i in range(N_PROMPTS)]
ALL = {(p, s) for p in IDS for s in range(SAMPLES)}


def job_env(engine: Served, tiny64: Path, prompts: Path, out: Path, **kw: Any) -> dict[str, str]:
    fields: dict[str, Any] = {
        "prompts_path": prompts,
        "model_dir": tiny64,
        "output_dir": out,
        "samples_per_prompt": SAMPLES,
        "temperature": 0.8,
        "top_k": 50,
        "max_new_tokens": 24,
        "stop": ["\n\n"],
        "seed": SEED,
        "max_in_flight": 2,
        **kw,
    }
    return sidecar_env(engine, out.parent, **fields)


def run_to_end(engine: Served, tiny64: Path, prompts: Path, out: Path, **kw: Any) -> SidecarProc:
    env = job_env(engine, tiny64, prompts, out, exit_when_done=True, **kw)
    side = start_sidecar(env, out.parent / f"{out.name}.log", ready=False, may_exit=True)
    assert side.wait(120) == 0, side.tail()
    return side


def keys(recs: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(r["prompt_id"], r["sample"]) for r in recs]


def engine_call(engine: Served, method: str, path: str, body: Any = None) -> Any:
    r = httpx.request(method, engine.url + path, headers=engine.headers, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(engine: Served, tiny64: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run of the whole job on one pod."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run_to_end(engine, tiny64, prompts, out)
    return out / "pod-0.jsonl"


def test_every_prompt_and_sample_once_with_its_fields(reference: Path, engine: Served, tiny64: Path) -> None:
    template = ChatTemplate.of_model(tiny64)
    assert template is not None
    recs = lines(reference)
    assert sorted(keys(recs)) == sorted(ALL)  # each exactly once
    for rec in recs:
        s = Sample.model_validate(rec)
        i = int(s.prompt_id[1:])
        assert s.completion_tokens == len(s.output_ids) == len(s.output_logprobs) > 0
        assert s.completion_tokens <= (3 if i == 5 else 24) and "max_new_tokens" not in rec
        assert all(lp is not None and lp <= 0 for lp in s.output_logprobs)
        assert s.finish_reason is not None and s.finish_reason["type"] in ("stop", "length")
        assert s.layouts == ["2x1"] and s.weight_version == "default"
        assert s.sampling_seed == sample_seed(SEED, s.prompt_id, s.sample)
        assert rec["data_source"] == "arith" and rec["reward_model"] == {"ground_truth": str(2 * i)}
        assert s.reward == reward_of(rec, s.output_text) and s.reward in (0.0, 1.0)
        assert rec["extra_info"] == {"index": i}
        if i % 3 == 0:
            assert s.prompt == f"What is {i} + {i}?"
        elif i % 3 == 1:
            assert s.prompt == template.render([{"role": "user", "content": f"Double {i}."}])
            assert isinstance(s.prompt, str) and s.prompt.endswith(f"user: Double {i}.\nassistant:")
        else:
            assert s.prompt == [10 + i, 20, 30, 40] and s.prompt_tokens == 4
    by_key = {(r["prompt_id"], r["sample"]): r for r in recs}
    assert any(by_key[(p, 0)]["output_ids"] != by_key[(p, 1)]["output_ids"] for p in IDS)
    # the same request sent straight to the engine draws the same tokens (the seed is the sample's)
    rec = by_key[("q2", 1)]
    sp = {
        "temperature": 0.8,
        "top_k": 50,
        "max_new_tokens": 24,
        "stop": ["\n\n"],
        "sampling_seed": rec["sampling_seed"],
    }
    again = engine_call(engine, "POST", "/generate", {"input_ids": rec["prompt"], "sampling_params": sp})
    assert again["output_ids"] == rec["output_ids"] and again["text"] == rec["output_text"]


def test_pods_take_disjoint_shards_of_the_same_samples(
    reference: Path, engine: Served, tiny64: Path, prompts: Path, tmp_path: Path
) -> None:
    want = {(r["prompt_id"], r["sample"]): r for r in lines(reference)}
    got = []
    for pod in (0, 1):
        run_to_end(engine, tiny64, prompts, tmp_path / f"out{pod}", pods=2, pod_index=pod)
        recs = lines(tmp_path / f"out{pod}" / f"pod-{pod}.jsonl")
        assert {p for p, _ in keys(recs)} == set(IDS[pod::2])
        got.append(set(keys(recs)))
        assert all(r == want[(r["prompt_id"], r["sample"])] for r in recs)  # same samples as one pod drew
    assert not got[0] & got[1] and got[0] | got[1] == ALL


def test_sigkill_mid_run_then_a_torn_line_then_resume_equals_an_uninterrupted_run(
    reference: Path, engine: Served, tiny64: Path, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    path = out / "pod-0.jsonl"
    env = job_env(engine, tiny64, prompts, out, exit_when_done=True)
    side = start_sidecar(env, tmp_path / "first.log", ready=False, may_exit=True)
    wait_until(lambda: path.exists() and len(path.read_bytes().splitlines()) >= 6, what="6 samples written")
    side.kill()  # SIGKILL: no clean-up at all
    written = path.read_bytes()
    n = written.count(b"\n")
    assert 6 <= n < len(ALL), f"{n} samples: the run was not interrupted mid-way"
    ref = reference.read_bytes().splitlines(keepends=True)
    missing = next(x for x in ref if x not in written.splitlines(keepends=True))
    path.write_bytes(written + missing[: len(missing) // 2])  # a write cut short by the crash
    again = start_sidecar(env, tmp_path / "second.log", ready=False, may_exit=True)
    assert again.wait(120) == 0, again.tail()
    log = (tmp_path / "second.log").read_text()
    assert "cut a torn last line" in log
    assert f"job: {len(ALL) - n} of {len(ALL)} sample(s) to generate ({n} in" in log  # none generated twice
    assert sorted(path.read_bytes().splitlines()) == sorted(reference.read_bytes().splitlines())
    # and once complete, a rerun generates nothing and leaves the file as it is
    before = path.read_bytes()
    third = start_sidecar(env, tmp_path / "third.log", ready=False, may_exit=True)
    assert third.wait(60) == 0 and path.read_bytes() == before
    assert "job: " not in (tmp_path / "third.log").read_text()


def test_samples_paged_as_they_complete_with_progress_and_state(
    engine: Served, tiny64: Path, prompts: Path, tmp_path: Path
) -> None:
    """The engine is paused first, so the state before any sample finishes is known exactly."""
    engine_call(engine, "POST", "/pause_generation", {"mode": "in_place"})
    side = start_sidecar(job_env(engine, tiny64, prompts, tmp_path / "out"), tmp_path / "side.log")
    try:
        early = wait_until(
            lambda: (p := Progress.model_validate(side.json("/v1/progress"))).in_flight == 2 and p,
            what="two samples in flight",
        )
        assert (early.samples_done, early.not_submitted, early.samples_total) == (0, len(ALL) - 2, len(ALL))
        step = engine_call(engine, "GET", "/v1/state")["step"]
        state = SidecarState.model_validate(side.json("/v1/state", params={"since_step": step}))
        assert state.engine.finished.since_step == step and str(state.engine.layout) == "2x1"
        assert state.not_submitted.samples == len(ALL) - 2 and state.not_submitted.max_new_tokens == 24
        assert state.not_submitted.prompts == N_PROMPTS - 1  # both samples of q0 are in flight
        page = SamplesPage.model_validate(side.json("/v1/samples"))
        assert (page.samples, page.next, page.done) == ([], 0, False)
        engine_call(engine, "POST", "/continue_generation", {})
        seen: list[tuple[str, int]] = []
        cursor, pages = 0, 0
        while True:
            page = SamplesPage.model_validate(side.json("/v1/samples", params={"after": cursor, "limit": 5}))
            assert len(page.samples) <= 5 and page.next == cursor + len(page.samples)
            seen += [(s.prompt_id, s.sample) for s in page.samples]
            cursor, pages = page.next, pages + 1
            if page.done:
                break
        assert sorted(seen) == sorted(ALL) and len(seen) == len(set(seen)) and pages > 1
        assert seen == keys(lines(tmp_path / "out" / "pod-0.jsonl"))  # file order
        end = Progress.model_validate(side.json("/v1/progress"))
        assert end.done and end.samples_done == len(ALL) and end.in_flight == end.not_submitted == 0
        assert end.layout == "2x1" and end.reconfigurations == 0 and end.engine_ready
        assert end.output_file is not None and end.output_file.endswith("pod-0.jsonl")
    finally:
        httpx.post(engine.url + "/continue_generation", headers=engine.headers, json={}, timeout=30)
        assert side.stop() == 0, side.tail()


def test_aborted_samples_are_not_written_but_sent_again(
    engine: Served, tiny64: Path, prompts: Path, tmp_path: Path
) -> None:
    engine_call(engine, "POST", "/pause_generation", {"mode": "in_place"})
    side = start_sidecar(job_env(engine, tiny64, prompts, tmp_path / "out"), tmp_path / "side.log")
    try:
        wait_until(lambda: side.json("/v1/progress")["in_flight"] == 2, what="two samples in flight")
        engine_call(engine, "POST", "/pause_generation", {"mode": "abort"})  # their answers: finish abort
        metrics = wait_until(
            lambda: re.search(r'resends_total\{reason="aborted"\} ([0-9.]+)', side.get("/metrics").text),
            what="aborted samples counted",
        )
        assert float(metrics.group(1)) >= 2
        assert side.json("/v1/progress")["samples_done"] == 0  # nothing written for them
        engine_call(engine, "POST", "/continue_generation", {})
        wait_until(lambda: side.json("/v1/progress")["done"], what="the job's end")
        assert sorted(keys(lines(tmp_path / "out" / "pod-0.jsonl"))) == sorted(ALL)
    finally:
        httpx.post(engine.url + "/continue_generation", headers=engine.headers, json={}, timeout=30)
        assert side.stop() == 0, side.tail()


def test_a_sample_the_engine_refuses_ends_the_job_with_one_line(
    engine: Served, tiny64: Path, prompts: Path, tmp_path: Path
) -> None:
    env = job_env(engine, tiny64, prompts, tmp_path / "out", max_new_tokens=10**6)  # beyond the context
    side = start_sidecar(env, tmp_path / "side.log", ready=False, may_exit=True)
    assert side.wait(60) == 2
    last = side.tail(1)
    assert last.startswith("error: ROLLOUT_SIDECAR_PROMPTS_PATH: sample "), last
    assert "the engine refused it" in last
    assert "context length" in last and "Traceback" not in side.tail(200)
    assert (tmp_path / "out" / "pod-0.jsonl").read_bytes() == b""
