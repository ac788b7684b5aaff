"""Fixtures: a real engine server per test module (tiny float64 model, 2 ranks as 2x1, an API key) and a
prompts file with every prompt form (text, chat messages, ids) and VeRL-style pass-through fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.server.served import Served, start

ENGINE_KEY = "engine-key"


@pytest.fixture(scope="module")
def engine(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start(tiny64, tmp_path_factory.mktemp("engine"), "--ranks", "2", "--dtype", "float64", key=ENGINE_KEY)
    yield s
    s.stop()


def write_prompts(path: Path, n: int) -> Path:
    rows = []
    for i in range(n):
        extra = {
            "data_source": "arith",
            "reward_model": {"ground_truth": str(2 * i)},
            "extra_info": {"index": i},
        }
        if i % 3 == 0:
            rows.append({"id": f"q{i}", "prompt": f"What is {i} + {i}?", **extra})
        elif i % 3 == 1:
            rows.append({"id": f"q{i}", "prompt": [{"role": "user", "content": f"Double {i}."}], **extra})
        else:
            rows.append({"id": f"q{i}", "input_ids": [10 + i, 20, 30, 40], **extra})
        if i == 5:
            rows[-1]["max_new_tokens"] = 3  # the prompt's own cap, under the job's
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", 12)
