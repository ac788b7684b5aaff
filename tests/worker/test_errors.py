"""rollout_worker.errors: a pydantic ValidationError as field-named messages, and errors renamed from
fields to the flags or variables that set them."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import AfterValidator, BaseModel, ValidationError, model_validator
from rollout_worker.errors import FieldAt, UserError, field_errors, user_error


def _positive(v: int) -> int:
    if v < 1:
        raise ValueError("must be >= 1")
    return v


class Inner(BaseModel):
    sizes: list[Annotated[int, AfterValidator(_positive)]] = []


class Outer(BaseModel):
    inner: Inner = Inner()
    low: int = 0
    high: int = 0

    @model_validator(mode="after")
    def _order(self) -> Outer:
        if self.low > self.high:
            raise FieldAt(("high",), f"must be at least low ({self.low})")
        return self


def _errors(data: dict[str, object]) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        Outer.model_validate(data)
    return info.value


def test_field_errors_name_the_field_with_pydantic_s_own_parts_left_out() -> None:
    exc = _errors({"inner": {"sizes": [1, 0, "x"]}})
    assert field_errors(exc) == [
        (("inner", "sizes", 1), "must be >= 1"),
        (("inner", "sizes", 2), "Input should be a valid integer, unable to parse string as an integer"),
    ]
    assert field_errors(exc, 1) == [(("inner", "sizes", 1), "must be >= 1")]


def test_a_cross_field_rule_names_its_field() -> None:
    assert field_errors(_errors({"low": 2, "high": 1})) == [(("high",), "must be at least low (2)")]


def test_user_error_names_the_field_as_the_surface_calls_it() -> None:
    err = user_error(_errors({"low": 2, "high": 1}), lambda path: "ROLLOUT_X_" + str(path[0]).upper())
    assert str(err) == "ROLLOUT_X_HIGH: must be at least low (2)"


def test_renamed_keeps_an_index_and_leaves_unknown_fields_alone() -> None:
    flags = {"candidates": "--candidates"}
    assert str(UserError("bad", "candidates[2]").renamed(flags)) == "--candidates[2]: bad"
    assert str(UserError("bad", "other").renamed(flags)) == "other: bad"
    assert str(UserError("bad").renamed(flags)) == "bad"
