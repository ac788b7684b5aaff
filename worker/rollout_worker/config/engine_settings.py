"""The engine's settings: one pydantic model, the one home of every engine tunable.

Every other surface is derived from it by rule, never written out again (``tests/operator/
test_engine_settings.py`` walks every field through every surface and fails on a missing or renamed one):

- the flag of ``rolloutctl serve`` and ``rolloutctl generate``: ``--`` and the name with dashes
  (``max_batch`` -> ``--max-batch``; a bool is ``--cuda-graphs`` / ``--no-cuda-graphs``);
- the environment variable of ``rolloutctl serve``: ``ROLLOUT_SERVE_`` and the name upper-cased
  (a flag beats its variable, which beats the default);
- the RolloutJob's ``spec.engine.<camelCase name>`` (the job spec's ``EngineSpec`` is this model with
  camelCase names, and the CRD's schema is generated from it);
- a pod's engine arguments (:func:`settings_args`): the flags again;
- ``EngineConfig.engine``, which the ranks read;
- the options of the commands that take a setting otherwise (``rolloutctl simulate``, ``bench simulator``,
  ``bench memory``, ``bench engine``, ``profile``) and the simulator's ``SimConfig``: their defaults and help
  from the field (a command's other default is written once, in ``cli/engine_opts.DEFAULT_OVERRIDES``), their
  bounds and choices checked by :func:`check_setting`, which reads the field's.

The checkpoint's dtype is not an engine tunable (it is ``spec.model.dtype`` and ``--dtype``); its one list
of values is :data:`DTYPES` here.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout_worker.errors import UserError, user_error
from rollout_worker.scheduling.pages import pool_pages

Dtype = Literal["float32", "float64", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)  # the one list of dtypes
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}  # bytes per element
Device = Literal["cpu", "cuda"]
DEVICES: tuple[str, ...] = get_args(Device)
PackedWeights = Literal["auto", "on", "off"]
SpeculativeAlgorithm = Literal["none", "ngram"]
SpeculativePolicy = Literal["auto", "always"]
ENV_PREFIX = "ROLLOUT_SERVE_"  # `rolloutctl serve`'s variables


class EngineSettings(BaseModel):
    """Tunables of the engine (not its model, ranks or layouts, which a job's shape decides)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Device = Field(
        "cpu", description="cpu, or cuda (a GPU per rank; more ranks than GPUs share them over gloo)."
    )
    max_batch: int = Field(64, ge=1, le=4096, description="Running requests per replica.")
    kv_budget_tokens: int | None = Field(
        None,
        ge=2,
        description="KV pool of a replica in tokens, rounded up to whole pages (none: room for max_batch "
        "requests of context_length tokens).",
    )
    page_size: int = Field(1, ge=1, le=16, description="Tokens per page of the KV pool.")
    prefix_cache: bool = Field(
        True,
        description="Requests with equal prompt prefixes share their KV pages, computed once (SGLang's "
        "radix cache; --no-prefix-cache is its --disable-radix-cache).",
    )
    max_prefill_tokens: int = Field(
        8192, ge=1, description="Tokens prefilled in one step (a longer prompt is prefilled alone)."
    )
    context_length: int = Field(
        0, ge=0, description="Max prompt + output tokens (0: the model's max_position_embeddings)."
    )
    deterministic: bool = Field(
        False,
        description="Batch- and TP-invariant kernels: a request's tokens and logprobs are bitwise the same "
        "whatever its batch, layout, reconfigurations, retractions and cache hits, in float32 too (SGLang's "
        "--enable-deterministic-inference).",
    )
    packed_weights: PackedWeights = Field(
        "auto",
        description="float32 on CPU: multiply by a copy of each weight packed once for the CPU's kernel "
        "(faster products; the copy doubles the weights' memory). on | off | auto: on while two copies of "
        "the whole model for every rank fit in half the machine's (or container's) memory.",
    )
    collective_timeout_seconds: float = Field(
        120.0, gt=0, description="Timeout of every collective; a rank that waits longer fails the engine."
    )
    paged_attention: bool = Field(
        True,
        description="A decode step reads its keys and values in place from the KV pool's pages (a Triton "
        "kernel) where it would gather them into a dense buffer first: on CUDA with the default kernels in "
        "float32, bfloat16 or float16 (float64 and the deterministic kernels gather); on CPU only under "
        "Triton's interpreter (TRITON_INTERPRET=1, as the tests run it).",
    )
    speculative_algorithm: SpeculativeAlgorithm = Field(
        "none",
        description="none | ngram: decode steps verify tokens drafted from the request's own tokens, its "
        "sibling samples and earlier responses (no draft model), and emit exactly the tokens decoding "
        "without speculation emits (each position drawn with its own counter; bit for bit with float64 "
        "or the deterministic kernels). SGLang's --speculative-algorithm.",
    )
    speculative_num_draft_tokens: int = Field(
        4, ge=1, le=16, description="Tokens drafted per request and verify step, at most (SGLang's name)."
    )
    speculative_policy: SpeculativePolicy = Field(
        "auto",
        description="auto | always: with speculation on, verify a step's drafts only where the expected "
        "tokens per unit of step time beat plain decoding (from the replica's measured step times and each "
        "request's acceptance so far: off in a compute-bound bulk phase or where drafts miss), or always.",
    )
    cuda_graphs: bool = Field(
        True,
        description="cuda: replay decode steps from CUDA graphs (TP=1 replicas; TP>1 replicas stay "
        "eager); a replayed step equals the eager step bit for bit. On by default, as in SGLang; no effect "
        "on CPU.",
    )

    @property
    def pool_pages(self) -> int:
        """Pages of one replica's KV pool (context_length as resolved by the engine's config)."""
        return pool_pages(self.kv_budget_tokens, self.page_size, self.max_batch, self.context_length)

    @property
    def pool_tokens(self) -> int:
        """Tokens of one replica's KV pool (SGLang's ``max_total_num_tokens``)."""
        return self.pool_pages * self.page_size


