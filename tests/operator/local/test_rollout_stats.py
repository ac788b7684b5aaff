"""The report's numbers about the samples, on a hand-made set: the length distribution (nearest-rank
percentiles), the share at the cap, the mean reward and pass@k over the GRPO groups; and the lines printed."""

from __future__ import annotations

from pathlib import Path

from rollout_operator.local.report import as_dict, lines
from rollout_operator.local.result import RunResult
from rollout_operator.local.rollout_stats import stats_of
from rollout_worker.api.sidecar import Sample
from rollout_worker.scheduling.layout import Layout
from rollout_worker.sidecar.outputs import SampleWriter


def sample(
    pid: str, i: int, n: int, reward: float | None, capped: bool = False, text: str = "so #### 7"
) -> Sample:
    finish = {"type": "length", "length": n} if capped else {"type": "stop", "matched": 2}
    return Sample(
        prompt_id=pid,
        sample=i,
        prompt="q",
        output_text=text,
        output_ids=[1] * n,
        output_logprobs=[-1.0] * n,
        finish_reason=finish,
        prompt_tokens=1,
        completion_tokens=n,
        layouts=["2x1"],
        weight_version="default",
        sampling_seed=i,
        reward=reward,
    )


# 3 prompts x 4 samples; lengths 10..120 (the two 120s capped); prompt a: 2 correct, b: 1, c: none
SAMPLES = [
    sample("a", 0, 10, 1.0),
    sample("a", 1, 20, 0.0),
    sample("a", 2, 30, 1.0),
    sample("a", 3, 40, 0.0),
    sample("b", 0, 50, 0.0),
    sample("b", 1, 60, 0.0),
    sample("b", 2, 70, 1.0),
    sample("b", 3, 80, 0.0),
    sample("c", 0, 90, 0.0),
    sample("c", 1, 100, 0.0),
    sample("c", 2, 120, 0.0, capped=True),
    sample("c", 3, 120, 0.0, capped=True),
]


def test_the_numbers_of_a_hand_made_set() -> None:
    s = stats_of(SAMPLES)
    assert s is not None
    assert (s.samples, s.distinct, s.prompts, s.k) == (12, 12, 3, 4)
    # nearest rank over the sorted lengths: index int(q * 12) -> 6, 10, 11
    assert (s.p50, s.p90, s.p99, s.max) == (70, 120, 120, 120)
    assert s.at_cap == 2 and s.at_cap_share == 2 / 12
    assert s.mean_reward == 3 / 12
    assert s.pass_at_k == 2 / 3 and (s.passed_prompts, s.rewarded_prompts) == (2, 3)
    assert s.lines() == [
        "  lengths: p50 70, p90 120, p99 120, max 120 tokens; 2 of 12 samples (17%) at the cap",
        "  rewards: mean 0.250 over 12 samples (each in its output line); pass@4 0.667 (2 of 3 prompts with "
        "a correct sample)",
    ]


def test_no_ground_truth_no_answers_to_score_and_a_sample_twice_is_said() -> None:
    s = stats_of([sample("a", 0, 5, None), sample("a", 0, 5, None)])
    assert s is not None and s.mean_reward is None and s.pass_at_k is None
    assert s.lines() == [
        "  lengths: p50 5, p90 5, p99 5, max 5 tokens; 0 of 2 samples (0%) at the cap",
        "  rewards: no answers to score (no prompt carries a ground truth)",
        "  1 samples were written more than once",
    ]
    assert stats_of([]) is None


def test_responses_without_an_answer_are_not_scored_as_wrong() -> None:
    """Ground truths, but no response gives a number (random weights write none): no 0.000 reward and
    pass@k as if the model had answered wrongly."""
    s = stats_of([sample(p, i, 9, 0.0, text="\x03k\xff ") for p in "ab" for i in range(2)])
    assert s is not None and (s.rewarded, s.answered) == (4, 0)
    assert s.lines()[1:] == [
        "  rewards: no answers to score (none of the 4 responses to prompts with a ground truth gives a "
        "number)"
    ]


def test_the_report_reads_the_run_outputs(tmp_path: Path) -> None:
    w = SampleWriter(tmp_path / "pod-0.jsonl")
    for x in SAMPLES:
        w.write(x)
    w.close()
    r = RunResult("static", Layout.parse("2x1"), tmp_path, 2.0, 12, 780, {}, [])
    assert lines(r)[1:] == stats_of(SAMPLES).lines()  # type: ignore[union-attr]
    assert as_dict(r)["rollout"]["pass_at_k"] == 2 / 3
