"""The driver's memory verbs: every rank releases or takes again the memory of some tags (the KV cache, the
weights), or empties its prefix cache; each a command every rank answers, run under the driver's global
lock, and refused while requests are in flight (a release, a flush)."""

from __future__ import annotations

from rollout_worker.api.sglang import MEMORY_TAGS
from rollout_worker.engine import messages as m
from rollout_worker.engine.driver.shared import Shared
from rollout_worker.errors import UserError


def release_or_resume(
    shared: Shared, kind: type[m.ReleaseMemory] | type[m.ResumeMemory], tags: tuple[str, ...]
) -> None:
    """Every rank releases (or resumes) the memory of ``tags``; returns once every rank has. New requests
    are refused from the moment a release goes out until a resume of its tags returns."""
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise UserError(f"unknown tag {bad[0]!r}; choose from {', '.join(MEMORY_TAGS)}", "tags")
    release = kind is m.ReleaseMemory

    def sent(cmd: m.Command) -> None:  # new requests are refused from the moment a release goes out
        if release:
            shared.flags.released |= set(tags)

    with shared.one_at_a_time:
        shared.on_every_rank(lambda ticket: kind(tags, ticket), "tags" if release else None, sent)
        if not release:
            with shared.lock:
                shared.flags.released -= set(tags)


def flush_cache(shared: Shared) -> None:
    """Every replica empties its prefix cache (refused while requests are in flight)."""
    with shared.one_at_a_time:
        shared.on_every_rank(m.FlushCache, None)
