"""Checkpoints: make-model output loads in Hugging Face transformers and agrees with our decoder;
a rank's slice read from disk equals the slice of the full tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.checkpoint import CheckpointReader
from rollout_worker.engine.model.checkpoint_index import tensor_shapes
from rollout_worker.engine.model.sharding import shard_range
from rollout_worker.errors import UserError
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import tiny_variant
from tests.worker.engine.engine_util import decoder_logits


def _full(model_dir: Path, name: str) -> torch.Tensor:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_slice_equals_slice_of_full_tensor(tiny64: Path, tp: int) -> None:
    cfg = ModelConfig.load(tiny64)
    reader = CheckpointReader(tiny64, cfg)
    for name, _ in tensor_shapes(cfg):
        full = _full(tiny64, name)
        for shard in range(tp):
            rng = shard_range(name, cfg, tp, shard)
            got = reader.read(name, rng, torch.float64)
            want = (
                full
                if rng is None
                else (full[rng.start : rng.stop] if rng.dim == 0 else full[:, rng.start : rng.stop])
            )
            assert torch.equal(got, want), (name, shard)


@pytest.mark.parametrize("arch", ["llama", "llama3-rope", "qwen2", "qwen3", "tied"])
def test_matches_transformers(tmp_path: Path, tiny64: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    variants = {
        "llama": None,
        "llama3-rope": {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": True},
        "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
        "tied": {"tie_word_embeddings": True},
    }
    over = variants[arch]
    model_dir = tiny64 if over is None else tiny_variant(tmp_path / arch, **over)
    ids = [5, 77, 301, 12, 9, 400, 33, 250, 1, 64]
    ours = decoder_logits(model_dir, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    # HF's RMSNorm rounds through float32, ours stays in float64: agreement to ~1e-6
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()
    assert int(ours.argmax()) == int(ref.argmax())


def test_tokenizer_roundtrip_and_transformers_tokenizer(tiny64: Path) -> None:
    from rollout_worker.engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny64)
    ids = tok.encode("héllo, world", add_special_tokens=False).ids
    assert ids == list("héllo, world".encode())
    assert tok.decode(ids) == "héllo, world"


def test_missing_and_misshaped_tensors_are_named(tmp_path: Path, tiny64: Path) -> None:
    cfg = ModelConfig.load(tiny64)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny64 / "config.json").read_text())
    with safe_open(str(tiny64 / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    del tensors["model.layers.2.mlp.up_proj.weight"]
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3, dtype=torch.float64)
    save_file(tensors, str(bad / "model.safetensors"))
    reader = CheckpointReader(bad, cfg)
    with pytest.raises(UserError, match=r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        reader.read("model.layers.2.mlp.up_proj.weight", None, torch.float64)
    with pytest.raises(UserError, match=r"k_proj\.weight' has shape \[3, 3\]"):
        reader.read("model.layers.1.self_attn.k_proj.weight", None, torch.float64)


def test_unknown_architecture(tmp_path: Path, tiny64: Path) -> None:
    raw = json.loads((tiny64 / "config.json").read_text())
    raw["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="unknown architecture"):
        ModelConfig.load(tmp_path)


def test_sharded_index_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rollout_worker.engine.model.checkpoint as ck

    monkeypatch.setattr(ck, "SHARD_BYTES", 300_000)
    out = tmp_path / "sharded"
    cfg = ck.make_model("tiny", 0, out, "float32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((out / f).exists() for f in files)
    reader = CheckpointReader(out, cfg)
    t = reader.read("lm_head.weight", shard_range("lm_head.weight", cfg, 2, 1), torch.float32)
    assert t.shape == (256, 128)


def test_the_preset_names_the_job_schema_lists_are_exactly_the_engine_presets() -> None:
    from rollout_worker.config.presets import PRESET_NAMES
    from rollout_worker.engine.model.presets import GGUF_PRESETS, PRESETS

    assert (*PRESETS, *GGUF_PRESETS) == PRESET_NAMES
