"""`rolloutctl bench peer`'s request sets (the benchmark itself runs out of CI): the natural set is the chat
prompts as a job renders them, EOS honoured; transformers' rows are cut where our engine stops a request."""

from __future__ import annotations

from pathlib import Path

from rollout_bench.peer import NATURAL_CAP, _until_eos, natural_set, request_sets
from rollout_worker.data.prompts import ChatTemplate, load_prompts
from rollout_worker.engine.model.tokenizer import load_tokenizer

ROOT = Path(__file__).parents[2]


def test_the_natural_set_is_the_chat_prompts_rendered_with_eos_honoured(smollm2: Path) -> None:
    rows = natural_set(smollm2, ROOT / "examples/math.jsonl")
    assert len(rows) == 16 and all(r["max_new_tokens"] == NATURAL_CAP and "ignore_eos" not in r for r in rows)
    first = load_prompts(ROOT / "examples/math.jsonl", 1, ChatTemplate.of_model(smollm2))[0]
    text = load_tokenizer(smollm2).decode(rows[0]["input_ids"], skip_special_tokens=False)
    assert text == first.text and text.startswith("<|im_start|>") and "####" in text
    assert set(request_sets(100)) == {"equal", "tail"}  # the random-token sets, EOS ignored
    assert all(r["ignore_eos"] for rs in request_sets(100).values() for r in rs)


def test_a_transformers_row_ends_at_its_cap_or_its_first_eos() -> None:
    row = {"max_new_tokens": 4}
    assert _until_eos([5, 2, 7, 2, 0, 0], row, 2) == [5, 2]  # through the first EOS; the rest is padding
    assert _until_eos([5, 6, 7, 8, 9], row, [2, 3]) == [5, 6, 7, 8]  # no EOS: the cap
    assert _until_eos([5, 3, 7], row, [2, 3]) == [5, 3]
    assert _until_eos([5, 2, 7, 8, 9], row, None) == [5, 2, 7, 8]  # EOS ignored
