"""The docs' job-spec reference (``docs/reference/job-spec.md``) is what ``rolloutctl crd --reference``
renders from the models: it fails when the page drifts from them (regenerate with ``make crds``), and when the
renderer leaves out a field, a default or a bound of the schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_operator.api.crd import build_crd
from rollout_operator.api.crd_reference import reference_markdown

ROOT = Path(__file__).parents[3]
PAGE = ROOT / "docs/reference/job-spec.md"


def test_the_reference_page_is_what_the_models_render() -> None:
    assert PAGE.read_text() == reference_markdown(), "docs/reference/job-spec.md is stale: run `make crds`"


def _fields(path: str, node: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """Every (object path, field name, schema) of the tree under ``node``."""
    out = []
    for name, sub in node.get("properties", {}).items():
        out.append((path, name, sub))
        item = sub.get("items", {}) if sub.get("type") == "array" else sub
        suffix = "[]" if sub.get("type") == "array" else ""
        out += _fields(f"{path}.{name}{suffix}", item)
    return out


def _rows(page: str) -> dict[tuple[str, str], str]:
    """The page's table rows by (section, field)."""
    rows, section = {}, ""
    for line in page.splitlines():
        if line.startswith("#") and "`" in line:
            section = line.split("`")[1]
        elif line.startswith("| `"):
            rows[(section, line.split("`")[1])] = line
    return rows


def test_every_field_of_spec_and_status_has_its_row_with_default_and_bounds() -> None:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    rows = _rows(reference_markdown())
    fields = _fields("spec", root["spec"]) + _fields("status", root["status"])
    assert len(fields) > 60
    for section, name, sub in fields:
        row = rows.get((section, name))
        assert row, f"no row for {section}.{name}"
        if "default" in sub and sub["default"] != {}:
            assert f"| `{str(sub['default']).lower()}`" in row.lower().replace('"', ""), row
        for bound in ("minimum", "maximum"):
            if bound in sub:
                assert str(sub[bound]) in row, (row, bound)
        for value in sub.get("enum", []):
            assert f'`"{value}"`' in row or value is None, (row, value)
    # the spec's own defaults, spelled as a user writes them
    assert rows[("spec.engine", "maxBatch")].startswith("| `maxBatch` | integer | `64` | ≥ 1; ≤ 4096 |")
    assert rows[("spec", "model")].startswith("| `model` | object | required |")
