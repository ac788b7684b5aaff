"""Decoding ``update_weights_from_tensor`` payloads (no server): the pickled form only when trusted."""

from __future__ import annotations

import base64
import io
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from rollout_worker.api.errors import UserError
from rollout_worker.server.tensor_update import decode
from safetensors.torch import save


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
