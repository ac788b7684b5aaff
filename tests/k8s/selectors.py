"""Label and field selectors as list/watch query parameters spell them."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Match = Callable[[dict[str, Any]], bool]

_SET = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_terms(text: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b=c` -> ['a in (x,y)', 'b=c']."""
    terms, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    return [t.strip() for t in terms if t.strip()]


def _term(term: str) -> Callable[[dict[str, str]], bool]:
    if m := _SET.match(term):
        key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    for op in ("!=", "==", "="):
        if op in term:
            key, value = (s.strip() for s in term.split(op, 1))
            if op == "!=":
                return lambda labels: labels.get(key) != value
            return lambda labels: labels.get(key) == value
    if term.startswith("!"):
        key = term[1:].strip()
        return lambda labels: key not in labels
    return lambda labels: term in labels


def label_selector(text: str | None) -> Match:
    """`a=b,c!=d,e,!f,g in (x,y),h notin (z)` -> a predicate over whole objects."""
    terms = [_term(t) for t in _split_terms(text or "")]

    def match(obj: dict[str, Any]) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(t(labels) for t in terms)

    return match


def _field(obj: dict[str, Any], path: str) -> str | None:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return None if node is None else str(node)


def field_selector(text: str | None) -> Match:
    """`metadata.name=x,status.phase!=Running,spec.nodeName=` (any dotted path, = == !=)."""
    checks: list[tuple[str, str, bool]] = []
    for term in _split_terms(text or ""):
        negate = "!=" in term
        key, value = (s.strip() for s in re.split(r"!=|==|=", term, maxsplit=1))
        checks.append((key, value, negate))

    def match(obj: dict[str, Any]) -> bool:
        for key, value, negate in checks:
            got = _field(obj, key) or ""
            if (got == value) == negate:
                return False
        return True

    return match
