"""Job files for the `rolloutctl run` tests: the tiny model (float64: exact tokens), 2 pods of 2 ranks, the
committed test profile in which TP=2 pays in the tail, and a long-tailed prompt set whose two long prompts
land on different pods (shards are prompts[pod::2])."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

PROFILE = Path(__file__).parents[2] / "data" / "tiny-2rank-tp2-pays.json"
N_PROMPTS, SAMPLES = 12, 2
LONG = {4: 1200, 7: 1400}  # prompt index -> its own max_new_tokens: one long prompt per pod
ALL = {(f"p{i:02d}", s) for i in range(N_PROMPTS) for s in range(SAMPLES)}


def write_prompts(path: Path) -> Path:
    rows = []
    for i in range(N_PROMPTS):
        rows.append(
            {
                "id": f"p{i:02d}",
                "prompt": f"Question {i}: what is {i} times {i + 3}? Think step by step.",
                "max_new_tokens": LONG.get(i, 8 + 3 * i),
                "data_source": "arith",
                "reward_model": {"ground_truth": str(i * (i + 3))},
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_doc(model: Path, prompts: Path | None, out: Path, **spec: Any) -> dict[str, Any]:
    """The test job; ``spec`` overrides fields (dicts merge into the default's), ``prompts=None``: none."""
    base: dict[str, Any] = {
        "model": {"path": str(model), "dtype": "float64"},
        "pods": 2,
        "gpusPerPod": 2,
        **({"prompts": {"path": str(prompts)}} if prompts is not None else {}),
        "samplesPerPrompt": SAMPLES,
        "sampling": {"temperature": 0.8, "topK": 50, "maxNewTokens": 1500, "seed": 5, "ignoreEos": True},
        "parallelism": {"initialLayout": "2x1", "profile": str(PROFILE), "margin": 0.1},
        "output": {"path": str(out)},
    }
    for key, value in spec.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return {
        "apiVersion": "elasticrollout.dev/v1alpha1",
        "kind": "RolloutJob",
        "metadata": {"name": "tiny-e2e"},
        "spec": base,
    }


def write_job(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def rolloutctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollout_operator.cli.main", *args]


def start_run(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(rolloutctl("run", *args), stdout=out, stderr=subprocess.STDOUT)


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for f in sorted(out.glob("pod-*.jsonl")) for x in f.read_text().split("\n") if x]


def sorted_lines(out: Path) -> list[bytes]:
    return sorted(x for f in sorted(out.glob("pod-*.jsonl")) for x in f.read_bytes().splitlines())


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0
