"""A pod's samples on disk: one JSONL file, appended one flushed and fsynced line per finished sample.

Resuming: the file is read back; a torn last line (the process died while writing it) is cut off, every
whole line is a sample already done and is not generated again, and no sample is ever written twice. A
line in the middle that is not JSON is corruption, reported, never skipped. One writer at a time: the file
is locked (``flock``, released by the kernel when the holder dies, SIGKILL included), so a second sidecar
of the same pod is refused instead of writing beside the first. At the end a manifest lists every output
file with its sample count and SHA-256.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from rollout_worker.api.sidecar import Sample, parse_samples
from rollout_worker.errors import UserError

log = logging.getLogger(__name__)
Key = tuple[str, int]  # (prompt id, sample index)


class SampleWriter:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[Sample] = []  # every sample in the file, in file order (the cursor)
        self.done: set[Key] = set()
        self._f = self.path.open("ab")
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise UserError(
                f"{self.path} is being written by another process (another sidecar of this pod?)",
                "output_dir",
            ) from None
        try:
            self.repaired_bytes = self._load()
        except BaseException:
            self._f.close()
            raise

    def _load(self) -> int:
        """Read back what is there; cut a torn last line. Returns the bytes cut."""
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
        cut = len(data) - end
        if cut:
            with self.path.open("r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
            log.warning("%s: cut a torn last line (%d bytes) left by an interrupted write", self.path, cut)
        for n, rec in enumerate(parse_samples(data[:end], self.path), start=1):
            key = (rec.prompt_id, rec.sample)
            if key in self.done:
                raise UserError(f"{self.path}:{n}: sample {key} written twice; the file is damaged")
            self.done.add(key)
            self.records.append(rec)
        return cut

    def write(self, record: Sample) -> int:
        """Append one sample durably (flush + fsync); returns its cursor (index in the file)."""
        key = (record.prompt_id, record.sample)
        if key in self.done:
            raise ValueError(f"sample {key} is already written")
        self._f.write(record.to_line())
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done.add(key)
        self.records.append(record)
        return len(self.records) - 1

    def close(self) -> None:
        self._f.close()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_manifest(out_dir: str | Path, files: list[Path], extra: dict[str, Any] | None = None) -> Path:
    """``manifest.json`` beside the outputs: every file with its sample count and SHA-256 (atomically)."""
    out = Path(out_dir)
    entries: list[dict[str, Any]] = []
    total = 0
    for f in sorted(files):
        with f.open("rb") as fh:
            count = sum(1 for _ in fh)
        total += count
        entries.append({"file": f.name, "samples": count, "sha256": sha256_of(f), "bytes": f.stat().st_size})
    manifest = {"files": entries, "samples": total, **(extra or {})}
    tmp = out / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(out / "manifest.json")
    return out / "manifest.json"
