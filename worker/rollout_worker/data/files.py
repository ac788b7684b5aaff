"""Input files read with one clear error and a bound on their size (:func:`read_text`: a user-given path may
name ``/dev/zero`` or a multi-gigabyte file by mistake), and output paths, one rule for every command:
each is checked writable before the work starts (:func:`check_writable`), written atomically
(:func:`write_atomic`), and when writing still fails at the end (the disk filled, the directory went away),
the result is saved beside it and the message says where (:func:`save`). Errors name the field or flag the
path came from."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from rollout_worker.errors import UserError

PROBE = ".rollout-probe-"
MAX_INPUT_BYTES = 64 << 20  # a manifest, a profile, a model's config: far more than any real one
MAX_SECRET_BYTES = 64 << 10  # a token or API key file
MAX_DATA_BYTES = 1 << 30  # a JSON Lines file of prompts or requests (larger sets: Parquet)


def read_text(
    path: str | Path, field: str | None = None, what: str = "file", limit: int = MAX_INPUT_BYTES
) -> str:
    """The text (UTF-8) of an input file, read no further than ``limit`` bytes; a missing, unreadable,
    non-text or larger file (``/dev/zero``) is a UserError naming ``field``."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise UserError(f"{path} is over {_size(limit)}, the limit of a {what}", field)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}", field) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # a directory, under a file, not UTF-8, NUL
        raise UserError(f"cannot read {what} {path} as text ({_why(exc)})", field) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # (as text mode reads lines)


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def check_writable(
    path: str | Path, field: str, *, directory: bool = False, inputs: Iterable[str | Path] = ()
) -> None:
    """Refuse ``path`` (a file to write, or with ``directory`` a directory to write into) when it cannot be
    written: one of ``inputs``, a directory where a file is meant or the reverse, a link to nothing (an
    unmounted volume?), under a regular file, or in a directory where no file can be created (read-only,
    immutable, ``/proc``). Creates nothing."""
    p = Path(path)
    try:
        if "\0" in str(p):
            raise ValueError("embedded null byte")
        if p.is_symlink() and not p.exists():
            raise UserError(f"{p} is a symbolic link to {os.readlink(p)}, which does not exist", field)
        for inp in inputs:
            if Path(inp).exists() and p.exists() and p.samefile(inp):
                raise UserError(f"{p} is the input file; writing it would destroy it", field)
        if p.exists() and p.is_dir() != directory:
            raise UserError(
                f"{p} is {'a file' if directory else 'a directory'}, not a {_kind(directory)}", field
            )
        if p.is_file() and not os.access(p, os.W_OK):
            raise UserError(f"{p} is not writable", field)
        _probe(_nearest(p if directory else p.parent, field), field)
    except (OSError, ValueError) as exc:  # a name too long, an embedded NUL, a loop of links
        raise UserError(f"{str(p)[:200]!r} is not a usable path ({_why(exc)})", field) from None


def _kind(directory: bool) -> str:
    return "directory" if directory else "file"


def _nearest(d: Path, field: str) -> Path:
    """``d`` or its closest ancestor that exists, which must be a directory."""
    for anc in (d, *d.parents):
        if anc.exists():
            if not anc.is_dir():
                raise UserError(f"{anc} is a file, not a directory", field)
            return anc
    return Path.cwd()


def _probe(d: Path, field: str) -> None:
    """Create and remove a file in ``d``: the one test that holds for root, read-only mounts and /proc."""
    try:
        fd, name = tempfile.mkstemp(prefix=PROBE, dir=d)
    except OSError as exc:
        raise UserError(f"cannot create files in {d} ({_why(exc)})", field) from None
    os.close(fd)
    os.unlink(name)


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write beside ``path`` and rename (missing directories made): readers never see a partial file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        tmp.replace(p)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def save(path: str | Path, data: str | bytes, field: str) -> Path:
    """Write ``data`` to ``path``; when that fails, save it beside ``path`` (else in the current or the
    temporary directory) and raise a UserError that says where, so that finished work is never lost."""
    p = Path(path)
    try:
        write_atomic(p, data)
        return p
    except OSError as exc:
        why = _why(exc)
    for d in (p.parent, Path.cwd(), Path(tempfile.gettempdir())):
        try:
            fd, name = tempfile.mkstemp(prefix=f"{p.name}.", suffix=".saved", dir=d)
        except OSError:
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
        except OSError:
            Path(name).unlink(missing_ok=True)
            continue
        raise UserError(f"cannot write {p} ({why}); saved it as {name} instead", field)
    raise UserError(f"cannot write {p} ({why}), nor anywhere beside it: the result is lost", field)
