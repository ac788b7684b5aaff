"""The docs' benchmark page is rendered from the committed result files: rendering it again from
``bench/results/*/index.json`` gives the committed page (regenerate with ``make bench-tables``), every
indexed file exists and has a table, and every table names its machine, date and command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_bench import tables

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs/benchmarks.md"


def test_the_benchmark_page_is_what_the_result_files_render() -> None:
    page = PAGE.read_text()
    assert tables.render_page(page) == page, "docs/benchmarks.md is stale: run `make bench-tables`"


def _indexes() -> list[Path]:
    return sorted((ROOT / "bench/results").glob("*/index.json"))


def test_every_indexed_result_is_a_table_naming_its_machine_date_and_command() -> None:
    page = PAGE.read_text()
    assert len(_indexes()) >= 3
    for index_path in _indexes():
        index = json.loads(index_path.read_text())
        machine = index["machine"][0].upper() + index["machine"][1:]
        assert f"## {machine}, {index['date']} (`{index_path.parent.name}`)" in page
        for r in index["results"]:
            assert (index_path.parent / r["file"]).is_file(), r["file"]
            assert r["kind"] in tables.KINDS
            head = f"Measured on {index['machine']}, {index['date']}, with `{r['command']}`"
            assert head in page, head
            after = page.split(head, 1)[1].split("\n### ", 1)[0]
            assert "\n| " in after, f"no table under {r['title']}"


def test_an_unknown_kind_is_refused_naming_the_index(tmp_path: Path) -> None:
    folder = tmp_path / "box-2026-01-01"
    folder.mkdir()
    (folder / "r.json").write_text("{}")
    index = {"machine": "a box", "date": "2026-01-01", "results": [{"file": "r.json", "kind": "nope"}]}
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"box-2026-01-01/index.json: unknown kind 'nope'"):
        tables.render_results(tmp_path)


def test_a_table_follows_its_numbers(tmp_path: Path) -> None:
    """The rendering reads the file: a changed figure changes the table."""
    src = ROOT / "bench/results/epyc-2026-11-27"
    folder = tmp_path / "copy-2026-11-27"
    folder.mkdir()
    name = "decoder-step-medium.json"
    data = json.loads((src / name).read_text())
    data["points"][0]["default_ms"] = 12345.0
    (folder / name).write_text(json.dumps(data))
    entry = {"file": name, "kind": "decoder-step", "title": "t", "command": "c"}
    (folder / "index.json").write_text(json.dumps({"machine": "m", "date": "2026-11-27", "results": [entry]}))
    assert "| 12,345.0 ms |" in tables.render_results(tmp_path)
