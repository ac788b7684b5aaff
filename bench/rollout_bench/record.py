"""Where a benchmark's results go: one JSON file with, under ``recorded``, what was run and where (the
command, the date, the CPU or GPU, the versions). Results kept in the repository live in
``bench/results/<machine>-<date>/`` with an ``index.json`` naming each file's machine, command and table
(:mod:`rollout_bench.tables` renders the docs' benchmark page from them)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def host() -> dict[str, Any]:
    """The machine a benchmark runs on: the date, the CPU, how many, Python's and torch's versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "?"
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch,
    }


def command() -> str:
    """The command line as a user would type it: ``rolloutctl ...`` or ``python bench/SCRIPT.py ...``."""
    argv0 = sys.argv[0]
    if Path(argv0).name == "rolloutctl" or "rollout_operator" in argv0:
        return shlex.join(["rolloutctl", *sys.argv[1:]])
    return shlex.join(["python", f"bench/{Path(argv0).name}", *sys.argv[1:]])


def recorded() -> dict[str, Any]:
    """What was run, when and on what."""
    out: dict[str, Any] = {"command": command(), **host()}
    torch = sys.modules.get("torch")  # the GPU only if the benchmark imported torch (the driver does not)
    if torch is not None and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def write_json(path: Path, report: dict[str, Any]) -> Path:
    """Write ``report`` with its ``recorded`` block (kept when it has one: a recording of another run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"recorded": recorded(), **report}, indent=1) + "\n")
    return path
