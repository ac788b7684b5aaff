"""Job mode: the pod's shard of the prompts (``prompts[pod_index::pods]``), ``samples_per_prompt`` each, sent
over the engine's ``/generate`` with at most ``max_in_flight`` at once, every finished sample written once.

Samples go out prompt by prompt, a prompt's samples together (a GRPO group): they share the prompt's KV
pages on one replica while they run (the engine prefills the prompts of an admission ahead of their later
samples).

Each sample is one request with a stable id (``rid``) and its own seed (:func:`sample_seed`), so a sample
sent again (after an abort, an engine restart or a sidecar restart) draws the same tokens. What is in the
output file already is not sent again. A sample the engine aborted (it is stopping, or someone aborted it)
is not written: it is sent again once the engine is healthy. A sample the engine refuses as invalid (a
prompt too long for its context, ...) ends the job with that error: the file can never be complete.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollout_worker.api.sampling import sample_seed
from rollout_worker.api.sglang import GenerateRequest, SamplingParams
from rollout_worker.api.sidecar import SAMPLE_FIELDS, NotSubmitted, Sample
from rollout_worker.data.prompts import ChatTemplate, Prompt, load_prompts
from rollout_worker.data.reward import reward_of
from rollout_worker.errors import UserError
from rollout_worker.sidecar.engine_client import EngineAnswer, EngineClient, EngineUnreachable
from rollout_worker.sidecar.metrics import SidecarMetrics
from rollout_worker.sidecar.outputs import SampleWriter
from rollout_worker.sidecar.settings import SidecarFields
from rollout_worker.sidecar.watch import EngineWatch

log = logging.getLogger(__name__)
Item = tuple[Prompt, int]


def shard(settings: SidecarFields) -> list[Prompt]:
    """This pod's prompts; pass-through fields named like a sample's own fields are refused."""
    assert settings.prompts_path is not None
    template = ChatTemplate.of_model(settings.model_dir) if settings.model_dir is not None else None
    try:
        prompts = load_prompts(settings.prompts_path, settings.prompts_limit, template)
    except UserError as exc:  # the loader names the job manifest's field; here it is `prompts_path`
        raise (exc.with_field("prompts_path") if exc.field else exc) from None
    mine = prompts[settings.pod_index :: settings.pods]
    for p in mine:
        clash = sorted(SAMPLE_FIELDS & set(p.extra))
        if clash:
            raise UserError(
                f"prompt {p.id!r}: pass-through field {clash[0]!r} is a sample field's name", "prompts_path"
            )
    return mine


LOGPROB_DIGITS = 8


def _digits(logprob: float | None) -> float | None:
    """A logprob to 8 significant digits (beyond float32's precision). The engine's float64 values differ
    in their last bits with the batch a request ran in; rounded, a rerun or a resumed run writes the same
    bytes."""
    return None if logprob is None else float(f"{logprob:.{LOGPROB_DIGITS}g}")


def rid_of(prompt_id: str, sample: int) -> str:
    return f"{prompt_id}#{sample}"


class Job:
    def __init__(
        self,
        settings: SidecarFields,
        prompts: list[Prompt],
        writer: SampleWriter,
        client: EngineClient,
        watch: EngineWatch,
        metrics: SidecarMetrics,
    ) -> None:
        self.s, self.writer, self.client, self.watch, self.metrics = settings, writer, client, watch, metrics
        self.sampling = settings.sampling
        self.total = len(prompts) * settings.samples_per_prompt
        self._check_file(prompts)
        self.queue: deque[Item] = deque(  # prompt by prompt: see the module's docstring
            (p, i)
            for p in prompts
            for i in range(settings.samples_per_prompt)
            if (p.id, i) not in writer.done
        )
        self.unsent: dict[str, int] = {}  # prompt id -> samples neither written nor in flight
        for p, _ in self.queue:
            self.unsent[p.id] = self.unsent.get(p.id, 0) + 1
        self.in_flight = 0
        self.finished = asyncio.Event()
        self._disk = ThreadPoolExecutor(1, "sample-writer")  # one write at a time, off the event loop

    def _check_file(self, prompts: list[Prompt]) -> None:
        """The output file holds samples of this job only, drawn with this job's seeds."""
        ids = {p.id for p in prompts}
        for rec in self.writer.records:
            pid, i = rec.prompt_id, rec.sample
            if pid not in ids or i >= self.s.samples_per_prompt:
                raise UserError(
                    f"{self.writer.path} holds sample {i} of prompt {pid!r}, which is not in this pod's "
                    "shard (did prompts, pods or samples_per_prompt change?); use another output_dir",
                    "output_dir",
                )
            if rec.sampling_seed != sample_seed(self.s.seed, pid, i):
                raise UserError(
                    f"{self.writer.path}: sample {i} of prompt {pid!r} was drawn with another seed; use "
                    "another output_dir",
                    "seed",
                )

    @property
    def done(self) -> int:
        return len(self.writer.done)

    def not_submitted(self) -> NotSubmitted:
        """Samples neither written nor in flight (queued, or waiting to be sent again)."""
        return NotSubmitted(
            samples=sum(self.unsent.values()),
            prompts=sum(1 for v in self.unsent.values() if v),
            max_new_tokens=self.s.max_new_tokens,
        )

    async def run(self) -> None:
        """Until every sample is written; a refused sample raises UserError."""
        if self.queue:
            log.info(
                "job: %d of %d sample(s) to generate (%d in %s already)",
                len(self.queue),
                self.total,
                self.done,
                self.writer.path,
            )
            workers = [
                asyncio.create_task(self._worker()) for _ in range(min(self.s.max_in_flight, len(self.queue)))
            ]
            try:
                await asyncio.gather(*workers)
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        self.finished.set()
        log.info("job done: all %d sample(s) written to %s", self.total, self.writer.path)

    async def _worker(self) -> None:
        while self.queue:
            await self._one(*self.queue.popleft())

    async def _one(self, prompt: Prompt, sample: int) -> None:
        params = self.sampling.sampling_params(prompt.id, sample, prompt.max_new_tokens)
        given: dict[str, Any] = (
            {"text": prompt.text} if prompt.text is not None else {"input_ids": prompt.input_ids}
        )
        body = GenerateRequest(
            **given,
            rid=rid_of(prompt.id, sample),
            sampling_params=params,
            return_logprob=True,
        )
        while True:
            await self.watch.wait_healthy()
            self.unsent[prompt.id] -= 1
            self.in_flight += 1
            try:
                out = await self.client.generate(body)
            except EngineUnreachable as exc:
                self.watch.lost(f"unreachable ({exc})")
                why = "unreachable"
            except EngineAnswer as exc:
                why = self._transient(exc, prompt, sample)
            else:
                finish = out.get("meta_info", {}).get("finish_reason") or {}
                if finish.get("type") != "abort":
                    await self._write(self._record(prompt, sample, params, out))
                    return
                why = "aborted"
            finally:
                self.in_flight -= 1
            self.unsent[prompt.id] += 1
            self.metrics.retries.labels(why).inc()
            await asyncio.sleep(self.s.retry_seconds)

    def _transient(self, exc: EngineAnswer, prompt: Prompt, sample: int) -> str:
        """Why sending again may work (the engine is starting, stopping or still ending an earlier send of
        the same sample); raises UserError when it cannot."""
        if exc.status in (429, 502, 503, 504):
            return "unavailable"
        if exc.status == 400 and exc.field == "rid":  # the same rid still in flight (a restarted sidecar)
            return "in_flight"
        what = f"sample {sample} of prompt {prompt.id!r}"
        raise UserError(f"{what}: the engine refused it: {exc}", "prompts_path")

    @staticmethod
    def _record(prompt: Prompt, sample: int, params: SamplingParams, out: dict[str, Any]) -> Sample:
        meta = out["meta_info"]
        assert params.sampling_seed is not None  # every sample has its own seed
        return Sample(
            prompt_id=prompt.id,
            sample=sample,
            prompt=prompt.text if prompt.text is not None else prompt.input_ids,
            output_text=out["text"],
            output_ids=out["output_ids"],
            output_logprobs=[_digits(t[0]) for t in meta.get("output_token_logprobs") or []],
            finish_reason=meta["finish_reason"],
            prompt_tokens=meta["prompt_tokens"],
            completion_tokens=meta["completion_tokens"],
            layouts=meta.get("layouts", []),
            weight_version=meta.get("weight_version", "default"),
            sampling_seed=params.sampling_seed,
            reward=reward_of(prompt.extra, out["text"]),
            **prompt.extra,
        )

    async def _write(self, sample: Sample) -> None:
        await asyncio.get_running_loop().run_in_executor(self._disk, self.writer.write, sample)
        self.metrics.written.inc()
        self.metrics.completion_tokens.inc(sample.completion_tokens)

    def close(self) -> None:
        """After the workers stopped: let a write under way finish (a cancelled worker's write still lands,
        once), then close the file."""
        self._disk.shutdown(wait=True)
        self.writer.close()