FIELDS: tuple[str, ...] = tuple(EngineSettings.model_fields)
DEFAULTS = EngineSettings()


def dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(map(str, path))


def flag_of(name: str) -> str:
    """The CLI flag of a setting: ``max_batch`` -> ``--max-batch``."""
    return "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    """``rolloutctl serve``'s variable for a setting: ``max_batch`` -> ``ROLLOUT_SERVE_MAX_BATCH``."""
    return ENV_PREFIX + name.upper()


def settings_args(settings: EngineSettings) -> list[str]:
    """The flags that give ``settings`` to ``rolloutctl serve`` (every field that has a value)."""
    args: list[str] = []
    for name in FIELDS:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(flag_of(name) if value else "--no-" + name.replace("_", "-"))
        else:
            args += [flag_of(name), str(value)]
    return args


def parse_settings(values: dict[str, Any]) -> EngineSettings:
    """Validated settings; the first problem becomes a :class:`UserError` naming its field."""
    try:
        return EngineSettings(**values)
    except ValidationError as exc:
        raise user_error(exc, dotted) from None


def bounds(name: str) -> tuple[Any, Any]:
    """The lowest and highest value of a setting (``ge``, ``le``; None: unbounded), as its field says."""
    lo = hi = None
    for rule in EngineSettings.model_fields[name].metadata:
        lo, hi = getattr(rule, "ge", lo), getattr(rule, "le", hi)
    return lo, hi


def check_setting(name: str, value: Any, field: str | None = None) -> None:
    """Refuse a value of setting ``name`` outside its field's choices or bounds: a :class:`UserError` naming
    ``field`` (default: the setting), for the surfaces that take a setting without the whole model."""
    field = field or name
    info = EngineSettings.model_fields[name]
    if get_origin(info.annotation) is Literal and value not in get_args(info.annotation):
        raise UserError(f"must be one of {', '.join(get_args(info.annotation))}, got {value!r}", field)
    if value is None:
        return
    for gt in (rule.gt for rule in info.metadata if getattr(rule, "gt", None) is not None):
        if not value > gt:
            raise UserError(f"must be > {gt}, got {value}", field)
    lo, hi = bounds(name)
    if (lo is None or value >= lo) and (hi is None or value <= hi):
        return
    if lo is not None and hi is not None:
        rule = f"{lo}..{hi}"
    else:
        rule = f">= {lo}" if lo is not None else f"<= {hi}"
    raise UserError(f"must be {rule}, got {value}", field)
