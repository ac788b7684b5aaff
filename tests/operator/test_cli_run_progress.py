"""`rolloutctl run`'s progress lines when the output is not a terminal (a log file, a pipe, CI): whole,
not cut at rich's default 80 columns."""

from __future__ import annotations

import pytest
from rollout_operator.cli.run_cmds import Bars

from tests.operator.cluster.test_reconcile import _progress


def test_progress_lines_are_not_cut_when_the_output_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # rich's width when not a terminal: 80 unless told
    pod = "quickstart-with-a-long-pod-name-0"
    bars = Bars()
    bars.say("written above the bars: " + "x" * 100)
    bars({pod: _progress(0, 32, 32, "1x2").model_copy(update={"tokens_per_s": 72.0, "reconfigurations": 1})})
    bars.stop()
    out = capsys.readouterr().out
    assert "written above the bars: " + "x" * 100 in out
    line = out.splitlines()[-1]  # the bars' last state, printed when they stop
    assert line.startswith(pod + " ") and "…" not in line, line  # rich crops with an ellipsis
    assert "32/32" in line and "1x2" in line and "switches 1" in line and "72 tok/s" in line, line
    assert len(line.rstrip()) > 80
