"""A job's prompts: JSONL, or Parquet in VeRL's format, each with its pass-through fields (torch-free).

JSONL: one object per line with ``prompt`` (text, or a list of chat messages ``{role, content}``) or
``input_ids``, an optional ``id`` (default: the line's index among the prompts), an optional
``max_new_tokens`` (this prompt's own cap, under the job's: how a prompt set replays recorded lengths),
and any other fields, which are passed through to the samples (VeRL's ``data_source``, ``reward_model``,
``extra_info``, ...).
Parquet (VeRL): a ``prompt`` column of chat messages (or text); the id is ``extra_info.index`` when present,
else the row index; every other column passes through. Chat messages are rendered with the model's chat
template (``tokenizer_config.json``) when it has one; without one, prompts must be text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_worker.data.files import read_text
from rollout_worker.data.jsonl import iter_jsonl
from rollout_worker.errors import UserError

# The tokenizer config of ``rolloutctl make-model``'s random checkpoints, with a plain chat template (each
# message as "role: content", then the assistant's turn), so that chat-format prompts (VeRL's Parquet) render
# with them as with a real model's template.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
RANDOM_MODEL_TOKENIZER_CONFIG: dict[str, str] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "pad_token": "<|pad|>",
    "chat_template": CHAT_TEMPLATE,
}


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str | None  # the rendered prompt (chat template applied), or None when given as ids
    input_ids: list[int] | None
    extra: dict[str, Any] = field(default_factory=dict)  # passed through to every sample of the prompt
    max_new_tokens: int | None = None  # this prompt's cap (the job's applies too)


class ChatTemplate:
    """A model's chat template, rendered as transformers renders it (sandboxed jinja2)."""

    def __init__(self, template: str, special: dict[str, str]) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v, **kw: json.dumps(v, **kw)
        env.globals["raise_exception"] = _raise
        self.template, self.special = env.from_string(template), special

    @classmethod
    def of_model(cls, model_dir: str | Path) -> ChatTemplate | None:
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.exists():
            return None
        try:
            return cls.of_config(json.loads(read_text(path, "model", "tokenizer config")))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None

    @classmethod
    def of_config(cls, cfg: dict[str, Any]) -> ChatTemplate | None:
        """From a ``tokenizer_config.json``'s contents; None when it has no chat template."""
        if not cfg.get("chat_template"):
            return None
        special = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
        return cls(cfg["chat_template"], special)

    def render(self, messages: list[dict[str, Any]]) -> str:
        return str(self.template.render(messages=messages, add_generation_prompt=True, **self.special))


def _raise(message: str) -> None:
    raise ValueError(message)


def _text(value: Any, where: str, template: ChatTemplate | None) -> str:
    if isinstance(value, str):
        if not value:
            raise UserError(f"{where}: field 'prompt' is empty")
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        if template is None:
            raise UserError(f"{where}: field 'prompt' is chat messages, but the model has no chat template")
        try:
            return template.render(value)
        except Exception as exc:  # a template's own error (raise_exception) or a bad message
            raise UserError(f"{where}: field 'prompt': the chat template failed: {exc}") from None
    raise UserError(f"{where}: field 'prompt' must be text or a list of chat messages {{role, content}}")


def _jsonl(path: Path, template: ChatTemplate | None) -> list[Prompt]:
    out: list[Prompt] = []
    for where, _, obj in iter_jsonl(path, "spec.prompts.path"):
        if not isinstance(obj, dict):
            raise UserError(f"{where}: expected a JSON object")
        rid = str(obj.get("id", len(out)))
        extra = {k: v for k, v in obj.items() if k not in ("id", "prompt", "input_ids", "max_new_tokens")}
        cap = obj.get("max_new_tokens")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise UserError(f"{where}: field 'max_new_tokens' must be an integer >= 1")
        if ("prompt" in obj) == ("input_ids" in obj):
            raise UserError(f"{where}: give exactly one of 'prompt' or 'input_ids'")
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise UserError(f"{where}: field 'input_ids' must be a non-empty list of integers")
            out.append(Prompt(rid, None, ids, extra, cap))
        else:
            out.append(Prompt(rid, _text(obj["prompt"], where, template), None, extra, cap))
    return out


def _parquet(path: Path, template: ChatTemplate | None) -> list[Prompt]:
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{path}: cannot read as Parquet ({exc})", "spec.prompts.path") from None
    out = []
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        if "prompt" not in row:
            raise UserError(f"{where}: no 'prompt' column (VeRL's format)")
        info = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        rid = str(info.get("index", i)) if info else str(i)
        extra = {k: v for k, v in row.items() if k != "prompt"}
        out.append(Prompt(rid, _text(row["prompt"], where, template), None, extra))
    return out


def load_prompts(
    path: str | Path, limit: int | None = None, template: ChatTemplate | None = None
) -> list[Prompt]:
    """Every prompt of the file (the first ``limit``); ids must be unique."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"prompts file not found: {p}", "spec.prompts.path")
    prompts = _parquet(p, template) if p.suffix == ".parquet" else _jsonl(p, template)
    prompts = prompts[:limit] if limit else prompts
    seen: set[str] = set()
    for pr in prompts:
        if pr.id in seen:
            raise UserError(f"{p}: duplicate prompt id {pr.id!r}", "spec.prompts.path")
        seen.add(pr.id)
    if not prompts:
        raise UserError(f"{p} has no prompts", "spec.prompts.path")
    return prompts
