"""What this machine has, read without torch (the engine's driver and the server never import it): its
memory, the container's (cgroup) limit when lower, and its CUDA devices' memory, which a short child process
reads, so that no process of the driver's initializes CUDA (a context there would take GPU memory from the
ranks)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from rollout_worker.errors import UserError

CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1
_GPUS = (  # what the child prints: each device's total memory
    "import torch; "
    "print(*(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))"
)


@functools.cache
def machine_memory() -> int:
    """Bytes of memory the engine may use: the machine's, or its container's (cgroup) limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def gpu_memory(field: str = "device") -> list[int]:
    """Bytes of memory of each visible CUDA device (read by torch in a child process); a UserError naming
    ``field`` when none is visible or torch cannot tell."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _GPUS], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"cuda: could not query the CUDA devices: {exc}", field) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"cuda: could not query the CUDA devices: {last}", field)
    sizes = [int(x) for x in done.stdout.split()]
    if not sizes:
        raise UserError("cuda: no CUDA device is visible (use cpu)", field)
    return sizes
