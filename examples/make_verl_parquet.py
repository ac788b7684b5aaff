"""Writes examples/verl-gsm8k-mini.parquet: 8 prompts in VeRL's RL dataset format (as its
examples/data_preprocess/gsm8k.py writes them): `data_source`, `prompt` (chat messages), `ability`,
`reward_model` {style, ground_truth}, `extra_info` {split, index, answer, question}. `rolloutctl run` renders
`prompt` with the model's chat template and passes every other column through to each sample, so a VeRL
reward function can score the outputs as they are. Run: python examples/make_verl_parquet.py"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PROBLEMS = [
    ("Natalia sold clips to 48 friends in April, and half as many in May. How many in all?", "72"),
    ("Weng earns $12 an hour babysitting. How much for 50 minutes?", "10"),
    ("Betty has half of $100. Her parents give $15, her grandparents twice that. How much more?", "5"),
    ("Julie read 12 pages, then twice as many, of a 120-page book. Half the rest tomorrow?", "42"),
    ("James writes a 3-page letter to 2 friends twice a week. How many pages a year?", "624"),
    ("Mark has 10 yellow flowers, 80% more purple ones, and 25% as many green as the two. How many?", "35"),
    ("Albert buys 2 large pizzas of 16 slices and 2 small of 8. How many slices?", "48"),
    ("Ken puts 2 pounds of jelly beans in a box, triples it, adds 2 pounds, then doubles it. Weight?", "16"),
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def main() -> None:
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"split": "train", "index": i, "answer": a, "question": q},
        }
        for i, (q, a) in enumerate(PROBLEMS)
    ]
    out = Path(__file__).with_name("verl-gsm8k-mini.parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"wrote {out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
