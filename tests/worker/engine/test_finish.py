"""Finish reasons: the JSON users see is SGLang's ``meta_info.finish_reason``, key for key; the objects
survive the trip from a rank process (pickle)."""

from __future__ import annotations

import json
import pickle

import pytest
from rollout_worker.engine.finish import (
    PAUSE_ABORT,
    Finish,
    FinishAbort,
    FinishLength,
    FinishStop,
    finish_json,
    matched_stop,
)


@pytest.mark.parametrize(
    ("finish", "wire"),
    [
        (FinishStop(2), '{"type": "stop", "matched": 2}'),
        (FinishStop("</s>"), '{"type": "stop", "matched": "</s>"}'),
        (FinishLength(0), '{"type": "length", "length": 0}'),
        (FinishLength(128), '{"type": "length", "length": 128}'),
        (FinishAbort("client disconnected"), '{"type": "abort", "message": "client disconnected"}'),
        (PAUSE_ABORT, '{"type": "abort", "message": "aborted by pause_generation"}'),
    ],
)
def test_json_is_sglangs_shape(finish: Finish, wire: str) -> None:
    assert json.dumps(finish_json(finish)) == wire  # same keys, same order
    assert pickle.loads(pickle.dumps(finish)) == finish


def test_none_while_running_and_the_matched_stop() -> None:
    assert finish_json(None) is None
    assert matched_stop(FinishStop("XY")) == "XY" and matched_stop(FinishStop(7)) == 7
    assert matched_stop(FinishLength(3)) is None and matched_stop(FinishAbort("x")) is None
    assert matched_stop(None) is None
