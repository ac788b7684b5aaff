"""The test as the kubelet: pods in the emulator run as local processes on 127.0.0.N.

    with LocalKubelet(emu.url, "default", tmp_path / "logs") as kubelet:
        ...  # create pods; they run, get Ready, fail, restart and stop like on a node

Not emulated: images, volumes (manifest paths are local paths), liveness/startup probes, init containers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rollout_worker.proc import die_with_parent

from tests.k8s.kubelet_env import ConfigError, container_argv, container_env
from tests.k8s.kubelet_status import pod_status
from tests.k8s.store import now

_LIVE: weakref.WeakSet[LocalKubelet] = weakref.WeakSet()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


@dataclass
class Container:
    spec: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: str = ""
    ready: bool = False
    exit_code: int | None = None  # the current run's, once it exited and will not restart
    finished_at: str = ""
    last: dict[str, Any] | None = None  # lastState.terminated after a restart


@dataclass
class Pod:
    uid: str
    name: str
    ip: str
    obj: dict[str, Any]
    containers: dict[str, Container] = field(default_factory=dict)
    start_time: str = ""
    config_error: str = ""
    failure: str = ""
    terminating: bool = False
    written: dict[str, Any] | None = None
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)
    failed_at: float = 0.0


class LocalKubelet:
    def __init__(
        self,
        api_url: str,
        namespace: str = "default",
        log_dir: Path | str = "kubelet-logs",
        interval: float = 0.2,
        max_grace: float = 10.0,
        node_name: str = "local-node",
    ) -> None:
        self.api = httpx.Client(base_url=api_url, timeout=10, headers={"Authorization": "Bearer dummy-token"})
        self.namespace, self.log_dir, self.interval = namespace, Path(log_dir), interval
        self.max_grace, self.node_name = max_grace, node_name
        self._pods: dict[str, Pod] = {}  # by uid
        self._starts: dict[str, int] = {}  # by pod name
        self._next_ip = 2
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._reapers: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._run, name="local-kubelet", daemon=True)
        self.errors: list[BaseException] = []
        _LIVE.add(self)
        self._thread.start()

    # --- test controls
    def _container(self, pod: str, container: str) -> Container:
        with self._lock:
            for p in self._pods.values():
                if p.name == pod and not p.terminating and container in p.containers:
                    return p.containers[container]
        raise KeyError(f"no running pod {pod!r} with a container {container!r}")

    def kill(self, pod: str, container: str, sig: int = signal.SIGKILL) -> None:
        """Signal the container's process group (SIGKILL: a crash)."""
        proc = self._container(pod, container).proc
        if proc is not None:
            _signal_group(proc, sig)

    def pause(self, pod: str, container: str) -> None:
        self.kill(pod, container, signal.SIGSTOP)

    def resume(self, pod: str, container: str) -> None:
        self.kill(pod, container, signal.SIGCONT)

    def pids(self, pod: str) -> dict[str, int]:
        with self._lock:
            return {
                name: c.proc.pid
                for p in self._pods.values()
                if p.name == pod
                for name, c in p.containers.items()
                if c.proc is not None and c.proc.poll() is None
            }

    def started(self, pod: str) -> int:
        """How many times a pod of that name was started (a re-created pod counts again)."""
        with self._lock:
            return self._starts.get(pod, 0)

    def running(self) -> list[str]:
        with self._lock:
            return sorted(
                {
                    p.name
                    for p in self._pods.values()
                    if any(c.proc is not None and c.proc.poll() is None for c in p.containers.values())
                }
            )

    def ip(self, pod: str) -> str | None:
        with self._lock:
            return next((p.ip for p in self._pods.values() if p.name == pod and not p.terminating), None)

    # --- lifecycle
    def __enter__(self) -> LocalKubelet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every process it started (SIGTERM, then SIGKILL) and the polling thread."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(30)
        for reaper in list(self._reapers):
            reaper.join(30)
        with self._lock:
            procs = [c.proc for p in self._pods.values() for c in p.containers.values() if c.proc]
        _terminate(procs, 5)
        self.api.close()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._sync()
                except httpx.HTTPError as exc:  # the emulator went away, or was slow: try again
                    self.errors.append(exc)
                self._stopping.wait(self.interval)
        except BaseException as exc:
            self.errors.append(exc)
            raise

    # --- one loop
    def _sync(self) -> None:
        r = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods")
        r.raise_for_status()
        seen = {p["metadata"]["uid"]: p for p in r.json()["items"]}
        with self._lock:
            for uid, pod in list(self._pods.items()):
                if pod.terminating:
                    continue
                obj = seen.get(uid)
                if obj is None or obj["metadata"].get("deletionTimestamp"):
                    self._terminate_pod(pod, obj)
                else:
                    pod.obj = obj
                    self._tend(pod)
            for uid, obj in seen.items():
                fresh = obj.get("status", {}).get("phase") in (None, "Pending")
                if uid not in self._pods and not obj["metadata"].get("deletionTimestamp") and fresh:
                    self._start_pod(obj)
        for reaper in [t for t in self._reapers if not t.is_alive()]:
            self._reapers.remove(reaper)

    def _read(self, plural: str, name: str) -> dict[str, Any] | None:
        r = self.api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        return r.json() if r.status_code == 200 else None

    def _start_pod(self, obj: dict[str, Any]) -> None:
        meta, spec = obj["metadata"], obj["spec"]
        pod = Pod(meta["uid"], meta["name"], f"127.0.0.{self._next_ip}", obj)
        self._next_ip += 1
        if not spec.get("nodeName"):
            self.api.post(
                f"/api/v1/namespaces/{self.namespace}/pods/{pod.name}/binding",
                json={
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": pod.name},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
                },
            )
        pod.obj["status"] = {**obj.get("status", {}), "podIP": pod.ip}  # for fieldRef status.podIP
        pod.containers = {c["name"]: Container(c) for c in spec.get("containers", [])}
        self._pods[pod.uid] = pod
        self._starts[pod.name] = self._starts.get(pod.name, 0) + 1
        self._tend(pod)

    def _tend(self, pod: Pod) -> None:
        """Start what should run, notice exits, probe readiness, and write the status when it changed."""
        policy = pod.obj["spec"].get("restartPolicy", "Always")
        for c in pod.containers.values():
            if c.proc is None and c.exit_code is None and not pod.failure:
                self._start_container(pod, c)
            elif c.proc is not None and c.exit_code is None and (code := c.proc.poll()) is not None:
                finished = {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": c.started_at,
                    "finishedAt": now(),
                }
                if policy == "Always" or (policy == "OnFailure" and code != 0):
                    c.last, c.restarts, c.proc = finished, c.restarts + 1, None
                    self._start_container(pod, c)
                else:
                    c.exit_code, c.finished_at, c.ready = code, str(finished["finishedAt"]), False
                    if code != 0 and not pod.failure:
                        pod.failure = f"container {c.spec['name']} exited with code {code}"
                        pod.failed_at = time.monotonic()
                        others = [o.proc for o in pod.containers.values() if o is not c and o.proc]
                        _terminate(others, 0, kill=False)
            if c.proc is not None and c.exit_code is None:
                c.ready = self._probe(pod, c)
        if pod.failure:
            for c in pod.containers.values():
                if c.proc is not None and c.exit_code is None and (code := c.proc.poll()) is not None:
                    c.exit_code, c.finished_at, c.ready = code, now(), False
                elif c.proc is not None and c.exit_code is None and time.monotonic() - pod.failed_at > 5:
                    _signal_group(c.proc, signal.SIGKILL)
        self._write_status(pod)

    def _start_container(self, pod: Pod, c: Container) -> None:
        name = c.spec["name"]
        try:
            env = container_env(pod.obj, c.spec, self._read)
            argv = container_argv(c.spec, env)
        except ConfigError as exc:
            pod.config_error = str(exc)
            return
        pod.config_error = ""
        resolved = shutil.which(argv[0], path=env.get("PATH")) or argv[0]
        log = self.log_dir / pod.name / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            try:
                c.proc = subprocess.Popen(
                    [resolved, *argv[1:]],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                    cwd=c.spec.get("workingDir"),
                )
            except OSError as exc:
                out.write(f"kubelet: cannot start {argv!r}: {exc}\n".encode())
                c.exit_code, c.finished_at = 128, now()
                pod.failure = pod.failure or f"container {name} could not start: {exc}"
                return
        c.started_at, c.ready = now(), False
        pod.start_time = pod.start_time or c.started_at

    def _probe(self, pod: Pod, c: Container) -> bool:
        probe = (c.spec.get("readinessProbe") or {}).get("httpGet")
        if probe is None:
            return not (c.spec.get("readinessProbe") or {})  # exec/tcp probes: never ready (not emulated)
        port = probe.get("port")
        if isinstance(port, str) and not port.isdigit():
            port = next((p["containerPort"] for p in c.spec.get("ports", []) if p.get("name") == port), port)
        host = probe.get("host") or pod.ip
        url = f"{probe.get('scheme', 'HTTP').lower()}://{host}:{port}{probe.get('path', '/')}"
        timeout = float((c.spec.get("readinessProbe") or {}).get("timeoutSeconds", 1))
        try:
            return 200 <= httpx.get(url, timeout=timeout).status_code < 400
        except httpx.HTTPError:
            return False

    def _write_status(self, pod: Pod) -> None:
        status = pod_status(pod, self.node_name)
        if status == pod.written:
            return
        r = self.api.patch(
            f"/api/v1/namespaces/{self.namespace}/pods/{pod.name}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if r.status_code == 200:
            pod.written = status

    def _terminate_pod(self, pod: Pod, obj: dict[str, Any] | None) -> None:
        """SIGTERM, the grace period (capped), SIGKILL; then delete the object for real (in a thread)."""
        pod.terminating = True
        grace = 30.0
        if obj is not None:
            grace = obj["metadata"].get(
                "deletionGracePeriodSeconds", obj["spec"].get("terminationGracePeriodSeconds", 30)
            )
        procs = [c.proc for c in pod.containers.values() if c.proc is not None]

        def reap() -> None:
            _terminate(procs, min(float(grace), self.max_grace))
            if obj is not None:
                with contextlib.suppress(httpx.HTTPError):
                    self.api.delete(
                        f"/api/v1/namespaces/{self.namespace}/pods/{pod.name}",
                        params={"gracePeriodSeconds": 0},
                    )

        thread = threading.Thread(target=reap, name=f"kubelet-stop-{pod.name}", daemon=True)
        self._reapers.append(thread)
        thread.start()


def _terminate(procs: list[subprocess.Popen[bytes]], grace: float, kill: bool = True) -> None:
    """SIGTERM each process group (and SIGCONT, should it be paused); SIGKILL what outlives `grace`."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        _signal_group(proc, signal.SIGTERM)
        _signal_group(proc, signal.SIGCONT)
    if not kill:
        return
    deadline = time.monotonic() + grace
    for proc in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        _signal_group(proc, signal.SIGKILL)  # whatever it left behind in its group


@atexit.register
def _stop_all() -> None:
    for kubelet in list(_LIVE):
        with contextlib.suppress(Exception):
            kubelet.stop()
