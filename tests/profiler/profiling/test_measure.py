"""`rolloutctl profile`: the real engine measured into a stored profile whose latency model predicts
held-out grid points; the shard-equivalent mode labels what it measured and what it modelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_profiler.planning.latency import holdout_error
from rollout_profiler.profile import Profile
from rollout_profiler.profiling.measure import shard_config
from rollout_profiler.store import database, repo
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.presets import preset_config
from sqlalchemy.orm import Session

from tests.conftest import run_cli as cli


@pytest.mark.long
@pytest.mark.multiproc
def test_profile_tiny_two_ranks_predicts_held_out_points(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'p.db'}"
    out = tmp_path / "tiny.json"
    r = cli(
        "profile",
        "--preset",
        "tiny",
        "--ranks",
        "2",
        "--work",
        str(tmp_path / "models"),
        "--db",
        db,
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "stored profile id 1" in r.stdout
    eng = database.make_engine(db)
    with Session(eng) as s:
        prof = repo.load_profile(s, 1)
    eng.dispose()
    assert prof.to_dict() == Profile.from_json(out).to_dict()
    assert prof.method == "measured" and prof.device_count == 2
    assert {(p.replicas, p.tp) for p in prof.step_latency} == {(2, 1), (1, 2)}
    assert len(prof.step_latency) == 2 * 5 * 4  # layouts x batches x contexts
    assert {(r.src, r.dst, r.method) for r in prof.reconfig_cost} == {
        (a, b, m) for a, b in [("2x1", "1x2"), ("1x2", "2x1")] for m in ("migrate", "recompute")
    }
    assert prof.costs.migrate_bytes_per_ms > 0 and prof.costs.recompute_tokens_per_ms > 0
    err = holdout_error(prof)
    assert err["n"] >= 40
    # 8% on a quiet machine (profiles/README.md); the tiny model's 0.5-6 ms steps take the noise of whatever
    # else shares the 2 cores, which raised it to 15.8% once in CI beside other work
    assert err["median"] < 0.25, err


@pytest.mark.long
@pytest.mark.multiproc
def test_shard_equivalent_profile(tmp_path: Path) -> None:
    out = tmp_path / "se.json"
    r = cli(
        "profile",
        "--preset",
        "tiny",
        "--shard-equivalent",
        "--gpus",
        "4",
        "--tp-sizes",
        "1,2,4",
        "--batch",
        "1,4",
        "--context",
        "32,64",
        "--steps",
        "3",
        "--work",
        str(tmp_path / "models"),
        "--no-db",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    prof = Profile.from_json(out)
    assert prof.method == "shard-equivalent"
    assert {(p.replicas, p.tp) for p in prof.step_latency} == {(4, 1), (2, 2), (1, 4)}
    assert any("per-rank compute" in m for m in prof.provenance["measured"])
    assert any("communication" in m for m in prof.provenance["modelled"])
    assert prof.costs.recompute_tokens_per_ms > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "tiny", "--model", "."], "give exactly one of --model DIR or --preset NAME"),
        (
            ["--preset", "tiny", "--shard-equivalent", "--tp-sizes", "3", "--gpus", "6"],
            "TP size 3 does not divide vocab_size=512",
        ),
        (["--preset", "tiny", "--batch", "1,x"], "--batch: '1,x' is not a comma-separated list of integers"),
        (
            ["--preset", "tiny", "--ranks", "4", "--layouts", "2x1"],
            "--layouts[0]: 2x1 has 2 ranks, not 4",
        ),
    ],
)
def test_profile_bad_flags(tmp_path: Path, args: list[str], message: str) -> None:
    r = cli("profile", *args, "--work", str(tmp_path / "models"), "--no-db")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_comm_table_errors(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps([[1024, 5.0]]))
    r = cli(
        "profile",
        "--preset",
        "tiny",
        "--shard-equivalent",
        "--comm-table",
        str(bad),
        "--no-db",
        "--work",
        str(tmp_path / "models"),
    )
    assert r.returncode == 2 and "needs at least two points" in r.stderr


def test_shard_config_is_the_widest_uneven_shard() -> None:
    """The shard-equivalent model of SmolLM2's heads is the widest rank: 6 query heads and 2 KV heads of
    9 and 3 at TP 2 (whole KV groups, 1 and 2), 3 and 1 at TP 4."""
    cfg = ModelConfig.from_dict(preset_config("smol-shape"))
    got = [shard_config(cfg, tp) for tp in (2, 4)]
    assert [(c.num_heads, c.num_kv_heads, c.intermediate_size, c.head_dim) for c in got] == [
        (6, 2, 192, 64),
        (3, 1, 96, 64),
    ]
