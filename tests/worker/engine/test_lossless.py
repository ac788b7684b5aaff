"""The central guarantee: a reconfiguration changes no token. float64 on CPU, real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_worker.scheduling.layout import Layout

from tests.worker.engine.engine_util import requests, run, tokens

pytestmark = pytest.mark.multiproc

LAYOUTS = ["4x1", "2x2", "1x4"]


@pytest.fixture(scope="module")
def static4(tiny64: Path) -> dict[str, list[int]]:
    base = tokens(run(tiny64, 4, "4x1"))
    assert len(base) == 16 and all(base.values())
    return base


@pytest.mark.parametrize("layout", ["2x2", "1x4"])
def test_static_layouts_agree(tiny64: Path, static4: dict[str, list[int]], layout: str) -> None:
    assert tokens(run(tiny64, 4, layout)) == static4


def _check(res, static, src: str, chain: list[str]) -> None:  # type: ignore[no-untyped-def]
    assert tokens(res) == static
    assert [(str(e.src), str(e.dst), e.outcome) for e in res.reconfigs] == [
        (a, b, "committed") for a, b in zip([src, *chain], chain, strict=False)
    ]
    # the switch happened mid-generation: some requests ran on every layout of the chain
    spanning = [o for o in res.outputs if len(o["placements"]) == len(chain) + 1]
    assert spanning, "no request was running across the reconfiguration"


@pytest.mark.parametrize("method", ["migrate", "recompute"])
@pytest.mark.parametrize(("src", "dst"), [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b])
def test_single_transition_is_lossless(
    tiny64: Path, static4: dict[str, list[int]], src: str, dst: str, method: str
) -> None:
    tp = int(dst.split("x")[1])
    res = run(tiny64, 4, src, [f"10:{tp}:{method}"])
    _check(res, static4, src, [dst])
    ev = res.reconfigs[0]
    assert ev.method == method and ev.requests_mid_decode > 0
    if method == "migrate":
        assert "kv_migrate_ms" in ev.phases
        # 1x4 -> 2x2 needs no transfer: each rank already holds the (duplicated) KV head it keeps
        assert (ev.kv_bytes_moved > 0) == ((src, dst) != ("1x4", "2x2"))
    else:
        assert ev.kv_tokens_recomputed > 0 and "kv_recompute_ms" in ev.phases


@pytest.mark.parametrize("method", ["migrate", "recompute", "auto"])
def test_chain_4x1_2x2_1x4(tiny64: Path, static4: dict[str, list[int]], method: str) -> None:
    res = run(tiny64, 4, "4x1", [f"12:2:{method}", f"6:4:{method}"])
    _check(res, static4, "4x1", ["2x2", "1x4"])
    assert all(e.method in ("migrate", "recompute") for e in res.reconfigs)


def test_there_and_back(tiny64: Path, static4: dict[str, list[int]]) -> None:
    res = run(tiny64, 4, "1x4", ["13:1:migrate", "8:4:recompute", "4:2:migrate"])
    _check(res, static4, "1x4", ["4x1", "1x4", "2x2"])


@pytest.mark.slow
def test_eight_ranks_4x2_to_1x8(tiny64: Path) -> None:
    specs = requests(12, seed=5)
    static = tokens(run(tiny64, 8, "4x2", specs=specs))
    res = run(tiny64, 8, "4x2", ["6:8:migrate"], specs=specs)
    _check(res, static, "4x2", ["1x8"])


def test_small_batch_and_kv_budget_force_waiting(tiny64: Path, static4: dict[str, list[int]]) -> None:
    """Consolidating onto one replica with room for only 3 running requests: the rest wait, are
    re-prefilled from prompt + output when admitted, and still produce the same tokens."""
    res = run(tiny64, 4, "4x1", ["10:4:migrate"], max_batch=3)
    assert tokens(res) == static4
    assert res.reconfigs[0].requests_waiting > 0
    res = run(tiny64, 4, "2x2", ["9:4:recompute"], kv_budget_tokens=150)
    assert tokens(res) == static4


# SmolLM2-135M's heads: 9 heads in 3 KV groups, which no TP size above 1 divides (uneven head shards).


@pytest.fixture(scope="module")
def smol_static(smol64: Path) -> dict[str, list[int]]:
    """TP = 1: two replicas of the whole model."""
    base = tokens(run(smol64, 2, "2x1"))
    assert len(base) == 16 and all(base.values())
    return base


@pytest.mark.parametrize("layout", ["1x2", "4x1", "2x2", "1x4"])
def test_uneven_heads_every_layout_agrees_with_tp1(
    smol64: Path, smol_static: dict[str, list[int]], layout: str
) -> None:
    assert tokens(run(smol64, Layout.parse(layout).world, layout)) == smol_static


@pytest.mark.parametrize(
    ("src", "chain", "methods"),
    [
        pytest.param("2x1", ["1x2", "2x1"], ["migrate", "recompute"], id="2x1-m-1x2-r-2x1"),
        pytest.param("1x2", ["2x1", "1x2"], ["migrate", "recompute"], id="1x2-m-2x1-r-1x2"),
        # 1x4 -> 2x2: ranks 0, 1 keep KV head 0 while 2, 3 gather heads 1-2 (the whole group gathers)
        pytest.param(
            "4x1", ["1x4", "2x2", "1x4"], ["recompute", "migrate", "migrate"], id="4x1-r-1x4-m-2x2-m-1x4"
        ),
        pytest.param(
            "1x4", ["4x1", "2x2", "1x4"], ["migrate", "migrate", "recompute"], id="1x4-m-4x1-m-2x2-r-1x4"
        ),
    ],
)
def test_uneven_heads_transitions_are_lossless(
    smol64: Path, smol_static: dict[str, list[int]], src: str, chain: list[str], methods: list[str]
) -> None:
    at = [12, 6] if len(chain) == 2 else [13, 8, 4]
    triggers = [f"{n}:{Layout.parse(lay).tp}:{m}" for n, lay, m in zip(at, chain, methods, strict=True)]
    res = run(smol64, Layout.parse(src).world, src, triggers)
    _check(res, smol_static, src, chain)
    for ev, method in zip(res.reconfigs, methods, strict=True):
        assert ev.method == method and ev.requests_mid_decode > 0
        assert ev.kv_bytes_moved > 0 if method == "migrate" else ev.kv_tokens_recomputed > 0
    if src == "4x1":
        assert res.reconfigs[1].weights["gathered"] > 0  # 1x4 -> 2x2
