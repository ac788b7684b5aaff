"""Why a request finished, typed, and the only place a finish reason is built.

SGLang's three kinds: ``stop`` (the EOS token, a stop token id or a stop string; ``matched`` names it),
``length`` (``max_new_tokens`` reached; ``length``) and ``abort`` (``message`` says why). They travel from
the ranks to the driver as these objects; :func:`finish_json` is the one place they become the dict users
see as ``meta_info.finish_reason`` (and in ``rolloutctl generate``'s rows), in SGLang's shape:
``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": N}``,
``{"type": "abort", "message": ...}``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal


@dataclass(frozen=True, slots=True)
class FinishStop:
    """The EOS token or a stop token (its id) or a stop string (the string) ended the output."""

    matched: int | str
    type: ClassVar[Literal["stop"]] = "stop"


@dataclass(frozen=True, slots=True)
class FinishLength:
    """``max_new_tokens`` (``length``) tokens were generated."""

    length: int
    type: ClassVar[Literal["length"]] = "length"


@dataclass(frozen=True, slots=True)
class FinishAbort:
    """Ended early (a client, a pause, a shutdown, a failure); ``message`` says why."""

    message: str
    type: ClassVar[Literal["abort"]] = "abort"


Finish = FinishStop | FinishLength | FinishAbort
PAUSE_ABORT = FinishAbort("aborted by pause_generation")  # the driver's and the ranks' (same reason)


def finish_json(finish: Finish | None) -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` dict (None while the request runs)."""
    return None if finish is None else {"type": finish.type, **asdict(finish)}


def matched_stop(finish: Finish | None) -> int | str | None:
    """The stop token id or stop string that ended the output, if one did."""
    return finish.matched if isinstance(finish, FinishStop) else None
