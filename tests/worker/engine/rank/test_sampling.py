"""The sampler: counter-based draws, logprobs under the distribution drawn from, min_new_tokens masking."""

from __future__ import annotations

import math

import torch
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.rank.sampling import Failure, prompt_logprobs, sample
from rollout_worker.engine.rank.sequence import Sequence


def seq(p: Sampling, out: list[int] | None = None, **kw: object) -> Sequence:
    return Sequence(RequestSpec("x", (1,), 50, p, return_logprob=True, **kw), output=out or [])  # type: ignore[arg-type]


def test_greedy_logprob_is_the_log_softmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]], dtype=torch.float64)
    (d,) = sample(logits, [seq(Sampling(), top_logprobs_num=2)], eos_ids=())
    assert d.token == 1
    ref = torch.log_softmax(logits[0], -1)
    assert math.isclose(d.logprob or 0, float(ref[1]), abs_tol=1e-15)
    assert d.top is not None and [t for _, t in d.top] == [1, 2]


def test_sampled_logprob_is_under_the_truncated_renormalised_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    p = Sampling(temperature=1.0, top_k=2, seed=11)
    draws = [sample(logits, [seq(p, [0] * i)], ())[0] for i in range(40)]
    assert {d.token for d in draws} <= {0, 1}  # top-k 2
    for d in draws:
        want = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[d.token]
        assert math.isclose(d.logprob or 0, math.log(want), rel_tol=1e-12)
    again = [sample(logits, [seq(p, [0] * i)], ())[0].token for i in range(40)]
    assert again == [d.token for d in draws]  # counter-based: the same draws


def test_min_p_and_top_p_cut() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.06, 0.04]], dtype=torch.float64))
    p = Sampling(temperature=1.0, min_p=0.2, seed=3)  # keeps p >= 0.12: tokens 0, 1
    toks = {sample(logits, [seq(p, [0] * i)], ())[0].token for i in range(60)}
    assert toks == {0, 1}
    p = Sampling(temperature=1.0, top_p=0.5, seed=3)  # 0.6 >= 0.5: token 0 only
    assert {sample(logits, [seq(p, [0] * i)], ())[0].token for i in range(30)} == {0}


def test_min_new_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.0]], dtype=torch.float64)
    s = seq(Sampling(), stop_token_ids=(3,), min_new_tokens=2)
    assert sample(logits, [s], eos_ids=(1,))[0].token == 2  # 1 (EOS) and 3 (stop) masked
    s.output = [2, 2]
    assert sample(logits, [s], eos_ids=(1,))[0].token == 1


def test_prompt_logprobs() -> None:
    logits = torch.randn(3, 7, dtype=torch.float64)
    vals, tops = prompt_logprobs(logits, [2, 0, 6], 3)
    ref = torch.log_softmax(logits, -1)
    assert vals == [float(ref[0, 2]), float(ref[1, 0]), float(ref[2, 6])]
    assert tops is not None and len(tops[0] or ()) == 3


def test_the_counter_is_the_absolute_position_in_the_sequence() -> None:
    """Output token i of prompt P draws what output token i - k of the continuation P + output[:k] draws
    (same seed): partial rollout resends prompt + partial output; and a different position draws anew."""
    logits = torch.randn(1, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p = Sampling(temperature=1.0, top_p=0.9, seed=5)
    prompt, out = (1, 2, 3), [7, 8, 9, 10, 11, 12]

    def draw(ids: tuple[int, ...], output: list[int]) -> tuple[int, float | None]:
        spec = RequestSpec("x", ids, 50, p, return_logprob=True)
        d = sample(logits, [Sequence(spec, output=output)], ())[0]
        assert not isinstance(d, Failure)
        return d.token, d.logprob

    whole = [draw(prompt, out[:i]) for i in range(len(out))]
    for k in range(len(out)):
        assert [draw(prompt + tuple(out[:k]), out[k:i]) for i in range(k, len(out))] == whole[k:]
    # the counter is not the output index: a longer prompt shifts every draw
    assert [draw((0, *prompt), out[:i]) for i in range(len(out))] != whole
