"""Flags of `make-model`, `generate`, `serve`, `profile`, `crd`, `run` and the sidecar's variables
(in-process, but where reading without bound is the bug: a user's process under a memory limit): a bad
value, an input file that is no such file, or an output path that cannot be written is refused before any
work starts, naming the flag or the variable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rollout_operator.cli.args import as_flags
from rollout_operator.cli.main import app
from rollout_worker.errors import UserError
from typer.testing import CliRunner

from tests.conftest import run_cli

UNWRITABLE = {"under-a-file": "{file}/x", "proc": "/proc/rollout-x", "a-directory": "{dir}"}


def refusal(*args: str, env: dict[str, str] | None = None) -> str:
    """The error `rolloutctl ARGS` prints (as main() prints a UserError); fails when it did not refuse."""
    r = CliRunner().invoke(app, list(args), env=env)
    assert isinstance(r.exception, UserError), (r.exception, r.output)
    return str(as_flags(r.exception))


def unwritable(kind: str, tmp_path: Path) -> str:
    (tmp_path / "file").write_text("x")
    return UNWRITABLE[kind].format(file=tmp_path / "file", dir=tmp_path)


@pytest.mark.parametrize("kind", ["under-a-file", "proc"])
def test_make_model_out_that_cannot_be_written(tmp_path: Path, kind: str) -> None:
    err = refusal("make-model", "--preset", "tiny", "--out", unwritable(kind, tmp_path))
    assert err.startswith("--out: "), err


@pytest.fixture()
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 4}) + "\n")
    return p


@pytest.mark.parametrize("kind", sorted(UNWRITABLE))
def test_generate_out_that_cannot_be_written(tmp_path: Path, tiny64: Path, prompts: Path, kind: str) -> None:
    out = unwritable(kind, tmp_path)
    err = refusal("generate", "--model", str(tiny64), "--prompts", str(prompts), "--out", out)
    assert err.startswith("--out: "), err


def test_generate_refuses_two_reconfigurations_at_one_threshold(
    tmp_path: Path, tiny64: Path, prompts: Path
) -> None:
    args = ["--model", str(tiny64), "--ranks", "2", "--prompts", str(prompts), "--out", str(tmp_path / "o")]
    err = refusal("generate", *args, "--reconfigure", "3:2:auto", "--reconfigure", "3:1:auto")
    assert err.startswith("--reconfigure[1]: 3 is the threshold of trigger 0 too"), err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ranks", "0"], "--ranks: must be >= 1, got 0"),
        (["--ranks", str(10**15)], "--ranks: must be <= 64 (the ranks of one engine), got 1000000000000000"),
        (["--steps", "0"], "--steps: must be >= 1, got 0"),
        (["--shard-equivalent", "--gpus", "0"], "--gpus: must be >= 1, got 0"),
        (["--device", "tpu"], "--device: must be one of cpu, cuda"),
        (["--db", "bogus://"], "database URL"),
        (["--no-db", "--out", "{unwritable}"], "--out: "),
    ],
)
def test_profile_refuses_before_measuring(tmp_path: Path, flags: list[str], message: str) -> None:
    flags = [f.format(unwritable=unwritable("under-a-file", tmp_path)) for f in flags]
    err = refusal("profile", "--preset", "tiny", "--work", str(tmp_path / "models"), *flags)
    assert err.startswith(message) or message in err, err
    assert not (tmp_path / "models").exists()  # nothing made, nothing measured


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--requests", "7"], "--requests: must be >= 8 (four switches per chain), got 7"),
        (
            ["--max-new-tokens", "31"],
            "--max-new-tokens: must be >= 2 x --requests (caps apart), got 31 for 16",
        ),
        (["--prompts", "{missing}"], "--prompts: prompts file not found: "),
        (["--json", "{unwritable}"], "--json: "),
        (["--preset", "huge"], "--preset: unknown preset 'huge'"),
    ],
)
def test_bench_lossless_refuses_before_making_anything(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    fill = {"missing": str(tmp_path / "none.jsonl"), "unwritable": unwritable("under-a-file", tmp_path)}
    flags = [f.format(**fill) for f in flags]
    err = refusal("bench", "lossless", "--preset", "tiny", "--work", str(tmp_path / "models"), *flags)
    assert err.startswith(message), err
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--requests", "1"], "--requests: must be >= 2, got 1"),
        (["--prompt-len", "0"], "--prompt-len: must be >= 1, got 0"),
        (["--median-new", "300"], "--median-new: must be >= 1 and below --longest-new (300), got 300"),
        (["--page-size", "17"], "--page-size: must be 1..16, got 17"),
        (["--kv-tokens", "300"], "--kv-tokens: the longest request (16 + 300 tokens) must fit the budget"),
        (["--runs", "0"], "--runs: must be >= 1, got 0"),
        (["--samples", "0"], "--samples: must be 1 (no sharing part) or 2..--requests (64), got 0"),
        (
            ["--sharing-prompt-len", "1800"],
            "--sharing-prompt-len: must be >= 1, and with the longest request",
        ),
        (["--baseline", "{missing}"], "--baseline: cannot read "),
        (["--requests", "256"], "--requests: the baseline "),  # the default baseline: 64 requests
        (["--kv-tokens", "4096"], "--kv-tokens: the baseline "),
        (["--json", "{unwritable}"], "--json: "),
    ],
)
def test_bench_memory_refuses_before_making_anything(tmp_path: Path, flags: list[str], message: str) -> None:
    fill = {"missing": str(tmp_path / "none"), "unwritable": unwritable("under-a-file", tmp_path)}
    flags = [f.format(**fill) for f in flags]
    err = refusal("bench", "memory", "--work", str(tmp_path / "work"), *flags)
    assert err.startswith(message), err
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--runs", "0"], "--runs: must be >= 1, got 0"),
        (["--page-size", "0"], "--page-size: must be 1..16, got 0"),
        (["--max-batch", "0"], "--max-batch: must be 1..4096, got 0"),  # the engine's bounds
        (["--dtype", "float8"], "--dtype: must be one of "),
        (["--json", "{unwritable}"], "--json: "),
    ],
)
def test_bench_simulator_refuses_before_making_anything(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    flags = [f.format(unwritable=unwritable("under-a-file", tmp_path)) for f in flags]
    err = refusal("bench", "simulator", "--work", str(tmp_path / "work"), *flags)
    assert err.startswith(message), err
    assert not (tmp_path / "work").exists()


def test_profile_cuda_without_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    err = refusal("profile", "--preset", "tiny", "--device", "cuda", "--no-db", "--work", str(tmp_path))
    assert err.startswith("--device: cuda: no CUDA device is visible"), err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STOP": "notjson"}, "ROLLOUT_SIDECAR_STOP: not valid JSON"),
        ({"OUTPUT_DIR": "/proc/rollout-x"}, "ROLLOUT_SIDECAR_OUTPUT_DIR: cannot create files in /proc"),
    ],
)
def test_sidecar_variables(tmp_path: Path, prompts: Path, env: dict[str, str], message: str) -> None:
    base = {"TOKEN": "t", "PROMPTS_PATH": str(prompts), "OUTPUT_DIR": str(tmp_path / "out")}
    err = refusal("sidecar", env={f"ROLLOUT_SIDECAR_{k}": v for k, v in {**base, **env}.items()})
    assert err.startswith(message), err


def test_make_model_seed_beyond_63_bits(tmp_path: Path) -> None:
    err = refusal("make-model", "--preset", "tiny", "--out", str(tmp_path / "m"), "--seed", str(2**70))
    assert err.startswith("--seed: must be 0 .. 2**63-1, got 1180591620717411303424"), err
    assert not (tmp_path / "m").exists()


def test_crd_out_that_cannot_be_written() -> None:
    err = refusal("crd", "--out", "/proc/rollout-x")
    assert err.startswith("--out: cannot create files in /proc"), err


def test_profile_options_without_a_model_are_refused_not_answered_with_the_help() -> None:
    err = refusal("profile", "--ranks", "2", "--no-db")
    assert err.startswith("--model: give --model or --preset to measure a profile"), err


def test_serve_cuda_without_a_gpu_before_any_rank_starts(
    tiny64: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, also on a machine that has one
    err = refusal("serve", "--model", str(tiny64), "--port", "0", "--device", "cuda")
    assert err.startswith("--device: cuda: no CUDA device is visible"), err


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_kv_budget_beyond_the_machines_memory(
    tiny64: Path, tmp_path: Path, prompts: Path, command: str
) -> None:
    """A pool the machine cannot hold (petabytes) is refused before any rank starts, at its KV bytes per
    token (the tiny model in float64: 4 layers x 2 KV heads x 16 x K and V x 8 bytes = 2 KiB)."""
    more = (
        ["--port", "0"] if command == "serve" else ["--prompts", str(prompts), "--out", str(tmp_path / "o")]
    )
    err = refusal(
        command, "--model", str(tiny64), "--dtype", "float64", "--kv-budget-tokens", str(10**15), *more
    )
    assert err.startswith(
        "--kv-budget-tokens: a pool of 1000000000000000 tokens does not fit: a TP=1 replica"
    ), err


def test_run_of_an_endless_job_file_is_refused_in_bounded_memory() -> None:
    got = run_cli("run", "/dev/zero", timeout=120, memory_bytes=4 << 30)
    assert got.returncode == 2, got.stderr
    assert got.stderr == "error: /dev/zero is over 64 MiB, the limit of a job file\n"


def test_the_machine_check_imports_no_torch(tiny64: Path) -> None:
    """The check runs in the process that then drives the ranks, which never imports torch."""
    code = (
        "import sys\n"
        "from rollout_operator.local.machine import check_machine\n"
        "from rollout_worker.config.engine_settings import EngineSettings\n"
        "from rollout_worker.config.model_config import ModelConfig\n"
        f"model = ModelConfig.load({str(tiny64)!r})\n"
        "check_machine(model, 'float64', EngineSettings(kv_budget_tokens=64), 2, [1, 2])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "[]", got.stderr[-2000:] or got.stdout[:300]
