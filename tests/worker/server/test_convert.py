"""SGLang bodies -> engine requests, and responses, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from rollout_worker.api.sampling import default_seed
from rollout_worker.api.sglang import GenerateRequest
from rollout_worker.engine.driver.request_table import Update
from rollout_worker.engine.finish import FinishStop
from rollout_worker.engine.messages import TokenOut
from rollout_worker.engine.model.tokenizer import TextCodec
from rollout_worker.errors import UserError
from rollout_worker.server.convert import Output, to_jobs


def req(**kw: object) -> GenerateRequest:
    return GenerateRequest.model_validate(kw)


def test_defaults_follow_sglang() -> None:
    (job,) = to_jobs(req(input_ids=[1, 2], rid="x"), None)
    sp = job.spec.sampling
    assert (
        job.spec.max_new_tokens == 128
        and sp.temperature == 1.0
        and sp.top_k == 0
        and sp.seed == default_seed("x")
    )
    assert job.spec.logprob_start_len == -1 and not job.spec.return_logprob


def test_batch_rids_n_and_per_prompt_params() -> None:
    jobs = to_jobs(
        req(
            input_ids=[[1], [2, 3]],
            rid="b",
            sampling_params=[{"n": 2, "sampling_seed": 5}, {"max_new_tokens": 3}],
            return_logprob=[True, False],
        ),
        None,
    )
    assert [j.spec.id for j in jobs] == ["b_0-0", "b_0-1", "b_1"]
    assert jobs[0].spec.sampling.seed != jobs[1].spec.sampling.seed  # n samples: distinct derived seeds
    assert [j.spec.return_logprob for j in jobs] == [True, True, False] and jobs[2].spec.max_new_tokens == 3
    with pytest.raises(UserError, match="1 item"):
        to_jobs(req(input_ids=[[1], [2]], sampling_params=[{"n": 1}]), None)


def test_neutral_keys_and_refusals() -> None:
    req(
        text="a",
        sampling_params={"regex": None, "frequency_penalty": 0.0, "stop": []},
        image_data=None,
        lora_path=None,
    )
    with pytest.raises(ValidationError, match="json_schema"):
        req(text="a", sampling_params={"json_schema": "{}"})
    with pytest.raises(ValidationError, match="exactly one"):
        req(sampling_params={})
    with pytest.raises(UserError, match="no tokenizer"):
        to_jobs(req(text="hello"), None)


def test_output_text_trims_the_match(tiny64: Path) -> None:
    codec = TextCodec.load(tiny64)
    assert codec is not None
    ids = codec.encode("abcXYdef")
    (job,) = to_jobs(req(input_ids=[1], sampling_params={"stop": "XY"}), codec)
    out = Output(job, codec)
    out.add(Update(job.spec.id, tokens=tuple(TokenOut(job.spec.id, t) for t in ids)))
    assert out.text == "abcXYdef"
    out.add(Update(job.spec.id, finish=FinishStop("XY")))
    assert out.text == "abc" and out.render()["output_ids"] == ids
    (keep,) = to_jobs(req(input_ids=[1], sampling_params={"stop_token_ids": [ids[-1]]}), codec)
    out = Output(keep, codec)
    out.add(
        Update(
            keep.spec.id,
            tokens=tuple(TokenOut(keep.spec.id, t) for t in ids),
            finish=FinishStop(ids[-1]),
        )
    )
    assert out.text == "abcXYde"  # the matched stop token is not in the text


def test_a_stream_holds_back_what_may_begin_a_stop_string(tiny64: Path) -> None:
    """Issue 35: while running, the text a stream may send ends before any end that begins a stop string
    (the final text trims it); once finished, it is the final text."""
    codec = TextCodec.load(tiny64)
    assert codec is not None
    (job,) = to_jobs(req(input_ids=[1], sampling_params={"stop": ["XYZ", "bc!"]}), codec)
    out = Output(job, codec)
    sent = []
    for tok in codec.encode("abcXYd"):
        out.add(Update(job.spec.id, tokens=(TokenOut(job.spec.id, tok),)))
        sent.append(out.stream_text)
    assert sent == ["a", "a", "a", "abc", "abc", "abcXYd"]  # "b", "bc", "X", "XY" may begin a stop string
    out.add(Update(job.spec.id, tokens=tuple(TokenOut(job.spec.id, t) for t in codec.encode("XY"))))
    assert out.stream_text == "abcXYd"
    out.add(
        Update(job.spec.id, tokens=(TokenOut(job.spec.id, codec.encode("Z")[0]),), finish=FinishStop("XYZ"))
    )
    assert out.stream_text == out.text == "abcXYd"
