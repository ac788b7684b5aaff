"""The default kernels' products on CPU in float32 run on weights packed once for oneDNN
(``engine.packed``): the same products as ``F.linear`` within float32 rounding (2-D, 3-D and strided inputs,
biases, an empty batch), used by the decoder in float32 only (the deterministic kernels too, under their
own row rule: ``test_invariant.py``), and a replica on them decodes as one on ``F.linear`` does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels import fixed_order, packed_linear, row_parallel
from rollout_worker.engine.model.checkpoint import CheckpointReader
from rollout_worker.engine.model.presets import preset_config
from rollout_worker.engine.model.weights import load_shard
from rollout_worker.engine.rank.sequence import Sequence

from tests.worker.engine.engine_util import requests
from tests.worker.engine.replica_util import replica

pytestmark = pytest.mark.skipif(
    not packed_linear.available(), reason="this torch has no oneDNN packed linear"
)


@pytest.mark.parametrize("out, k", [(48, 32), (512, 1536), (4096, 512)])
def test_packed_products_are_f_linear_within_float32_rounding(out: int, k: int) -> None:
    gen = torch.Generator().manual_seed(out + k)
    w, b = torch.randn(out, k, generator=gen) / k**0.5, torch.randn(out, generator=gen)
    wp = packed_linear.pack(w)
    for x in (
        torch.randn(1, k, generator=gen),
        torch.randn(16, k, generator=gen),
        torch.randn(3, 5, k, generator=gen),  # [B, S, K]
        torch.randn(4, 2 * k, generator=gen)[:, ::2],  # strided
    ):
        for bias in (None, b):
            got, want = packed_linear.linear(x, wp, bias), F.linear(x, w, bias)
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    assert packed_linear.linear(torch.zeros(0, k), wp).shape == (0, out)


def test_auto_packs_while_two_copies_per_rank_fit_in_half_the_memory(tiny32: Path) -> None:
    """The setting's rule depends on the model, the ranks and the memory only (every layout alike)."""
    cfg = ModelConfig.load(tiny32)
    weights = load_shard(CheckpointReader(tiny32, cfg), cfg, 1, 0, torch.float32, torch.device("cpu"))
    assert cfg.weight_elements == sum(t.numel() for t in weights.values())  # what a TP=1 rank holds
    need = 2 * 4 * cfg.weight_elements  # bytes of two float32 copies, per rank
    assert packed_linear.wanted("auto", cfg, 2, memory=2 * 2 * need)
    assert not packed_linear.wanted("auto", cfg, 2, memory=2 * 2 * need - 2)
    assert not packed_linear.wanted("auto", cfg, 4, memory=2 * 2 * need)
    assert packed_linear.wanted("on", cfg, 64, memory=1) and not packed_linear.wanted(
        "off", cfg, 1, memory=1 << 60
    )
    assert packed_linear.machine_memory() > 1 << 30


def test_the_real_models_parameters_are_counted() -> None:
    """135M parameters (its name) for SmolLM2-135M, tied embeddings; medium's 3.9 GB float32, untied."""
    smol = ModelConfig.from_dict(preset_config("smollm2-135m"))
    assert 134e6 < smol.weight_elements < 135e6
    assert 3.8e9 < 4 * ModelConfig.from_dict(preset_config("medium")).weight_elements < 3.95e9


def test_packs_float32_on_cpu_only() -> None:
    assert packed_linear.packs(torch.zeros(2, 2))
    assert not packed_linear.packs(torch.zeros(2, 2, dtype=torch.float64))
    assert not packed_linear.packs(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_decoder_packs_float32_weights_only(tiny32: Path, tiny64: Path) -> None:
    default = replica(tiny32, 64, 4, dtype=torch.float32).decoder
    wo = default.layers[0].wo
    assert default.kernels.packed and isinstance(wo, torch.Tensor) and wo.is_mkldnn
    det = replica(tiny32, 64, 4, dtype=torch.float32, deterministic=True).decoder
    assert det.kernels.packed and det.o_chunks is not None
    # the column-parallel weights: for the fixed-order kernel where this machine builds it, else oneDNN's
    wq = det.layers[0].wq
    det_native = det.kernels.linear == "fixed_order"
    det_native_attention = det.kernels.attention == "fixed_order"
    assert det_native == det_native_attention == (fixed_order.kernels() is not None)
    # torch's attention reads the kept keys transposed
    assert (det.kernels.keys == "transposed") == (not det_native_attention)
    assert isinstance(wq, fixed_order.Packed) if det_native else isinstance(wq, torch.Tensor) and wq.is_mkldnn
    # the row-parallel weights: in chunks as this CPU's rules choose (chunk_kernel)
    assert det.down_chunks is not None
    for w, c in ((det.layers[0].wo, det.o_chunks), (det.layers[0].w_down, det.down_chunks)):
        assert isinstance(w, row_parallel.ChunkedWeight) and not w.dense.is_mkldnn
        # a batched product, and with the tokens as columns the stacked one, where this CPU's MKL agrees
        assert w.kernel == row_parallel.chunk_kernel(c.width, torch.float32)
        want = w.kernel == "partials" and row_parallel.stacked_rows(c, torch.float32) is not None
        assert (w.fused is not None) == want
    # not packing: the fixed-order kernel over the weights as they are, where it is built
    dense = replica(tiny32, 64, 4, dtype=torch.float32, deterministic=True, pack=False).decoder
    wq, wo = dense.layers[0].wq, dense.layers[0].wo
    dense_native = dense.kernels.linear == "fixed_order"
    assert not dense.kernels.packed and dense_native == (fixed_order.kernels() is not None)
    assert isinstance(wq, torch.Tensor) and not wq.is_mkldnn
    assert isinstance(wo, row_parallel.ChunkedWeight) and not wo.dense.is_mkldnn and wo.blocks is None
    assert (wo.kernel == "dense") == dense_native
    assert not replica(tiny64, 64, 4).decoder.kernels.packed  # float64: sgemm


def test_packed_replica_decodes_as_one_on_f_linear(tiny32: Path) -> None:
    """The same requests on two replicas, one on packed weights and one on ``F.linear`` (the setting
    ``packed_weights: off``), stepped together: every step draws the same tokens, with logprobs equal to
    float32 rounding (the kernels add in other orders, so not bitwise)."""
    on = replica(tiny32, 4096, 4, dtype=torch.float32)
    off = replica(tiny32, 4096, 4, dtype=torch.float32, pack=False)
    assert on.decoder.kernels.packed and not off.decoder.kernels.packed
    specs = [dataclasses.replace(s, return_logprob=True) for s in requests(10, 3)]
    for rep in (on, off):
        for s in specs:
            rep.add(Sequence(spec=s))
    steps = 0
    while on.unfinished:
        a, b = on.step(), off.step()
        assert [(q.spec.id, d.token) for q, d in a.draws] == [(q.spec.id, d.token) for q, d in b.draws]
        lp_a, lp_b = ([d.logprob for _, d in o.draws] for o in (a, b))
        assert lp_a == pytest.approx(lp_b, abs=1e-4), steps
        steps += 1
    assert steps > 20 and not off.unfinished
