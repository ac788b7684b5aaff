"""`rolloutctl simulate` and `rolloutctl bench planner`: runs, JSON, plot, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_operator.cli.main import app
from rollout_profiler.sim import bench as bench_planner
from rollout_worker.api.errors import UserError
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
    code, out, exc = invoke(*common, "--policies", "static:1,static:8,adaptive,oracle")
    assert code == 0, (out, exc)
    assert "lens.jsonl: 44 requests" in out
    for p in ("static:1", "static:8", "adaptive", "oracle"):
        assert f"\n{p} " in out
    png = tmp_path / "t.png"
    code, out, exc = invoke(*common, "--policies", "static:2,oracle", "--json", "--plot", str(png))
    assert code == 0, (out, exc)
    d = json.loads(out)
    assert set(d["results"]) == {"static:2", "oracle"}
    assert d["results"]["oracle"]["latency_s"] <= d["results"]["static:2"]["latency_s"]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--policies", "static:3"), "--policies item 1"),
        (("--policies", "static:1,turbo"), "--policies item 2"),
        (("--gpus", "0"), "--gpus must be >= 1"),
        (("--decide-every", "0"), "--decide-every"),
        (("--max-batch", "-1"), "--max-batch"),
        (("--workload", "deepscaler-1k"), "--workload"),
        (("--profile", "/nonexistent.json"), "profile file not found"),
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


def test_bench_planner_small(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = bench_planner.synthetic
    monkeypatch.setattr(bench_planner, "synthetic", lambda name, seed: real(name, seed, prompts=4))
    real_decide = bench_planner.bench_decide
    monkeypatch.setattr(bench_planner, "bench_decide", lambda model, calls: real_decide(model, calls=20))
    out = tmp_path / "b.json"
    code, text, exc = invoke("bench", "planner", "--runs", "1", "--json", str(out))
    assert code == 0, (text, exc)
    d = json.loads(out.read_text())
    assert [w["workload"] for w in d["workloads"]] == ["deepscaler-8k", "deepscaler-16k"]
    for w in d["workloads"]:
        assert w["latency_s"]["oracle"] <= min(w["latency_s"][s] for s in bench_planner.STATICS)
    assert d["decide"]["synchronous"]["decide_ms_p50"] > 0
    assert "decide() 8 ranks, 1,024 running" in text
    assert d["profile"] == "llama-3.1-8b-h100x8-modelled" and d["profile_method"] == "modelled"
