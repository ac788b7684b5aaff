"""The sidecar's settings: every field documented, the environment round trip of settings_env (what
`rolloutctl run` and the operator give a sidecar), and errors that name the field or the variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rollout_worker.errors import UserError
from rollout_worker.sidecar.settings import SidecarFields, describe, load_settings, settings_env

from tests.conftest import run_cli


def test_every_setting_is_documented() -> None:
    rows = describe()
    assert len(rows) == len(SidecarFields.model_fields)
    assert all(name.startswith("ROLLOUT_SIDECAR_") and doc for name, _, doc in rows)


def test_settings_env_round_trips_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = {
        "engine_url": "http://127.0.0.1:30001",
        "engine_key_file": Path("/secrets/engine"),  # not read: settings_env is pure
        "prompts_path": Path("data/train.parquet"),
        "prompts_limit": 100,
        "model_dir": Path("models/m"),
        "pod_index": 1,
        "pods": 3,
        "samples_per_prompt": 4,
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 40,
        "max_new_tokens": 512,
        "seed": 11,
        "stop": ["</answer>", "\n\n"],
        "output_dir": Path("out"),
        "token_file": Path("/secrets/sidecar"),
        "port": 9000,
        "admin_port": 9001,
        "max_in_flight": 32,
        "exit_when_done": True,
    }
    env = settings_env(**fields)
    assert (
        env["ROLLOUT_SIDECAR_STOP"] == '["</answer>", "\\n\\n"]'
        and env["ROLLOUT_SIDECAR_EXIT_WHEN_DONE"] == "true"
    )
    for var in list(os.environ):
        if var.startswith("ROLLOUT_SIDECAR_"):
            monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = load_settings()
    assert {k: getattr(s, k) for k in fields} == fields
    assert s.output_file == Path("out/pod-1.jsonl") and s.mode == "job"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pods": 2, "pod_index": 2}, "pod_index: 2 must be below pods (2)"),
        ({"mode": "job", "output_dir": "o"}, "prompts_path: job mode needs it"),
        ({"token": None}, "token: give exactly one of token or token_file"),
        ({"port": 8000, "admin_port": 8000}, "admin_port: must differ from port (both 8000)"),
        ({"stop": ["ok", ""]}, "stop: stop strings must not be empty"),
        ({"temperature": -1}, "temperature: Input should be greater than or equal to 0"),
        ({"podz": 2}, "podz: Extra inputs are not permitted"),
    ],
)
def test_settings_env_refuses_bad_values_naming_the_field(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"mode": "service", "token": "t"}
    with pytest.raises(UserError) as exc:
        settings_env(**{**base, **fields})
    assert str(exc.value).startswith(message)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TOKEN": ""}, "ROLLOUT_SIDECAR_TOKEN: is empty"),
        ({"TOKEN": "  "}, "ROLLOUT_SIDECAR_TOKEN: is empty"),
        ({"TOKEN": "t", "ENGINE_KEY": ""}, "ROLLOUT_SIDECAR_ENGINE_KEY: is empty"),
    ],
)
def test_an_empty_secret_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    """An empty token would start a sidecar that refuses every caller (and an empty key one whose calls
    the engine refuses)."""
    for var in list(os.environ):
        if var.startswith("ROLLOUT_SIDECAR_"):
            monkeypatch.delenv(var)
    for k, v in {"MODE": "service", **env}.items():
        monkeypatch.setenv(f"ROLLOUT_SIDECAR_{k}", v)
    with pytest.raises(UserError) as exc:
        load_settings()
    assert str(exc.value).startswith(message), exc.value


@pytest.mark.parametrize("variable", ["TOKEN_FILE", "ENGINE_KEY_FILE"])
def test_an_endless_secret_file_is_refused_in_bounded_memory(variable: str) -> None:
    env = {
        "ROLLOUT_SIDECAR_MODE": "service",
        "ROLLOUT_SIDECAR_TOKEN": "t",
        f"ROLLOUT_SIDECAR_{variable}": "/dev/zero",
    }
    if variable == "TOKEN_FILE":
        del env["ROLLOUT_SIDECAR_TOKEN"]
    got = run_cli("sidecar", env=env, timeout=120, memory_bytes=4 << 30)
    assert got.returncode == 2, got.stderr
    what = variable.lower().replace("_", " ")
    assert (
        got.stderr.splitlines()[-1]
        == f"error: ROLLOUT_SIDECAR_{variable}: /dev/zero is over 64 KiB, the limit of a {what}"
    )
