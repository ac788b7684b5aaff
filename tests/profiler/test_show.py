"""`rollout_profiler.show`: the plain-text report, the PNG plot and the reading of profile files."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from rollout_profiler.show import (
    plot_path,
    plotted_contexts,
    read_profile_file,
    render_table,
    step_latency_source,
    write_plot,
)
from rollout_profiler.store.testing import sample_profile
from rollout_worker.errors import UserError

LAYOUTS = ((4, 1), (2, 2), (1, 4))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_table_lists_every_layout_batch_context_and_cost() -> None:
    prof = sample_profile(layouts=LAYOUTS, batches=(1, 8, 64), contexts=(256, 4096))
    text = render_table(prof)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("layout"))
    assert header.split() == ["layout", "batch", "ctx", "256", "ctx", "4096"]
    rows = [line.split() for line in lines if line[:3] in ("4x1", "2x2", "1x4")]
    assert [(r[0], r[1]) for r in rows] == [(f"{d}x{t}", str(b)) for d, t in LAYOUTS for b in (1, 8, 64)]
    cell = {(p.replicas, p.tp, p.batch, p.context): p.ms for p in prof.step_latency}
    assert float(rows[0][2]) == pytest.approx(cell[(4, 1, 1, 256)], abs=5e-4)
    assert float(rows[-1][3]) == pytest.approx(cell[(1, 4, 64, 4096)], abs=5e-4)
    assert "(measured)" in text and f"shape {prof.model.shape_hash}" in text
    assert "reconfiguration cost points (3):" in text
    assert any(
        line.split() == ["2x1", "1x2", "migrate", str(2**33), str(5 * 2**40), "9000.125"] for line in lines
    )
    for key in ("migrate_bytes_per_ms", "recompute_fixed_ms", "sync_ms"):
        assert any(line.split()[:1] == [key] for line in lines), key


def test_missing_cells_and_no_reconfig_points() -> None:
    prof = sample_profile(layouts=((2, 1), (1, 2)), batches=(1,), contexts=(128, 1024))
    prof.step_latency = [p for p in prof.step_latency if (p.tp, p.context) != (2, 1024)]
    prof.reconfig_cost = []
    text = render_table(prof)
    assert [line.split() for line in text.splitlines() if line.startswith("1x2")] == [
        ["1x2", "1", "1.049", "-"]
    ]
    assert "(no reconfiguration cost points)" in text


def test_step_latency_source_comes_from_provenance_then_method() -> None:
    prof = sample_profile(method="measured")
    assert step_latency_source(prof) == "measured"
    prof.provenance = {"measured": [], "modelled": ["step_latency"]}
    assert step_latency_source(prof) == "modelled"
    prof.provenance = {}
    prof.method = "shard-equivalent"
    assert step_latency_source(prof) == "shard-equivalent"
    assert "(shard-equivalent)" in render_table(prof)


@pytest.mark.parametrize(
    ("contexts", "panels"), [((512,), [512]), ((1, 2, 3, 4), [1, 2, 3, 4]), ((1, 2, 3, 4, 5, 6), [4])]
)
def test_write_plot_writes_a_png(tmp_path: Path, contexts: tuple[int, ...], panels: list[int]) -> None:
    prof = sample_profile(layouts=LAYOUTS, batches=(1, 2, 4, 16, 64), contexts=contexts)
    assert plotted_contexts(prof.step_latency) == panels
    out = write_plot(prof, tmp_path / "p.png")
    width, height = png_size(out)
    assert width >= 700 and height >= 400
    assert out.stat().st_size > 20_000  # lines, labels and legends, not an empty canvas


def test_plot_path_and_plot_errors(tmp_path: Path) -> None:
    prof = sample_profile(name="llama/8b: h100 x8")
    assert plot_path(tmp_path, prof) == tmp_path / "llama_8b_h100_x8.png"
    assert plot_path(tmp_path / "x.png", prof) == tmp_path / "x.png"
    with pytest.raises(UserError, match="cannot write plot"):
        write_plot(prof, tmp_path / "missing" / "x.png")


def test_read_profile_file_round_trip_and_errors(tmp_path: Path) -> None:
    prof = sample_profile()
    good = tmp_path / "good.json"
    prof.to_json(good)
    assert read_profile_file(good).to_dict() == prof.to_dict()
    bad: dict[str, str | bytes] = {
        "broken.json": '{"schema": ',
        "list.json": "[1, 2]",
        "binary.json": b"\xff\xfe\x00garbage",
        "schema.json": json.dumps({**prof.to_dict(), "schema": "other/v9"}),
        "keys.json": json.dumps({k: v for k, v in prof.to_dict().items() if k != "costs"}),
    }
    expected = {
        "broken.json": "not valid JSON (line 1",
        "list.json": "must be a JSON object, got list",
        "binary.json": "cannot read profile file",
        "schema.json": "schema must be 'elastic-rollout/profile/v1'",
        "keys.json": "malformed profile (KeyError: 'costs')",
    }
    for name, content in bad.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        with pytest.raises(UserError, match=re.escape(expected[name])) as info:
            read_profile_file(path)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="profile file not found"):
        read_profile_file(tmp_path / "nope.json")
    with pytest.raises(UserError, match="is a folder"):
        read_profile_file(tmp_path)
