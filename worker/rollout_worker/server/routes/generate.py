"""``POST /generate`` (and PUT): SGLang's native generation endpoint, single or batch, streaming or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from rollout_worker.api.sglang import GenerateRequest
from rollout_worker.engine.driver.request_table import Update
from rollout_worker.server.convert import Job, Output, check_jobs, to_jobs
from rollout_worker.server.deps import FastJSON, ServerState, server_state

router = APIRouter(tags=["sglang"])
# a route's answer is JSON, or server-sent events with ``stream``
STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}
TURN_S = 0.005  # the longest a request's updates keep the event loop from other requests


class Generation:
    """The jobs of one HTTP request, submitted together and followed to the end."""

    def __init__(self, state: ServerState, jobs: list[Job], queue: asyncio.Queue[Update]) -> None:
        self.state, self.jobs, self.queue = state, jobs, queue
        version = state.ready_engine().weight_version
        self.outs = {j.spec.id: Output(j, state.codec, version) for j in jobs}
        self.index = {j.spec.id: i for i, j in enumerate(jobs)}

    @classmethod
    async def start(cls, state: ServerState, jobs: list[Job]) -> Generation:
        """Hold the jobs' ids and submit them all, or none: a refusal (an id another request holds, a job
        the engine refuses) touches no other request and leaves nothing behind. A large batch is prepared
        and submitted in a worker thread, not on the event loop."""
        rids = [j.spec.id for j in jobs]
        queue = state.bridge.open(rids)
        submitting = asyncio.ensure_future(state.bridge.work(len(jobs), cls._submitted, state, jobs, queue))
        try:
            gen = await asyncio.shield(submitting)
        except asyncio.CancelledError:  # it goes on: once it is done, abort what it submitted
            submitting.add_done_callback(lambda done: state.bridge.close(queue, rids, _accepted(done)))
            raise
        except BaseException:  # none was accepted
            state.bridge.close(queue, rids, abort=False)
            raise
        state.metrics.submitted(sum(len(j.spec.prompt_ids) for j in jobs))
        return gen

    @classmethod
    def _submitted(cls, state: ServerState, jobs: list[Job], queue: asyncio.Queue[Update]) -> Generation:
        gen = cls(state, jobs, queue)
        engine = state.ready_engine()
        check_jobs(engine.check, jobs)  # an error names the prompt of a batch it is about
        engine.submit_all([(j.spec, j.stop) for j in jobs], checked=True)
        return gen

    def close(self) -> None:
        """Forget the queue; abort the requests that have not finished (the client went away)."""
        self.state.bridge.close(self.queue, list(self.outs))

    async def updates(self) -> AsyncIterator[tuple[str, Output]]:
        """(rid, output) for every request that changed, once per batch of waiting updates. The consumer's
        work on them (rendering chunks) leaves the event loop to others every :data:`TURN_S` seconds."""
        turn = time.perf_counter()
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
                if time.perf_counter() - turn > TURN_S:  # (a batch of a thousand requests is long work)
                    await asyncio.sleep(0)
                    turn = time.perf_counter()


def _accepted(submitted: asyncio.Future[Generation]) -> bool:
    return not submitted.cancelled() and submitted.exception() is None


async def run_generation(state: ServerState, jobs: list[Job], request: Request) -> list[Output]:
    """Run to the end (non-streaming), aborting every job if the client goes away first."""
    gen = await Generation.start(state, jobs)

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


class EngineStream(StreamingResponse):
    """Server-sent events of requests the engine runs, closed (aborted unless finished) however the response
    ends: its events all sent, the client gone mid-stream, or gone before the first event (then the events
    never started, and nothing else would abort the requests)."""

    def __init__(self, events: AsyncIterator[bytes], gen: Generation) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


async def stream_generation(
    state: ServerState,
    jobs: list[Job],
    batch: bool,
    render: Callable[[str, Output], dict[str, Any] | None] | None = None,
    final: Callable[[list[Output]], dict[str, Any] | None] | None = None,
) -> EngineStream:
    """Server-sent events: one chunk per new token (SGLang: cumulative), an optional ``final`` chunk, then
    ``data: [DONE]``."""
    gen = await Generation.start(state, jobs)  # a refusal is the route's error, before the stream starts

    async def events() -> AsyncIterator[bytes]:
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

    return EngineStream(events(), gen)  # (it closes the generation, the client gone or not)


@router.api_route(
    "/generate", methods=["POST", "PUT"], summary="Generate (SGLang native)", responses=STREAMED
)
async def generate(body: GenerateRequest, request: Request) -> Any:
    state = server_state(request)
    jobs = await state.bridge.work(body.requests, to_jobs, body, state.codec)
    batch = body.is_batch or len(jobs) > 1
    if body.stream:
        return await stream_generation(state, jobs, batch)
    outs = await run_generation(state, jobs, request)
    return await state.bridge.work(len(outs), _answer, outs, batch)


def _answer(outs: list[Output], batch: bool) -> FastJSON:
    """The whole answer, rendered: text and logprobs of every job."""
    rendered = [o.render() for o in outs]
    return FastJSON(rendered if batch else rendered[0])
