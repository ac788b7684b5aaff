"""Workloads: the named synthetic ones hit their figures; JSONL errors name the file and line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rollout_profiler.sim.workloads import load, load_jsonl, synthetic
from rollout_worker.errors import UserError


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deepscaler_8k_figures(seed: int) -> None:
    wl = synthetic("deepscaler-8k", seed)
    s = wl.summary()
    assert s["requests"] == 1024 and (wl.caps == 8192).all() and s["max"] == 8192
    assert 4500 <= s["mean"] <= 5500
    assert 0.10 <= s["at_cap"] <= 0.16
    assert wl.prompt_lens.min() >= 64 and wl.prompt_lens.max() <= 1024
    assert (wl.prompt_lens.reshape(128, 8) == wl.prompt_lens.reshape(128, 8)[:, :1]).all()  # per prompt


def test_deepscaler_16k_and_seeding() -> None:
    wl = synthetic("deepscaler-16k", 0)
    assert wl.size == 2048 and (wl.caps == 16384).all() and (wl.lengths <= 16384).all()
    assert np.array_equal(wl.lengths, synthetic("deepscaler-16k", 0).lengths)
    assert not np.array_equal(wl.lengths, synthetic("deepscaler-16k", 1).lengths)
    assert synthetic("deepscaler-8k", 0, prompts=4).size == 32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_late_phase_and_sparse_tail_figures(seed: int) -> None:
    late = synthetic("deepscaler-8k-late", seed).summary()
    assert late["requests"] == 1024 and 3300 <= late["mean"] <= 3900 and 0.025 <= late["at_cap"] <= 0.06
    sparse = synthetic("sparse-tail", seed)
    s = sparse.summary()
    assert 550 <= s["median"] <= 650 and int((sparse.lengths >= 8192).sum()) == 9  # 0.9% of 1,024
    assert (sparse.lengths[sparse.lengths < 8192] < 6000).all()  # the rest stop well before the cap


@pytest.mark.parametrize("pct", [0, 5, 10, 15])
def test_cap_mass_sweep(pct: int) -> None:
    wl = synthetic(f"cap-mass-{pct}", 0)
    at_cap = wl.summary()["at_cap"]
    assert pct / 100 - 1 / 1024 <= at_cap <= pct / 100 + 0.005  # round(p x 1,024) run away
    assert np.median(wl.lengths) < 2400


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "lens.jsonl"
    p.write_text(text)
    return p


def test_jsonl_loads(tmp_path: Path) -> None:
    p = write(tmp_path, '{"length": 10, "cap": 20}\n\n{"length": 30, "prompt_len": 99}\n{"length": 5}\n')
    wl = load_jsonl(p)
    assert wl.lengths.tolist() == [10, 30, 5]
    assert wl.caps.tolist() == [20, 30, 30]  # default cap: the largest length
    assert wl.prompt_lens.tolist() == [256, 99, 256]
    assert load(str(p)).size == 3


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"length": 10}\n{"length": 3\n', r"lens\.jsonl:2: invalid JSON"),
        ('{"length": 10}\n\n{"cap": 3}\n', r"lens\.jsonl:3: missing 'length'"),
        ('{"length": 10}\n{"length": "7"}\n', r"lens\.jsonl:2: 'length' must be a positive integer"),
        ('{"length": 0}\n', r"lens\.jsonl:1: 'length' must be a positive integer"),
        ('{"length": 10, "cap": 5}\n', r"lens\.jsonl:1: length 10 exceeds cap 5"),
        ('{"length": 10, "prompt_len": true}\n', r"lens\.jsonl:1: 'prompt_len' must be"),
        ("[1, 2]\n", r"lens\.jsonl:1: expected an object"),
        ("\n\n", r"no requests"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(UserError, match=match):
        load_jsonl(write(tmp_path, text))


def test_unknown_workload_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="neither a known workload"):
        load("deepscaler-99k")
    with pytest.raises(UserError, match="not found"):
        load(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="unknown workload"):
        synthetic("nope")
