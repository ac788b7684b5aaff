"""`rolloutctl simulate` and `rolloutctl bench planner`: runs, JSON, plot, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_bench import planner as bench_planner
from rollout_bench.tables import KINDS
from rollout_operator.cli.main import app
from rollout_worker.errors import UserError
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "profiles" / "llama-3.1-8b-h100x8-modelled.json"


@pytest.fixture()
def lengths(tmp_path: Path) -> Path:
    p = tmp_path / "lens.jsonl"
    rows = [{"length": 50 + 37 * i, "cap": 2048, "prompt_len": 100} for i in range(40)]
    rows += [{"length": 2048, "cap": 2048}] * 4
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def invoke(*args: str) -> tuple[int, str, BaseException | None]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.exception


def test_simulate_table_json_and_plot(tmp_path: Path, lengths: Path) -> None:
    common = (
        "simulate",
        "--profile",
        str(PROFILE),
        "--gpus",
        "8",
        "--workload",
        str(lengths),
        "--prior",
        "none",
    )
    code, out, exc = invoke(*common, "--policies", "static:1,static:8,adaptive,oracle,free-switch,tail-bound")
    assert code == 0, (out, exc)
    assert "lens.jsonl: 44 requests" in out and "admission paged" in out
    for p in ("static:1", "static:8", "adaptive", "oracle", "free-switch", "tail-bound"):
        assert f"\n{p} " in out
    png = tmp_path / "t.png"
    args = ("--policies", "static:2,oracle", "--admission", "sglang", "--json", "--plot", str(png))
    code, out, exc = invoke(*common, *args)
    assert code == 0, (out, exc)
    d = json.loads(out)
    assert set(d["results"]) == {"static:2", "oracle"} and d["admission"] == "sglang"
    assert d["results"]["oracle"]["latency_s"] <= d["results"]["static:2"]["latency_s"]
    assert d["results"]["static:2"]["admission"] == "sglang"
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--policies", "static:3"), "--policies: item 1"),
        (("--policies", "static:1,turbo"), "--policies: item 2"),
        (("--gpus", "0"), "--gpus must be >= 1"),
        (("--decide-every-ms", "0"), "--decide-every-ms: must be > 0"),
        (("--max-batch", "-1"), "--max-batch"),
        (("--admission", "vllm"), "--admission: must be one of"),
        (("--initial-layout", "4y2"), "--initial-layout: '4y2' is not of the form DxT"),
        (("--workload", "deepscaler-1k"), "--workload"),
        (("--profile", "/nonexistent.json"), "profile file not found"),
        (("--seed", "-5"), "--seed: must be >= 0, got -5"),
        (("--prior", "/nonexistent"), "--prior: '/nonexistent' is neither a known workload"),
        (("--initial-layout", "9x9"), "--initial-layout: 9x9 has 81 ranks, the pod has 8 GPUs"),
        (("--plot", "/proc/rollout-x.png"), "--plot: cannot create files in /proc"),
        (("--plot", "."), "--plot: . is a directory, not a file"),
    ],
)
def test_simulate_bad_flags(args: tuple[str, ...], match: str) -> None:
    base = {"--profile": str(PROFILE), "--workload": "deepscaler-8k"}
    flags = [x for k, v in base.items() if k not in args for x in (k, v)]
    code, _, exc = invoke("simulate", *flags, *args)
    assert code != 0 and isinstance(exc, UserError) and match in str(exc)


def test_cli_prints_error_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"length": 5}\n{"length": -1}\n')
    r = subprocess.run(
        [sys.executable, "-m", "rollout_operator.cli.main", "simulate", "--profile", str(PROFILE),
         "--workload", str(bad)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {bad}:2: 'length' must be a positive integer, got -1"


def test_bench_planner_small(tmp_path: Path, lengths: Path) -> None:
    out = tmp_path / "b.json"
    args = ("--workload", str(lengths), "--runs", "1", "--decide-calls", "20", "--json", str(out),
            "--spec-accept", "0.5")  # fmt: skip
    r = CliRunner().invoke(app, ["bench", "planner", "--profile", str(PROFILE), *args])
    code, text, exc = r.exit_code, r.stdout, r.exception
    assert code == 0, (text, exc)
    progress = f"llama-3.1-8b-h100x8-modelled {lengths} seed 0: adaptive "
    assert r.stderr.startswith(progress), r.stderr
    d = json.loads(out.read_text())
    (m,) = d["models"]
    assert m["profile"] == "llama-3.1-8b-h100x8-modelled" and m["profile_method"] == "modelled"
    assert m["admission"] == "paged" and m["decide"]["memory_model"] is True
    (w,) = m["workloads"]
    lat = w["latency_s"]
    assert w["workload"] == str(lengths)
    assert (
        lat["tail-bound"] <= lat["free-switch"] <= lat["oracle"] <= min(lat[s] for s in bench_planner.STATICS)
    )
    assert lat["oracle-clairvoyant"] <= lat["oracle"] <= lat["adaptive"]
    assert w["adaptive_vs_static_tp1"] == pytest.approx(lat["adaptive"] / lat["static:1"])
    assert m["decide"]["synchronous"]["decide_ms_p50"] > 0
    assert "decide() 8 ranks, 1,024 running (synchronous, memory model in)" in text
    assert "Llama-3.1-8B (llama-3.1-8b-h100x8-modelled, modelled), 8 GPUs, admission paged" in text
    assert {a["aim"] for a in d["aims"]} >= {"adaptive within 1.5% of the count-balanced oracle"}
    x = w["speculation"]  # the same runs, speculating: faster, and the ratios follow the figures
    assert x["accept"] == 0.5 and x["latency_s"]["adaptive"] < lat["adaptive"]
    assert all(x["latency_s"][s] < lat[s] for s in bench_planner.STATICS)
    assert x["vs_plain_adaptive"] == pytest.approx(x["latency_s"]["adaptive"] / lat["adaptive"])
    alone = min(x["latency_s"][x["best_static"]], lat["adaptive"], lat[w["best_static"]])
    assert x["vs_best_alone"] == pytest.approx(x["latency_s"]["adaptive"] / alone)
    assert "speculating (accept 0.5, 4 draft tokens" in text
    assert "| workload | best static | adaptive | best static, spec." in "\n".join(KINDS["planner"](d))
    code, _, exc = invoke("bench", "planner", "--workload", "deepscaler-1k")
    assert code != 0 and isinstance(exc, UserError) and "deepscaler-1k" in str(exc)
    code, _, exc = invoke("bench", "planner", "--workload", str(lengths), "--spec-accept", "1.5")
    assert code != 0 and isinstance(exc, UserError) and "--spec-accept" in str(exc)


def test_simulate_default_policies_follow_the_gpus(lengths: Path) -> None:
    """Without --policies, 2 GPUs get static:1 and static:2 (the 8-GPU list would ask for static:4)."""
    code, out, exc = invoke(
        "simulate", "--profile", str(PROFILE), "--gpus", "2", "--workload", str(lengths), "--prior", "none"
    )
    assert code == 0, (out, exc)
    rows = [line.split()[0] for line in out.splitlines()[2:] if line.strip()]
    assert rows == ["static:1", "static:2", "adaptive", "oracle", "free-switch", "tail-bound"], out


def test_simulate_speculating_is_faster_and_says_so(lengths: Path) -> None:
    base = (
        "simulate",
        "--profile",
        str(PROFILE),
        "--workload",
        str(lengths),
        "--policies",
        "static:1",
        "--json",
    )
    code, plain, exc = invoke(*base)
    assert code == 0, (plain, exc)
    code, spec, exc = invoke(*base, "--spec-accept", "0.5", "--draft-tokens", "3")
    assert code == 0, (spec, exc)
    p, s = json.loads(plain), json.loads(spec)
    assert p["speculation"] is None and s["speculation"] == {"accept": 0.5, "draft_tokens": 3}
    assert s["results"]["static:1"]["latency_s"] < p["results"]["static:1"]["latency_s"]
    code, _, exc = invoke(*base, "--spec-accept", "0.5", "--draft-tokens", "0")
    assert code != 0 and isinstance(exc, UserError) and "--draft-tokens" in str(exc)
