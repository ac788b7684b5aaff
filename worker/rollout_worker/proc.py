"""Child processes, one way for every part of the project: start ``rolloutctl`` (or any command) with its
output in a log, wait until it serves, stop it; a free loopback port, a listening socket; and a process that
ends with another.

Two ways to end with another process, each where it is needed:

* :func:`die_with_parent`: the kernel SIGKILLs this process when the *thread* that forked it ends
  (``PR_SET_PDEATHSIG``), however it ends; as a ``preexec_fn`` the parent must start children from its
  main thread. Used for the children of ``rolloutctl run`` and for the engine's ranks (whose parent on CPU is
  a forkserver).
* :func:`when_gone`: run a callback once a given process has ended (its pidfd turns readable), when that
  process is not the parent (an engine rank watches its driver) or when the end should be graceful (the
  sidecar's ``EXIT_WITH_PARENT`` stops as on SIGTERM).

Torch-free: the sidecar uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from rollout_worker.errors import EngineError, UserError

_PR_SET_PDEATHSIG = 1


class StartFailed(EngineError):
    """A child exited while starting, did not serve in time, or could not be started at all."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's choice; free until someone else binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (IPv6 when ``host`` has a colon), for a server to
    serve on: bound before anything else starts, so a taken port or a bad host ends the command at once.
    Raises a UserError naming ``host`` (not an address of this machine) or ``port`` (taken, not allowed)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: no wait after a restart
        sock.bind((host, port))
        sock.listen()
    except OSError as exc:
        sock.close()
        field = "host" if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL else "port"
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", field) from None
    return sock


RENDEZVOUS_PORTS = range(20000, 32768)  # below Linux's ephemeral range (32768-60999), where bind(0) picks


def rendezvous_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A free port for a rank group's rendezvous that no ``free_port`` caller can be handed meanwhile.

    The rendezvous is bound by rank 0 only after the ranks start; a port from the kernel's ephemeral range
    could by then belong to a server that picked it with ``free_port`` at the same moment (seen: a local
    run's sidecar took its engine's rendezvous port, EADDRINUSE). Ports below that range are never handed
    out by ``bind(0)``; a random one is checked free now."""
    rng = random.Random()
    for _ in range(tries):
        port = rng.choice(RENDEZVOUS_PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


def rolloutctl() -> list[str]:
    """The command that starts this installation's ``rolloutctl`` (the console script next to the
    interpreter), so the worker starts the CLI without naming the package that implements it."""
    path = Path(sys.executable).parent / "rolloutctl"
    if not path.is_file():
        raise StartFailed(
            f"rolloutctl not found at {path} (next to {sys.executable}): "
            "install elastic-rollout into this Python environment (pip install -e .)"
        )
    return [str(path)]


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the thread that forked it) ends; a no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def when_gone(pid: int, then: Callable[[], object], name: str = "watchdog") -> None:
    """Call ``then`` once process ``pid`` has ended, however it ended (SIGKILL included): at once if it is
    gone already, else on a daemon thread that waits on its pidfd (polls every 0.5 s without pidfd)."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        then()
        return
    except (AttributeError, OSError):  # pragma: no cover - a kernel without pidfd (< 5.3)
        fd = None

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])
            os.close(fd)
        else:  # pragma: no cover
            while _exists(pid):
                time.sleep(0.5)
        then()

    threading.Thread(target=wait, name=name, daemon=True).start()


def _exists(pid: int) -> bool:  # pragma: no cover - only without pidfd
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Child:
    """A started process and the file its stdout and stderr go to."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    @property
    def exited(self) -> bool:
        return self.proc.poll() is not None


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    *,
    with_parent: bool = False,
) -> Child:
    """Start ``argv`` (this environment plus ``env``, Python unbuffered), output to ``log``; with
    ``with_parent`` it dies with this process (:func:`die_with_parent`: call from the main thread only)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            preexec_fn=die_with_parent if with_parent else None,
        )
    return Child(name, proc, log)


async def wait_healthy(
    urls: Mapping[str, Sequence[str]], children: Sequence[Child], timeout_s: float, interval_s: float = 0.2
) -> None:
    """Until every URL of every name in ``urls`` answers 200. Raises :class:`StartFailed` as soon as one of
    ``children`` exits (with its log's tail), or after ``timeout_s`` naming the ones not ready."""
    deadline = time.monotonic() + timeout_s
    waiting = {name: list(u) for name, u in urls.items()}
    async with httpx.AsyncClient(timeout=2.0) as client:
        while waiting:
            for c in children:
                if c.exited:
                    raise StartFailed(
                        f"{c.name} exited with code {c.proc.returncode} while starting:\n{c.tail()}"
                    )
            for name, group in list(waiting.items()):
                try:
                    codes = [(await client.get(u)).status_code for u in group]
                    ok = all(code == 200 for code in codes)
                except httpx.HTTPError:
                    ok = False
                if ok:
                    del waiting[name]
            if waiting and time.monotonic() > deadline:
                raise StartFailed(f"{', '.join(waiting)} not ready after {timeout_s:.0f} s")
            if waiting:
                await asyncio.sleep(interval_s)


def stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 20.0) -> None:
    """SIGTERM every process still running, then SIGKILL those not gone within ``grace_s`` (in all)."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
