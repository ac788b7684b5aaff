"""What a run's samples say, for the report (pure): the length distribution (p50, p90, p99, max, the share
that stopped at the cap), the mean reward and the pass@k of the GRPO groups (k samples per prompt: the
share of prompts with at least one correct sample among its k); or, when no prompt carries a ground truth
or no response gives an answer to check (a model with random weights writes none), that there are no
answers to score."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from rollout_worker.api.sidecar import Sample
from rollout_worker.data.reward import answer
from rollout_worker.web.probe import percentile


@dataclass(frozen=True)
class RolloutStats:
    samples: int
    distinct: int  # distinct (prompt, sample) pairs: = samples when every sample is written once
    prompts: int
    p50: int
    p90: int
    p99: int
    max: int
    at_cap: int  # samples that stopped at their max_new_tokens (finish reason "length")
    rewarded: int  # samples with a reward (their prompt has a ground truth)
    answered: int  # of those, the ones whose response gives an answer (a number) to check
    mean_reward: float | None
    k: int  # samples per prompt (the largest group)
    pass_at_k: float | None  # over the prompts with rewarded samples
    passed_prompts: int  # prompts with at least one correct sample
    rewarded_prompts: int  # prompts with rewarded samples

    @property
    def at_cap_share(self) -> float:
        return self.at_cap / self.samples if self.samples else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"at_cap_share": round(self.at_cap_share, 4)}

    def lines(self) -> list[str]:
        out = [
            f"  lengths: p50 {self.p50}, p90 {self.p90}, p99 {self.p99}, max {self.max} tokens; "
            f"{self.at_cap} of {self.samples} samples ({self.at_cap_share:.0%}) at the cap"
        ]
        if not self.rewarded:
            out.append("  rewards: no answers to score (no prompt carries a ground truth)")
        elif not self.answered:
            out.append(
                f"  rewards: no answers to score (none of the {self.rewarded} responses to prompts with a "
                "ground truth gives a number)"
            )
        elif self.mean_reward is not None and self.pass_at_k is not None:
            out.append(
                f"  rewards: mean {self.mean_reward:.3f} over {self.rewarded} samples (each in its output "
                f"line); pass@{self.k} {self.pass_at_k:.3f} ({self.passed_prompts} of "
                f"{self.rewarded_prompts} prompts with a correct sample)"
            )
        if self.distinct != self.samples:
            out.append(f"  {self.samples - self.distinct} samples were written more than once")
        return out


def stats_of(samples: list[Sample]) -> RolloutStats | None:
    """The stats of a run's samples; None when there are none."""
    if not samples:
        return None
    lengths = [float(s.completion_tokens) for s in samples]
    groups: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        if s.reward is not None:
            groups[s.prompt_id].append(s.reward)
    rewards = [x for g in groups.values() for x in g]
    answered = sum(1 for s in samples if s.reward is not None and answer(s.output_text) is not None)
    passed = sum(1 for g in groups.values() if max(g) >= 1.0)
    sizes: dict[str, int] = defaultdict(int)
    for s in samples:
        sizes[s.prompt_id] += 1
    return RolloutStats(
        samples=len(samples),
        distinct=len({(s.prompt_id, s.sample) for s in samples}),
        prompts=len(sizes),
        p50=int(percentile(lengths, 0.5)),
        p90=int(percentile(lengths, 0.9)),
        p99=int(percentile(lengths, 0.99)),
        max=int(max(lengths)),
        at_cap=sum(1 for s in samples if s.capped),
        rewarded=len(rewards),
        answered=answered,
        mean_reward=sum(rewards) / len(rewards) if rewards else None,
        k=max(sizes.values()),
        pass_at_k=passed / len(groups) if groups else None,
        passed_prompts=passed,
        rewarded_prompts=len(groups),
    )
