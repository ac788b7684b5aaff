"""How the engine draws a request's tokens (torch-free). The sampler is
``rollout_worker.engine.rank.sampling``.

Three names, one meaning each: :class:`Sampling` is what the engine's ranks draw with;
``rollout_worker.api.sglang.SamplingParams`` is the ``sampling_params`` of SGLang's ``/generate`` (its
``engine`` method gives the :class:`Sampling`); ``rollout_worker.api.sidecar.SamplingSettings`` is a job's
sampling (its ``sampling_params`` method gives one sample's SGLang ``sampling_params``).

Sampling is counter-based: the token at absolute position ``p`` of a sequence (prompt length + output index)
is drawn with ``u = H(seed, p)``, so a request's tokens depend only on the request, never on the replica, TP
size, batch or arrival time; and a continuation (prompt + partial output, the same seed) draws exactly the
tokens the uninterrupted request would have.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below it samples greedily (as top_k 1)


@dataclass(frozen=True, slots=True)
class Sampling:
    """One request's sampling as the engine's ranks run it (``top_k`` <= 0: off)."""

    temperature: float = 0.0  # below GREEDY_BELOW (0 included): greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # <= 0: off
    min_p: float = 0.0  # in [0, 1]; 0: off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        """Greedy: top_k 1, or a temperature below SGLang's epsilon (dividing logits by 5e-324 overflows)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def default_seed(rid: str) -> int:
    """The seed of a request that names none: a hash of its id (reruns of the same id reproduce it)."""
    return int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "little") >> 1


def derived_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th of ``n`` samples of one request (``n`` > 1): distinct and reproducible."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little") >> 1


def sample_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The seed of sample ``sample`` of prompt ``prompt_id`` in a job seeded ``seed``: reruns and resumed
    runs draw exactly the same tokens."""
    key = f"{seed}\x00{prompt_id}\x00{sample}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
