"""What the sidecar's routes read: the settings, the engine watch, the job (job mode) and the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollout_worker.api.sidecar import NotSubmitted, Progress, SamplesPage, SidecarState
from rollout_worker.api.state import EngineState
from rollout_worker.data.files import check_writable
from rollout_worker.errors import UserError
from rollout_worker.sidecar.engine_client import EngineClient
from rollout_worker.sidecar.job_mode import Job, shard
from rollout_worker.sidecar.metrics import SidecarMetrics
from rollout_worker.sidecar.outputs import SampleWriter
from rollout_worker.sidecar.settings import SidecarFields
from rollout_worker.sidecar.watch import EngineWatch


class NotFound(UserError):
    status = 404


@dataclass
class Sidecar:
    settings: SidecarFields
    token: str
    client: EngineClient
    watch: EngineWatch
    metrics: SidecarMetrics
    job: Job | None = None
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def create(cls, s: SidecarFields) -> Sidecar:
        """Everything that can be wrong with the settings, the prompts or the output file is found here,
        before a port is bound or the engine called."""
        token = s.bearer_token()
        prompts = shard(s) if s.mode == "job" else []
        if s.output_file is not None:
            check_writable(s.output_file, "output_dir")
        client = EngineClient(s.engine_url, s.engine_secret(), s.max_in_flight)
        watch = EngineWatch(client, s.poll_seconds, s.engine_wait_seconds, s.engine_timeout_seconds)
        side = cls(s, token, client, watch, SidecarMetrics())
        if s.mode == "job":
            assert s.output_file is not None
            side.job = Job(s, prompts, SampleWriter(s.output_file), client, watch, side.metrics)
        side.metrics.gauges(side._gauges)
        return side

    async def close(self) -> None:
        if self.job is not None:
            self.job.close()
        await self.client.close()

    def _requests(self) -> tuple[int, int]:
        st = self.watch.state
        if st is None:
            return 0, 0
        running = sum(len(r.running) for r in st.replicas)
        return running, sum(len(r.waiting) for r in st.replicas) + len(st.queued)

    def progress(self) -> Progress:
        st, job, watch = self.watch.state, self.job, self.watch
        running, waiting = self._requests()
        if job is not None:
            done, total, flight, unsent = job.done, job.total, job.in_flight, job.not_submitted().samples
        else:
            done, total, flight, unsent = (st.finished.total if st else 0), None, 0, 0
        return Progress(
            mode=self.settings.mode,
            pod_index=self.settings.pod_index,
            pods=self.settings.pods,
            samples_done=done,
            samples_total=total,
            in_flight=flight,
            not_submitted=unsent,
            running=running,
            waiting=waiting,
            layout=str(st.layout) if st else None,
            tokens_per_s=round(watch.tokens_per_s, 3),
            reconfigurations=st.reconfigurations if st else 0,
            weight_version=st.weight_version if st else None,
            engine_ready=watch.ready,
            snapshot_age_s=round(time.monotonic() - watch.state_at, 3) if watch.state_at else None,
            elapsed_s=round(time.monotonic() - self.started, 3),
            done=job is not None and job.finished.is_set(),
            output_file=str(self.settings.output_file) if job is not None else None,
        )

    async def state(self, since_step: int) -> SidecarState:
        raw = await self.client.state(since_step)
        unsent = self.job.not_submitted() if self.job is not None else NotSubmitted()
        return SidecarState(
            mode=self.settings.mode, engine=EngineState.model_validate(raw), not_submitted=unsent
        )

    def samples(self, after: int, limit: int) -> SamplesPage:
        if self.job is None:
            raise NotFound(
                "no samples in service mode: each goes to the client that sent its request", "after"
            )
        records = self.job.writer.records
        page = records[after : after + limit]
        return SamplesPage(
            samples=page,
            next=after + len(page),
            total_written=len(records),
            done=self.job.finished.is_set() and after + len(page) >= len(records),
        )

    def _gauges(self) -> dict[str, tuple[str, float]]:
        p = self.progress()
        return {
            "samples_done": (
                "Samples of the shard written (service mode: requests the engine finished)",
                p.samples_done,
            ),
            "samples_total": (
                "Samples of the shard (prompts x samples per prompt; 0 in service mode)",
                p.samples_total or 0,
            ),
            "in_flight": ("Samples sent to the engine and not back yet", p.in_flight),
            "not_submitted": ("Samples not sent yet", p.not_submitted),
            "done": ("1 once every sample of the shard is written", float(p.done)),
            "engine_ready": ("1 while the engine answers and is healthy", float(p.engine_ready)),
            "engine_running": ("Requests the engine is decoding", p.running),
            "engine_waiting": ("Requests the engine holds but does not run yet", p.waiting),
        }
