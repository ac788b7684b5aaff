"""Serve the emulator from synchronous code: a background thread with its own event loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import yaml

from tests.k8s.emulator import Emulator
from tests.k8s.resources import load_crds

ROOT = Path(__file__).parents[2]
DEFAULT_CRDS = [ROOT / "crds" / "rolloutjob.yaml"]


class EmulatorHandle:
    """A running emulator: its URL, a kubeconfig for it, and direct (read-only) access to its objects."""

    def __init__(self, emulator: Emulator, url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.emulator, self.url, self.loop = emulator, url, loop

    def write_kubeconfig(self, path: Path | str, namespace: str = "default") -> Path:
        """A kubeconfig whose current context talks to this emulator (insecure, a dummy token)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "emulator", "cluster": {"server": self.url, "insecure-skip-tls-verify": True}}
            ],
            "users": [{"name": "tester", "user": {"token": "dummy-token"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "tester", "namespace": namespace},
                }
            ],
            "current-context": "emulator",
        }
        path = Path(path)
        path.write_text(yaml.safe_dump(config))
        return path

    def objects(self, plural_or_kind: str, namespace: str | None = "default") -> list[dict[str, Any]]:
        """Deep copies of the stored objects of that resource (namespace None: all namespaces)."""
        res = self.emulator.find(plural_or_kind)
        return self.emulator.store.snapshot(res, namespace if res.namespaced else None)

    def object(
        self, plural_or_kind: str, name: str, namespace: str | None = "default"
    ) -> dict[str, Any] | None:
        return next(
            (o for o in self.objects(plural_or_kind, namespace) if o["metadata"]["name"] == name), None
        )

    def errors(self) -> list[Exception]:
        """Exceptions the emulator raised while serving (its own bugs: a test should see none)."""
        return list(self.emulator._errors[-1]) if self.emulator._errors else []


async def _serve(
    crds: list[dict[str, Any]], host: str, port: int | None, ready: Any, stop: asyncio.Event
) -> None:
    emulator = Emulator(crds=crds)
    async with emulator, kmock.Server(emulator, host=host, port=port) as server:
        ready(emulator, f"http://{host}:{server.port}")
        await stop.wait()


@contextlib.contextmanager
def serve_emulator(
    crd_paths: list[Path] | list[str] | None = None, host: str = "127.0.0.1", port: int | None = None
) -> Iterator[EmulatorHandle]:
    """`with serve_emulator(crd_paths=[...]) as emu:` an emulator on `emu.url` until the block ends."""
    crds = load_crds([Path(p) for p in crd_paths] if crd_paths is not None else DEFAULT_CRDS)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    started = threading.Event()
    box: dict[str, Any] = {}

    def ready(emulator: Emulator, url: str) -> None:
        box["handle"] = EmulatorHandle(emulator, url, loop)
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(_serve(crds, host, port, ready, stop))
        except BaseException as exc:
            box["error"] = exc
            started.set()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="k8s-emulator", daemon=True)
    thread.start()
    if not started.wait(30) or "error" in box:
        raise RuntimeError(f"the emulator did not start: {box.get('error')!r}")
    try:
        yield box["handle"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(15)


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the Kubernetes API emulator until interrupted.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--crd", action="append", default=[], help="CRD YAML file (repeatable)")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for it here")
    args = parser.parse_args()
    with serve_emulator(args.crd or DEFAULT_CRDS, args.host, args.port) as emu:
        if args.kubeconfig:
            emu.write_kubeconfig(args.kubeconfig)
        print(f"Kubernetes API emulator on {emu.url} (Ctrl-C to stop)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
