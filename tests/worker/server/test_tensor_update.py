"""Decoding ``update_weights_from_tensor`` payloads (no server): the pickled form only when trusted; SGLang's
flattened buckets of both generations, checked entry by entry."""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from rollout_worker.errors import UserError
from rollout_worker.server.tensor_update import decode
from safetensors.torch import save

from tests.worker.server.sglang_tensors import (
    FlattenedTensorBucket,
    OlderFlattenedTensorBucket,
    file_system_sharing,
    flattened_buckets,
    serialize,
)


def test_the_safe_form_round_trips() -> None:
    t = {"model.norm.weight": torch.arange(4, dtype=torch.float64)}
    got = decode([base64.b64encode(save(t)).decode()], trust_pickle=False)
    assert set(got) == set(t) and torch.equal(got["model.norm.weight"], t["model.norm.weight"])


def test_a_pickle_is_refused_unless_trusted() -> None:
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("model.norm.weight", torch.ones(2, dtype=torch.float64))])
    payload = [base64.b64encode(buf.getvalue()).decode()]
    with pytest.raises(UserError, match="trust-pickled-tensors") as err:
        decode(payload, trust_pickle=False)
    assert err.value.field == "serialized_named_tensors"
    assert torch.equal(
        decode(payload, trust_pickle=True)["model.norm.weight"], torch.ones(2, dtype=torch.float64)
    )


def test_the_unpickler_admits_tensor_rebuilds_only() -> None:
    evil = base64.b64encode(pickle.dumps([("x", print)])).decode()
    with pytest.raises(UserError, match=r"builtins\.print"):
        decode([evil], trust_pickle=True)


def test_the_server_process_imports_no_torch_until_tensors_arrive() -> None:
    """The driver and its server run without torch (the ranks hold it): the tensor route loads it lazily."""
    probe = "import sys, rollout_worker.server.app; print(sorted(m for m in sys.modules if m[:5] == 'torch'))"
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "[]", got.stdout + got.stderr


# -- flattened buckets (load_format "flattened_bucket") ------------------------------------------------------

MIXED = {  # a multi-dtype bucket (the current generation sends it as one; the older one per dtype)
    "model.norm.weight": torch.linspace(-1, 1, 6, dtype=torch.float64),
    "model.layers.0.input_layernorm.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    "lm_head.weight": torch.randn(3, 4, dtype=torch.float32),
    "model.layers.1.input_layernorm.weight": torch.randn(5, dtype=torch.float64),
}


def _b64(payloads: list[bytes]) -> list[str]:
    return [base64.b64encode(p).decode() for p in payloads]


