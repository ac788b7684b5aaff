"""Prefix sharing (the prefix cache): the samples of one prompt store and compute its pages once, a later
request finds them, and no token changes (float64): in process on one replica, and across every
transition of 2 and 4 real gloo ranks, by migration and by recompute."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.finish import Finish, FinishAbort, FinishStop
from rollout_worker.engine.rank.replica import Replica
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.scheduling.layout import Layout

from tests.worker.engine.engine_util import run, tokens
from tests.worker.engine.replica_util import replica

PROMPT = tuple(range(40, 53))  # 13 tokens: 3 full pages of 4 and one token more


def _samples(n: int, prompt: tuple[int, ...] = PROMPT, tag: str = "s") -> list[RequestSpec]:
    return [
        RequestSpec(
            f"{tag}{i}", prompt, 10, Sampling(temperature=0.9, top_p=0.95, seed=100 + i), ignore_eos=True
        )
        for i in range(n)
    ]


def _run(model: Path, cache: bool, specs: list[RequestSpec]) -> tuple[dict[str, list[int]], list[dict]]:  # type: ignore[type-arg]
    rep = replica(model, 64, 4, prefix_cache=cache)
    seqs = [Sequence(spec=s) for s in specs]
    for s in seqs:
        rep.add(s)
    steps = []
    while rep.unfinished:
        out = rep.step()
        if out.kind == "prefill":
            steps.append({"computed": out.computed, "cached": out.cached, "held": rep.pool.shared.held})
    return {s.spec.id: s.output for s in seqs}, steps


def test_eight_samples_of_one_prompt_share_its_pages(tiny64: Path) -> None:
    shared, steps = _run(tiny64, True, _samples(8))
    assert len(steps) == 1  # all 8 admitted and prefilled in one pass
    # the first sample computes the 13 prompt tokens; the 7 others find 3 pages (12 tokens) cached, by
    # the first one in the same pass, and compute only the last token
    assert steps[0]["cached"] == {"s0": 0, **{f"s{i}": 12 for i in range(1, 8)}}
    assert steps[0]["computed"] == 13 + 7 * 1
    assert steps[0]["held"] == 3 + 8  # the 3 prompt pages once, and each sample's own last page
    alone, steps = _run(tiny64, False, _samples(8))
    assert steps[0]["cached"] == dict.fromkeys(shared, 0) and steps[0]["computed"] == 8 * 13
    assert steps[0]["held"] == 8 * 4
    assert shared == alone and all(len(v) == 10 for v in shared.values())
    assert len({tuple(v) for v in shared.values()}) == 8  # the samples differ: sharing kept them apart


def _positions(rep: Replica, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The positions (rows x width) of each forward pass ``rep`` runs from now on."""
    seen: list[int] = []
    hidden = rep.decoder.hidden

    def counting(tokens: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(tokens.numel())
        return hidden(tokens, *args, **kwargs)

    monkeypatch.setattr(rep.decoder, "hidden", counting)
    return seen


def test_the_samples_of_long_prompts_are_not_padded_to_the_prompts_width(
    tiny64: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 prompts of 101 tokens x 4 samples, admitted together in prompt order (as a job's sidecar, slime
    and VeRL send a prompt's group): each prompt's first sample computes its 101 tokens, the 3 others find
    25 pages cached and compute 1 token each. In one padded pass every row would compute 101 positions
    (16 x 101 = 1,616 for 416 tokens, what made the first prefill of a job take seconds on a CPU); the
    prompts' first samples go first, and the passes are of like widths: one of the 4 prompts, one of the 12
    later samples. The tokens are those of a run without the prefix cache (float64)."""
    specs = [s for p in range(4) for s in _samples(4, tuple(range(40 + p, 141 + p)), tag=f"p{p}-")]
    outputs = {}
    for cache in (True, False):
        rep = replica(tiny64, 1024, 4, max_batch=16, prefix_cache=cache)
        computed = _positions(rep, monkeypatch)
        seqs = [Sequence(spec=s) for s in specs]
        for s in seqs:
            rep.add(s)
        out = rep.step()
        assert out.kind == "prefill" and len(out.admitted) == 16
        if cache:
            assert out.computed == 4 * 101 + 12 * 1 and computed == [4 * 101, 12]
        while rep.unfinished:
            rep.step()
        outputs[cache] = {s.spec.id: s.output for s in seqs}
    assert outputs[True] == outputs[False]


def test_a_later_request_finds_the_cached_prefix_until_it_is_flushed(tiny64: Path) -> None:
    rep = replica(tiny64, 64, 4)
    first, later, after_flush = (Sequence(spec=s) for s in _samples(3))
    outs = []
    for seq in (first, later):
        rep.add(seq)
        while rep.unfinished:
            out = rep.step()
            if out.kind == "prefill":
                outs.append(out.cached[seq.spec.id])
    assert outs == [0, 12] and rep.pool.shared.held == 0  # the pages outlived their holder, idle
    rep.pool.flush_cache()
    rep.add(after_flush)
    assert rep.step().cached == {"s2": 0}


def _finished(rep: Replica, spec: RequestSpec) -> Sequence:
    seq = Sequence(spec=spec)
    rep.add(seq)
    while rep.unfinished:
        rep.step()
    return seq


def test_a_conversation_s_next_turn_finds_the_last_turn_cached(tiny64: Path) -> None:
    """Issue 35: a finished request leaves every full page it wrote cached, its reply's too (SGLang's radix
    cache keeps a finished request's tokens), so the next turn (prompt + reply + a new message) computes
    only what is new: 13 + 10 tokens, all but the last reply token's K/V written, are 5 full pages of 4. A
    request that failed leaves only its prompt's pages (its K/V may be what failed)."""
    rep = replica(tiny64, 64, 4)
    first = _finished(rep, _samples(1)[0])
    nxt = RequestSpec("next", PROMPT + tuple(first.output) + (7, 8, 9), 2, Sampling(), ignore_eos=True)
    rep.add(Sequence(spec=nxt))
    assert rep.step().cached == {"next": 20}
    while rep.unfinished:
        rep.step()
    rep.pool.flush_cache()
    rep.poison = ("bad", 5)  # its rows' logits turn NaN from its 5th token: it is aborted
    bad = _finished(rep, RequestSpec("bad", PROMPT, 10, Sampling(temperature=0.9, seed=7), ignore_eos=True))
    assert isinstance(bad.finish, FinishAbort) and len(bad.output) == 5  # 13 + 4 written: 4 full pages
    after = RequestSpec("after", PROMPT + tuple(bad.output) + (7,), 2, Sampling(), ignore_eos=True)
    rep.add(Sequence(spec=after))
    assert rep.step().cached == {"after": 12}


@pytest.mark.parametrize(("finish", "cached"), [(FinishStop("zz"), 16), (FinishAbort("by its client"), 12)])
def test_a_request_the_driver_ends_leaves_its_pages_cached_unless_aborted(
    tiny64: Path, finish: Finish, cached: int
) -> None:
    """Ended by a stop string the driver matched, a request's pages stay cached as a finished one's (13 + 6
    tokens, 18 written: 4 full pages); aborted, only its prompt's."""
    rep = replica(tiny64, 64, 4)
    seq = Sequence(spec=RequestSpec("r", PROMPT, 10, Sampling(temperature=0.9, seed=5), ignore_eos=True))
    rep.add(seq)
    while len(seq.output) < 6:
        rep.step()
    assert rep.abort(("r",), finish) == [("r", finish)]
    rep.add(Sequence(spec=RequestSpec("next", PROMPT + tuple(seq.output) + (7,), 2, Sampling())))
    assert rep.step().cached == {"next": cached}


def test_a_request_that_wants_its_prompt_logprobs_computes_its_whole_prompt(tiny64: Path) -> None:
    rep = replica(tiny64, 64, 4)
    rep.add(Sequence(spec=_samples(1)[0]))
    while rep.unfinished:
        rep.step()
    spec = RequestSpec("lp", PROMPT, 2, Sampling(), return_logprob=True, logprob_start_len=0)
    rep.add(Sequence(spec=spec))
    out = rep.step()
    assert out.cached == {"lp": 0} and len(out.prompt_logprobs["lp"].logprobs) == len(PROMPT)


def _groups(seed: int = 3) -> list[RequestSpec]:
    """4 prompts x 4 samples (GRPO's shape), prompts of 9 to 14 tokens, lengths 8 to 53 three tokens apart
    (shuffled): requests finish a few steps apart, so a switch planned each time two more have finished
    is not skipped because several finished at once."""
    rng = random.Random(seed)
    lengths = list(range(8, 8 + 3 * 16, 3))
    rng.shuffle(lengths)
    specs = []
    for g in range(4):
        prompt = tuple(rng.randrange(512) for _ in range(rng.randint(9, 14)))
        for i in range(4):
            sampling = Sampling(temperature=0.9, top_p=0.95, seed=1000 + 10 * g + i)
            specs.append(RequestSpec(f"g{g}-{i}", prompt, lengths[4 * g + i], sampling, ignore_eos=True))
    return specs


@pytest.fixture(scope="module")
def unshared(tiny64: Path) -> dict[str, list[int]]:
    static = run(tiny64, 4, "4x1", specs=_groups(), page_size=4, prefix_cache=False)
    assert all(o["cached_tokens"] == 0 for o in static.outputs)
    return tokens(static)


# every directed transition between the layouts of 4 ranks, once each (an Euler circuit), and of 2 ranks
EULER4 = ["2x2", "1x4", "4x1", "1x4", "2x2", "4x1"]
CHAINS = [
    ("4x1", EULER4, ["migrate"] * 6),
    ("4x1", EULER4, ["recompute"] * 6),
    ("2x1", ["1x2", "2x1"], ["migrate", "recompute"]),
    ("2x1", ["1x2", "2x1"], ["recompute", "migrate"]),
]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("src", "chain", "methods"),
    CHAINS,
    ids=["4-ranks-migrate", "4-ranks-recompute", "2-ranks-migrate-first", "2-ranks-recompute-first"],
)
def test_shared_prefixes_survive_every_transition(
    tiny64: Path, unshared: dict[str, list[int]], src: str, chain: list[str], methods: list[str]
) -> None:
    world = Layout.parse(src).world
    at = range(15, 15 - 2 * len(chain), -2)  # a switch each time two more requests have finished
    triggers = [f"{n}:{Layout.parse(lay).tp}:{m}" for n, lay, m in zip(at, chain, methods, strict=False)]
    res = run(tiny64, world, src, triggers, specs=_groups(), page_size=4)
    assert tokens(res) == unshared
    # a plan fires the lowest threshold reached when requests finish past several at once (the README), so
    # under load one planned switch may be skipped: the rest happen in order, each committed
    planned = iter([(lay, m, "committed") for lay, m in zip(chain, methods, strict=True)])
    got = [(str(e.dst), e.method, e.outcome) for e in res.reconfigs]
    assert len(got) >= len(chain) - 1 and all(g in planned for g in got), got
    for e in res.reconfigs:  # each switch carried requests mid-decode, sharing pages
        assert e.requests_mid_decode > 0, e
        if e.method == "migrate" and (str(e.src), str(e.dst)) != ("1x4", "2x2"):
            assert e.kv_pages_moved > 0, e
        if e.method == "recompute":
            assert e.kv_tokens_recomputed > 0, e
    # the samples of each prompt ran on one replica and shared its pages: the first computed the prompt, the
    # others found it cached. Not always all three: the driver sends the Submits one by one and a loaded
    # machine may step between them, so a sample can reach its replica after the first switch (at the first
    # finish), where the new pool holds only running requests' pages; its prompt's pages may be gone then
    cached = [o["cached_tokens"] for o in res.outputs]
    groups = [cached[4 * g : 4 * g + 4] for g in range(4)]
    assert all(sum(c > 0 for c in group) >= 2 for group in groups), cached
