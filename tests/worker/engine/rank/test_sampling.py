"""The sampler: counter-based draws, logprobs under the distribution drawn from, min_new_tokens masking."""

from __future__ import annotations

import math

import pytest
import torch
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.rank.sampling import Failure, prompt_logprobs, sample, verify
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


def _rows(seq_: Sequence, plain: list[int], vocab: int = 6, seed: int = 0) -> torch.Tensor:
    """k+1 rows of random logits (the verify pass's), and ``plain``: filled with the tokens plain decoding
    draws from them one at a time, feeding each drawn token back (what speculation must reproduce)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, vocab, generator=gen, dtype=torch.float64)
    s = Sequence(seq_.spec, list(seq_.output))
    for i in range(5):
        d = sample(logits[i : i + 1], [s], eos_ids=(5,))[0]
        assert not isinstance(d, Failure)
        plain.append(d.token)
        s.output.append(d.token)
    return logits


@pytest.mark.parametrize(
    "p", [Sampling(), Sampling(temperature=0.7, seed=4), Sampling(temperature=1.0, top_p=0.9, seed=9)]
)
@pytest.mark.parametrize("wrong_at", [0, 2, None])  # the first draft rejected, the third, none
def test_verify_emits_what_plain_decoding_draws(p: Sampling, wrong_at: int | None) -> None:
    """Drafts equal to plain decoding's tokens are accepted; the first that differs is replaced by plain
    decoding's token there and nothing after it is emitted; with every draft right, the token after them
    too. Every emitted draw (token and logprob) is the one plain decoding makes at that position."""
    s = seq(p, [3, 1], top_logprobs_num=2)
    plain: list[int] = []
    logits = _rows(s, plain)
    drafts = list(plain[:4])
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % 6
    got = verify(logits, s, drafts, eos_ids=(5,))
    assert not isinstance(got, Failure)
    n = 5 if wrong_at is None else wrong_at + 1
    assert [d.token for d in got] == plain[:n]
    for i, d in enumerate(got):  # the draw of plain decoding at output index 2 + i, logprobs included
        ref = sample(logits[i : i + 1], [seq(p, [3, 1, *plain[:i]], top_logprobs_num=2)], eos_ids=(5,))[0]
        assert d == ref


def test_verify_follows_min_new_tokens_across_the_drafted_run() -> None:
    """EOS is masked while fewer than min_new_tokens are out, counting the accepted drafts: a draft of EOS
    too early is rejected (its row draws another token); an EOS drafted once allowed is accepted."""
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.0]] * 3, dtype=torch.float64)  # token 1 (EOS) peaks
    s = seq(Sampling(), [2], min_new_tokens=3)
    got = verify(logits, s, [3, 1], eos_ids=(1,))
    assert not isinstance(got, Failure)
    assert [d.token for d in got] == [3, 3]  # output 1: EOS masked, 3 drawn; output 2: still masked
    got = verify(logits, seq(Sampling(), [2, 2], min_new_tokens=3), [3, 1], eos_ids=(1,))
    assert not isinstance(got, Failure) and [d.token for d in got] == [3, 1, 1]  # EOS allowed at output 3


def test_verify_fails_the_request_on_rows_it_cannot_draw() -> None:
    logits = torch.zeros(3, 4, dtype=torch.float64)
    logits[1, 2] = float("nan")
    got = verify(logits, seq(Sampling()), [0, 0], eos_ids=())
    assert isinstance(got, Failure) and "output token 1" in got.message
    with pytest.raises(ValueError, match="3 rows of logits for 1 drafted tokens"):
        verify(logits, seq(Sampling()), [0], eos_ids=())
