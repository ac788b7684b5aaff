"""Hypothesis strategies for request bodies, read off a pydantic request model: every field of the model
(a field added later is fuzzed with no change here), each absent or drawn from its type, integers and floats
near their bounds (inside and one step outside), strings, lists and batches kept short; ``overrides`` give
a field a domain the type alone cannot (token ids of a vocabulary, a small ``max_new_tokens``). With
``inside``, numbers stay within their bounds (bodies that mostly pass validation and reach the engine)."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

Strategy = st.SearchStrategy[Any]
WINDOW = 5  # integers drawn from [low, low + WINDOW], plus the values just outside the bounds


def body_of(
    model: type[BaseModel],
    overrides: dict[str, Strategy] | None = None,
    extra: Mapping[str, tuple[Any, ...]] | None = None,
    inside: bool = False,
) -> Strategy:
    """Dicts of ``model``'s fields (each present or not); ``extra`` keys the model also accepts at a few
    values (SGLang's neutral keys) appear at one of them or not at all."""
    over = overrides or {}
    fields = {
        name: over[name] if name in over else of_type(f.annotation, f.metadata, over, inside)
        for name, f in model.model_fields.items()
    }
    fields.update({key: st.sampled_from(values) for key, values in (extra or {}).items()})
    # each key present or not by its own coin (fixed_dictionaries' optional keys thin out as keys add up)
    keyed = [st.tuples(st.just(k), st.booleans(), v) for k, v in fields.items()]
    return st.tuples(*keyed).map(lambda kvs: {k: v for k, keep, v in kvs if keep})


def of_type(tp: Any, metadata: list[Any], over: dict[str, Strategy], inside: bool = False) -> Strategy:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:  # a union's member with constraints of its own (``Annotated[int, Field]``)
        inner = [c for f in args[1:] for c in (f.metadata if isinstance(f, FieldInfo) else [f])]
        return of_type(args[0], [*metadata, *inner], over, inside)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(of_type(a, metadata, over, inside) for a in args))
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(of_type(args[0], metadata, over, inside), max_size=3)
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return _ints(*_bounds(metadata, 1, inside))
    if tp is float:
        return _floats(*_bounds(metadata, 0, inside))
    if tp is str:
        return st.text(max_size=5)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return body_of(tp, over, inside=inside)
    raise TypeError(f"no strategy for {tp!r}: add one to tests/worker/web/bodies.py")


def _bounds(
    metadata: list[Any], step: int, inside: bool
) -> tuple[float | None, float | None, float | None, float | None]:
    """(lowest allowed, highest allowed, below the lowest, above the highest) from the field's constraints;
    nothing outside them when ``inside``."""
    lo: Any = None
    hi: Any = None
    below: Any = None
    above: Any = None
    for c in metadata:
        if isinstance(c, Ge):
            lo, below = c.ge, float(c.ge) - (step or 1e-9)  # type: ignore[arg-type]
        elif isinstance(c, Gt):
            gt: Any = c.gt
            lo, below = (gt + step if step else gt + 5e-324), gt
        elif isinstance(c, Le):
            hi, above = c.le, float(c.le) + (step or 1e-9)  # type: ignore[arg-type]
        elif isinstance(c, Lt):
            lt: Any = c.lt
            hi, above = (lt - step if step else lt), lt
    return (lo, hi, None, None) if inside else (lo, hi, below, above)


def _ints(lo: Any, hi: Any, below: Any, above: Any) -> Strategy:
    low = -2 if lo is None else int(lo)
    high = low + WINDOW if hi is None else min(int(hi), low + WINDOW)
    edges = [int(v) for v in (below, hi, above) if v is not None]
    return st.integers(low, high) | st.sampled_from(edges) if edges else st.integers(low, high)


def _floats(lo: Any, hi: Any, below: Any, above: Any) -> Strategy:
    low = -1.0 if lo is None else float(lo)
    high = low + 3.0 if hi is None else float(hi)
    tiny = [low, low + 5e-324, low + 1e-7, high] + ([1e300] if hi is None else [])
    edges = tiny + [float(v) for v in (below, above) if v is not None]
    return st.floats(low, high, allow_nan=False, allow_infinity=False) | st.sampled_from(edges)
