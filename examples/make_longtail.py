"""Writes examples/longtail.jsonl: 16 arithmetic prompts whose `max_new_tokens` replay a long-tailed length
distribution (lognormal, median 32 tokens, sigma 1.0, capped at 192), the shape GRPO rollouts on reasoning
tasks have. With `sampling.ignoreEos: true` each sample generates exactly its prompt's length, so a
random-weight model reproduces the tail. Run: python examples/make_longtail.py"""

import json
import math
import random
from pathlib import Path

N, MEDIAN, SIGMA, CAP, SEED = 16, 32, 1.0, 192, 7


def main() -> None:
    rng = random.Random(SEED)
    rows = []
    for i in range(N):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        n = min(CAP, max(8, round(MEDIAN * math.exp(rng.gauss(0.0, SIGMA)))))
        rows.append(
            {
                "id": f"q{i:02d}",
                "prompt": f"What is {a}*{b}?",
                "max_new_tokens": n,
                "data_source": "arith",
                "reward_model": {"ground_truth": str(a * b)},
            }
        )
    out = Path(__file__).with_name("longtail.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = sorted(r["max_new_tokens"] for r in rows)
    print(f"wrote {out}: {N} prompts, lengths {lengths[0]}..{lengths[-1]}, sum {sum(lengths)}: {lengths}")


if __name__ == "__main__":
    main()
