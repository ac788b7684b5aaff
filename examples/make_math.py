"""Writes the math prompts: 64 GSM8K-style word problems, each from one of 16 templates (8 of one step, 8 of
two or three) with its numbers drawn at random (seeded) and its answer computed, so every prompt carries its
ground truth. The instruction asks for GSM8K's answer format ("#### 72"); VeRL's own ("Let's think step by
step ...") sends a 135M model into long detours.

- examples/math.jsonl (the quickstart's): `id`, `prompt` (chat messages), `ground_truth`, `data_source`;
- examples/math.parquet (VeRL's RL dataset format, as its examples/data_preprocess/gsm8k.py writes it, for
  examples/verl-job.yaml): `data_source`, `prompt` (chat messages), `ability`, `reward_model` {style,
  ground_truth}, `extra_info` {split, index, answer, question}.

`rolloutctl run` renders `prompt` with the model's chat template, passes every other field through to each
sample and gives each sample its reward (rollout_worker.data.reward: 1 when the number after `####`, else the
last number of the response, equals the ground truth). Run: python examples/make_math.py"""

import json
import random
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

N, SEED = 64, 16
INSTRUCTION = 'Answer with the final number after "####".'
PEOPLE = [
    ("Natalia", "she", "her"),
    ("James", "he", "his"),
    ("Janet", "she", "her"),
    ("Tom", "he", "his"),
    ("Maria", "she", "her"),
    ("Ken", "he", "his"),
    ("Julie", "she", "her"),
    ("Albert", "he", "his"),
]
Problem = tuple[str, int]
Template = Callable[[random.Random, str, str, str], Problem]


