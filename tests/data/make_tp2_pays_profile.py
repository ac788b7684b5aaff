"""Writes tests/data/tiny-2rank-tp2-pays.json: a *made-up* profile of the tiny preset on 2 ranks in which
TP=2 pays in the tail (1x2 beats 2x1 once two or fewer requests remain) and 2x1 wins at full batch, so an
honest planner switches in the middle of a job. On real CPUs TP=2 is slower for tiny; the tests use this
profile to check the mechanism (plan pushed, switch at the exact step, decision recorded), not the gain."""

from pathlib import Path

from rollout_profiler.profile import CostModel, ModelShape, Profile, StepPoint

SHAPE = ModelShape("tiny", "LlamaForCausalLM", 128, 4, 8, 2, 16, 384, 512)
LINES = {(2, 1): (2.0, 0.25), (1, 2): (0.8, 0.6)}  # (replicas, tp) -> ms = a + s * batch
COSTS = CostModel(1e6, 1.0, 10.0, 1.0, 1.0, 20.0, 2.0)


def profile() -> Profile:
    pts = [
        StepPoint(d, t, b, c, round(a + s * b, 4))
        for (d, t), (a, s) in LINES.items()
        for b in (1, 2, 4, 8, 16, 32, 64)
        for c in (16, 2048)
    ]
    prov = {
        "notes": "made up for tests: TP=2 pays in the tail",
        "command": "python tests/data/make_tp2_pays_profile.py",
    }
    name, created = "tiny-2rank-tp2-pays", "2026-11-22T00:00:00+00:00"
    return Profile(
        name, SHAPE, "test", "cpu", 2, "test", "float32", "modelled", pts, [], COSTS, prov, created
    )


if __name__ == "__main__":
    profile().to_json(Path(__file__).with_name("tiny-2rank-tp2-pays.json"))