@pytest.mark.parametrize("older", [False, True], ids=["byte-offsets", "element-offsets"])
def test_a_flattened_bucket_of_either_generation_is_read(older: bool) -> None:
    with file_system_sharing():
        requests = flattened_buckets(MIXED, older=older)
        got: dict[str, torch.Tensor] = {}
        for payloads in requests:
            got |= decode(_b64(payloads), trust_pickle=True, bucket=True)
    assert len(requests) == (3 if older else 1)  # the older senders send one bucket per dtype
    assert set(got) == set(MIXED)
    for name, t in MIXED.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def _bucket(kind: type[FlattenedTensorBucket], mutate: Any) -> list[str]:
    """A serialized bucket of MIXED's float64 tensors (the current generation) or of all of MIXED (the older
    one, one dtype: float64 only), its first metadata entry or its dict changed by ``mutate``."""
    named = [(n, t) for n, t in MIXED.items() if t.dtype == torch.float64]
    b = kind(named_tensors=named)
    data = {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
    data = mutate(data)
    return _b64([serialize(data)])


def _entry(**changes: Any) -> Any:
    def mutate(data: dict[str, Any]) -> dict[str, Any]:
        data["metadata"][0] = dataclasses.replace(data["metadata"][0], **changes)
        return data

    return mutate


def test_a_bad_bucket_is_refused_naming_the_field() -> None:
    at = "serialized_named_tensors.0"
    cur, old = FlattenedTensorBucket, OlderFlattenedTensorBucket
    cases: list[tuple[type[FlattenedTensorBucket], Any, str, str]] = [
        (cur, _entry(end_idx=10**6, numel=10**6 - 0), f"{at}.metadata.0.end_idx", "not inside"),
        (old, _entry(start_idx=8, end_idx=2, numel=6), f"{at}.metadata.0.end_idx", "not inside"),
        (cur, _entry(shape=torch.Size([7])), f"{at}.metadata.0.shape", "numel says 48"),
        (old, _entry(shape=torch.Size([2, 2])), f"{at}.metadata.0.shape", "is 4 elements"),
        (cur, _entry(numel=47), f"{at}.metadata.0.numel", "numel says 47"),
        (old, _entry(dtype=torch.float32), f"{at}.metadata.0.dtype", "float32 in a float64"),
        (cur, _entry(dtype="float64"), f"{at}.metadata.0.dtype", "not a torch dtype"),
        (cur, _entry(start_idx=-8), f"{at}.metadata.0.start_idx", "non-negative"),
        (cur, _entry(shape=[2, -3]), f"{at}.metadata.0.shape", "not a shape"),
        (cur, _entry(name=7), f"{at}.metadata.0.name", "not a string"),
        (cur, _entry(name="model.layers.1.input_layernorm.weight"), f"{at}.metadata.1.name", "twice"),
        (cur, lambda d: {**d, "extra": 1}, at, "not a flattened bucket"),
        (cur, lambda d: [d], at, "not a flattened bucket"),
        (cur, lambda d: {**d, "metadata": [1, 2]}, f"{at}.metadata", "FlattenedTensorMetadata"),
        (cur, lambda d: {**d, "flattened_tensor": torch.zeros(2, 2)}, f"{at}.flattened_tensor", "one-dim"),
    ]
    with file_system_sharing():
        good = decode(_bucket(cur, lambda d: d), trust_pickle=True, bucket=True)
        assert torch.equal(good["model.norm.weight"], MIXED["model.norm.weight"])
        for kind, mutate, field, words in cases:
            with pytest.raises(UserError, match=words) as err:
                decode(_bucket(kind, mutate), trust_pickle=True, bucket=True)
            assert err.value.field == field, (field, err.value)


def test_a_bucket_is_read_only_pickled_trusted_and_with_its_load_format() -> None:
    with file_system_sharing():
        (payloads,) = flattened_buckets(MIXED)
        with pytest.raises(UserError, match="trust-pickled-tensors"):
            decode(_b64(payloads), trust_pickle=False, bucket=True)
        with pytest.raises(UserError, match="send load_format 'flattened_bucket'") as err:
            decode(_b64(payloads), trust_pickle=True)  # a bucket sent as (name, tensor) pairs
        assert err.value.field == "load_format"
    with pytest.raises(UserError, match="comes pickled") as err:
        decode(_b64([save(MIXED)]), trust_pickle=True, bucket=True)
    assert err.value.field == "serialized_named_tensors.0"


class FlattenedTensorMetadata:  # SGLang's class name, in a module that is not SGLang's
    pass


def test_the_unpickler_admits_sglangs_bucket_classes_only() -> None:
    impostor = base64.b64encode(pickle.dumps({"metadata": [FlattenedTensorMetadata()]})).decode()
    with pytest.raises(UserError, match=r"test_tensor_update\.FlattenedTensorMetadata"):
        decode([impostor], trust_pickle=True, bucket=True)
    for evil in (torch.load, torch.Tensor.add_):  # a torch name that is not a dtype
        with pytest.raises(UserError, match="not a tensor rebuild"):
            decode([base64.b64encode(pickle.dumps([("x", evil)])).decode()], trust_pickle=True)