# one step each: a 135M model gets about half of them right
def apples(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, b = r.randint(5, 40), r.randint(2, 20)
    q = f"{n} has {a} apples. {s.capitalize()} buys {b} more apples."
    return f"{q} How many apples does {n} have now?", a + b


def stickers(r: random.Random, n: str, s: str, p: str) -> Problem:
    a = r.randint(15, 60)
    b = r.randint(2, a - 5)
    q = f"{n} had {a} stickers. {s.capitalize()} gave {b} stickers to {p} friend."
    return f"{q} How many stickers does {n} have left?", a - b


def pencils(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, b = r.randint(3, 12), r.randint(2, 9)
    return f"A box holds {a} pencils. How many pencils are in {b} boxes?", a * b


def marbles(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, b = r.randint(2, 12), r.randint(2, 8)
    q = f"{n} has {a * b} marbles and shares them equally among {b} friends."
    return f"{q} How many marbles does each friend get?", a


def reading(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, b = r.randint(4, 25), r.randint(2, 9)
    return f"{n} reads {a} pages every day. How many pages does {s} read in {b} days?", a * b


def farm(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, b = r.randint(5, 40), r.randint(3, 30)
    return f"A farmer has {a} cows and {b} pigs. How many animals does the farmer have?", a + b


def hourly(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, b = r.randint(8, 30), r.randint(2, 9)
    return f"{n} earns ${a} an hour. How much does {s} earn in {b} hours?", a * b


def students(r: random.Random, n: str, s: str, p: str) -> Problem:
    a = r.randint(20, 45)
    b = r.randint(5, a - 5)
    return f"There are {a} students in a class. {b} of them are boys. How many girls are there?", a - b


# two or three steps (GSM8K's own kind)
def clips(r: random.Random, n: str, s: str, p: str) -> Problem:
    a = 2 * r.randint(10, 60)
    q = f"{n} sold clips to {a} of {p} friends in April, and then {s} sold half as many clips in May."
    return f"{q} How many clips did {n} sell altogether in April and May?", a + a // 2


def wage(r: random.Random, n: str, s: str, p: str) -> Problem:
    m = r.choice([15, 20, 30, 40, 45, 50])
    rate = 60 // {15: 15, 20: 20, 30: 30, 40: 20, 45: 15, 50: 10}[m] * r.randint(2, 8)
    q = f"{n} earns ${rate} an hour for babysitting. Yesterday, {s} just did {m} minutes of babysitting."
    return f"{q} How much did {s} earn?", rate * m // 60


def eggs(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, b, c, price = r.randint(12, 24), r.randint(2, 4), r.randint(2, 5), r.randint(2, 5)
    q = (
        f"{n}'s ducks lay {a} eggs per day. {s.capitalize()} eats {b} for breakfast every morning and bakes "
        f"muffins with {c}. {s.capitalize()} sells the rest at the market for ${price} per egg."
    )
    return f"{q} How many dollars does {s} make every day at the market?", (a - b - c) * price


def pages(r: random.Random, n: str, s: str, p: str) -> Problem:
    a = r.randint(8, 30)
    total = 3 * a + r.randint(10, 90)
    q = f"{n} is reading a {total}-page book. Yesterday, {s} read {a} pages, and today twice as many."
    return f"{q} How many pages are left to read?", total - 3 * a


def change(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, price, b, pen = r.randint(2, 6), r.randint(2, 9), r.randint(2, 5), r.randint(1, 4)
    bill = 50 if a * price + b * pen < 50 else 100
    q = f"{n} buys {a} notebooks at ${price} each and {b} pens at ${pen} each, and pays with a ${bill} bill."
    return f"{q} How much change does {s} get?", bill - a * price - b * pen


def train(r: random.Random, n: str, s: str, p: str) -> Problem:
    v, h, w, k = r.randint(4, 9) * 10, r.randint(2, 5), r.randint(3, 8) * 10, r.randint(2, 4)
    q = f"A train travels at {v} miles per hour for {h} hours, then at {w} miles per hour for {k} hours."
    return f"{q} How many miles does it travel in total?", v * h + w * k


def candies(r: random.Random, n: str, s: str, p: str) -> Problem:
    k, b, c = r.randint(2, 6), r.randint(2, 5), r.randint(1, 6)
    a = k * b + c + r.randint(3, 20)
    q = f"{n} has {a} candies. {s.capitalize()} gives {b} to each of {p} {k} friends and eats {c}."
    return f"{q} How many candies does {s} have left?", a - k * b - c


def jelly(r: random.Random, n: str, s: str, p: str) -> Problem:
    a, add = r.randint(1, 5), r.randint(1, 6)
    q = (
        f"{n} puts {a} pound{'s' * (a > 1)} of jelly beans in a box. Then {s} triples the weight, adds {add} "
        f"more pound{'s' * (add > 1)}, and doubles the weight."
    )
    return f"{q} How many pounds does the box hold now?", (3 * a + add) * 2


TEMPLATES: list[Template] = [  # the one-step ones first: the quickstart takes the first 8 problems
    apples, stickers, pencils, marbles, reading, farm, hourly, students,
    clips, wage, eggs, pages, change, train, candies, jelly,
]  # fmt: skip


def problems() -> list[Problem]:
    """N distinct problems, the templates in turn."""
    rng, out, seen = random.Random(SEED), [], set()
    while len(out) < N:
        name, s, p = rng.choice(PEOPLE)
        q, a = TEMPLATES[len(out) % len(TEMPLATES)](rng, name, s, p)
        if q not in seen:
            seen.add(q)
            out.append((q, a))
    return out


def main() -> None:
    here = Path(__file__).parent
    rows = []
    for i, (q, a) in enumerate(problems()):
        messages = [{"role": "user", "content": f"{q} {INSTRUCTION}"}]
        rows.append((i, q, str(a), messages))
    jsonl = here / "math.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps({"id": str(i), "prompt": m, "ground_truth": a, "data_source": "gsm8k-style"}) + "\n"
            for i, q, a, m in rows
        )
    )
    table = [
        {
            "data_source": "openai/gsm8k",
            "prompt": m,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"split": "train", "index": i, "answer": a, "question": q},
        }
        for i, q, a, m in rows
    ]
    parquet = here / "math.parquet"
    pq.write_table(pa.Table.from_pylist(table), parquet)
    print(f"wrote {jsonl} and {parquet}: {len(rows)} problems")


if __name__ == "__main__":
    main()
