"""``POST /generate`` (and PUT): SGLang's native generation endpoint, single or batch, streaming or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from rollout_worker.api.errors import UserError
from rollout_worker.api.sglang import GenerateRequest
from rollout_worker.server.convert import Job, Output, to_jobs
from rollout_worker.server.deps import FastJSON, ServerState, server_state

router = APIRouter(tags=["sglang"])
# a route's answer is JSON, or server-sent events with ``stream``
STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}


class Generation:
    """The jobs of one HTTP request, submitted together and followed to the end."""

    def __init__(self, state: ServerState, jobs: list[Job]) -> None:
        self.state, self.jobs = state, jobs
        engine = state.ready_engine()
        for job in jobs:  # all or nothing: validate every job before submitting any
            engine.check(job.spec)
        version = engine.weight_version
        self.outs = {j.spec.id: Output(j, state.codec, version) for j in jobs}
        self.index = {j.spec.id: i for i, j in enumerate(jobs)}
        self.queue: Any = None
        self.finished = False

    def start(self) -> None:
        """Submit every job (after validation passed); on a refusal, abort the ones already submitted."""
        engine = self.state.ready_engine()
        self.queue = self.state.bridge.open(list(self.outs))
        try:
            for job in self.jobs:
                engine.submit(job.spec, job.stop)
                self.state.metrics.submitted(len(job.spec.prompt_ids))
        except UserError:
            self.close()
            raise

    def close(self) -> None:
        self.state.bridge.close(list(self.outs), abort=not self.finished)

    async def updates(self) -> AsyncIterator[tuple[str, Output]]:
        """(rid, output) for every request that changed, once per batch of waiting updates."""
        async for batch in self.state.bridge.batches(self.queue, list(self.outs)):
            changed: dict[str, Output] = {}
            for u in batch:
                out = self.outs[u.rid]
                if u.tokens:  # the weights of its latest tokens (an update while paused changes them)
                    out.weight_version = self.state.ready_engine().weight_version
                out.add(u)
                if u.tokens or u.finish is not None:
                    changed[u.rid] = out
            for rid, out in changed.items():
                yield rid, out
        self.finished = True


async def run_generation(state: ServerState, jobs: list[Job], request: Request) -> list[Output]:
    """Run to the end (non-streaming), aborting every job if the client goes away first."""
    gen = Generation(state, jobs)
    gen.start()

    async def consume() -> None:
        async for _ in gen.updates():
            pass

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                break
        await asyncio.gather(task, return_exceptions=True)
    finally:
        gen.close()
    return list(gen.outs.values())


# Line breaks that JSON leaves unescaped but line splitters such as Python's ``str.splitlines`` (and so
# httpx's ``iter_lines``) break on: escaped, so every client reads one event per ``data:`` line.
_RAW_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON on a single line, whatever its strings hold."""
    data = orjson.dumps(obj)
    for raw, escaped in _RAW_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


async def stream_generation(
    state: ServerState,
    jobs: list[Job],
    batch: bool,
    render: Callable[[str, Output], dict[str, Any] | None] | None = None,
    final: Callable[[list[Output]], dict[str, Any] | None] | None = None,
) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per new token (SGLang: cumulative), an optional ``final`` chunk, then
    ``data: [DONE]``."""
    gen = Generation(state, jobs)

    async def events() -> AsyncIterator[bytes]:
        try:
            try:
                gen.start()
            except UserError as exc:  # the response has started: SGLang reports errors in the stream
                yield sse_event({"error": {"message": str(exc), "field": exc.field}})
                yield b"data: [DONE]\n\n"
                return
            async for rid, out in gen.updates():
                chunk = out.render() if render is None else render(rid, out)
                if chunk is None:
                    continue
                if batch:
                    chunk["index"] = gen.index[rid]
                yield sse_event(chunk)
            last = final(list(gen.outs.values())) if final is not None else None
            if last is not None:
                yield sse_event(last)
            yield b"data: [DONE]\n\n"
        finally:  # also when the client disconnects: the generator is closed, the requests aborted
            gen.close()

    return events()


@router.api_route(
    "/generate", methods=["POST", "PUT"], summary="Generate (SGLang native)", responses=STREAMED
)
async def generate(body: GenerateRequest, request: Request) -> Any:
    state = server_state(request)
    jobs = to_jobs(body, state.codec)
    batch = body.is_batch or len(jobs) > 1
    if body.stream:
        events = await stream_generation(state, jobs, batch)
        return StreamingResponse(events, media_type="text/event-stream")
    outs = await run_generation(state, jobs, request)
    rendered = [o.render() for o in outs]
    return FastJSON(rendered if batch else rendered[0])
