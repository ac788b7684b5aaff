"""Prompt files: JSONL (text, chat messages, ids, pass-through fields) and VeRL's Parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rollout_worker.data.prompts import CHAT_TEMPLATE, ChatTemplate, load_prompts
from rollout_worker.errors import UserError

TEMPLATE = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>"})


def test_jsonl_forms_and_pass_through(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "What is 2+2?", "data_source": "math", "reward_model": {"ground_truth": "4"}},
        {"id": "q7", "prompt": [{"role": "user", "content": "Hi"}]},
        {"input_ids": [5, 6, 7], "extra_info": {"split": "train"}, "max_new_tokens": 9},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompts(p, template=TEMPLATE)
    assert [g.id for g in got] == ["0", "q7", "2"]
    assert got[0].text == "What is 2+2?" and got[0].extra == {
        "data_source": "math",
        "reward_model": {"ground_truth": "4"},
    }
    assert got[1].text == "<s>user: Hi\nassistant:"
    assert got[2].input_ids == [5, 6, 7] and got[2].text is None
    assert got[2].max_new_tokens == 9 and "max_new_tokens" not in got[2].extra
    assert got[0].max_new_tokens is None
    assert [g.id for g in load_prompts(p, limit=2, template=TEMPLATE)] == ["0", "q7"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "a", "input_ids": [1]}, "p.jsonl:1: give exactly one of 'prompt' or 'input_ids'"),
        ({"prompt": [{"role": "user", "content": "x"}]}, "chat messages, but the model has no chat template"),
        ({"prompt": ""}, "field 'prompt' is empty"),
        ({"prompt": 7}, "must be text or a list of chat messages"),
        ({"input_ids": ["a"]}, "'input_ids' must be a non-empty list of integers"),
        ({"prompt": "a", "max_new_tokens": 0}, "p.jsonl:1: field 'max_new_tokens' must be an integer >= 1"),
        ({"prompt": "a", "max_new_tokens": "9"}, "field 'max_new_tokens' must be an integer >= 1"),
    ],
)
def test_jsonl_errors_name_line_and_field(tmp_path: Path, line: dict[str, object], message: str) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps(line) + "\n")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_prompts(p)


def test_a_line_ends_at_newline_only(tmp_path: Path) -> None:
    """JSON leaves U+2028, U+2029, U+0085 unescaped (ensure_ascii=False); str.splitlines cuts there."""
    p = tmp_path / "p.jsonl"
    texts = ["a\u2028b", "c\u2029d", "e\x85f"]
    p.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\r\n" for t in texts))
    assert [g.text for g in load_prompts(p)] == texts


def test_duplicates_and_missing(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": 1, "prompt": "a"}) + "\n" + json.dumps({"id": "1", "prompt": "b"}) + "\n")
    with pytest.raises(UserError, match="duplicate prompt id '1'"):
        load_prompts(p)
    with pytest.raises(UserError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_verl_parquet(tmp_path: Path) -> None:
    table = pa.table(
        {
            "data_source": ["gsm8k", "gsm8k"],
            "prompt": [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+3?"}]],
            "ability": ["math", "math"],
            "reward_model": [{"ground_truth": "2", "style": "rule"}, {"ground_truth": "5", "style": "rule"}],
            "extra_info": [{"index": 10, "split": "train"}, {"index": 11, "split": "train"}],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    got = load_prompts(path, template=TEMPLATE)
    assert [g.id for g in got] == ["10", "11"]
    assert got[1].text == "<s>user: 2+3?\nassistant:"
    assert got[0].extra["reward_model"]["ground_truth"] == "2" and got[0].extra["data_source"] == "gsm8k"
    with pytest.raises(UserError, match="no chat template"):
        load_prompts(path)
