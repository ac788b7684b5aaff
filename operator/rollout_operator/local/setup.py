"""Before a local run starts any process: the model (made from its preset on first use), the candidate
layouts, the profile, the prompts and the initial layout. Each error names the manifest's field and line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import PlannerPolicy, PodSnapshot, ReplicaState, choose_start
from rollout_profiler.planning.predictor import fit
from rollout_profiler.profile import ModelShape, Profile
from rollout_worker.api.errors import UserError
from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig
from rollout_worker.api.prompts import RANDOM_MODEL_TOKENIZER_CONFIG, ChatTemplate, Prompt, load_prompts

from rollout_operator.api.manifest import LoadedJob

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
    template = ChatTemplate.of_model(spec.model.path)
    if template is None and spec.model.preset and not (Path(spec.model.path) / "config.json").exists():
        template = ChatTemplate.of_config(RANDOM_MODEL_TOKENIZER_CONFIG)  # the one the preset's model gets
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
    from rollout_worker.engine.presets import PRESETS, preset_config

    if spec.preset not in PRESETS:
        raise loaded.error(("spec", "model", "preset"), f"unknown preset; choose from {', '.join(PRESETS)}")
    return ModelConfig.from_dict(preset_config(spec.preset), where="preset")


def make_model_if_missing(loaded: LoadedJob, progress: Callable[[int, int], Any] | None) -> bool:
    """Make the preset's random-weight checkpoint at the model path on first use; True when it did."""
    spec = loaded.job.spec.model
    if (Path(spec.path) / "config.json").exists():
        return False
    from rollout_worker.engine.checkpoint import make_model

    assert spec.preset is not None
    make_model(spec.preset, 0, spec.path, spec.dtype, progress=progress)
    return True


def candidate_layouts(loaded: LoadedJob, model: ModelConfig) -> list[Layout]:
    """The job's candidates (each checked against the model), or every layout the model can run."""
    spec = loaded.job.spec
    given = spec.parallelism.candidates
    if given is None:
        return model.candidate_layouts(spec.gpus_per_pod)
    out = []
    for i, lay in enumerate(given):
        why = model.tp_problem(lay.tp)
        if why:
            raise loaded.error(("spec", "parallelism", "candidates", i), why)
        out.append(lay)
    return sorted(set(out), key=lambda x: x.tp)


def profile_file(loaded: LoadedJob, model: ModelConfig) -> Profile | None:
    """The profile the job names as a JSON file (checked against the model), or None."""
    spec, where = loaded.job.spec, ("spec", "parallelism", "profile")
    name = spec.parallelism.profile
    if name is None or not (name.endswith(".json") or Path(name).exists()):
        return None
    if not Path(name).is_file():
        raise loaded.error(where, f"profile file not found: {name}")
    try:
        prof = Profile.from_json(name)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise loaded.error(where, f"{name} is not a profile ({exc})") from None
    return _same_shape(loaded, model, prof)


def stored_profile(loaded: LoadedJob, model: ModelConfig, session: Any) -> Profile | None:
    """The profile the job names in the database, else the newest stored one for this model shape,
    device, rank count and dtype; None when there is none."""
    from rollout_profiler.store import repo

    spec = loaded.job.spec
    name = spec.parallelism.profile
    if name is None:
        shape = ModelShape.of(Path(spec.model.path).name, model)
        found = repo.find_profile(
            session, shape.shape_hash, spec.engine.device, spec.gpus_per_pod, spec.model.dtype
        )
        return found
    ids = [p.id for p in repo.list_profiles(session) if p.name == name]
    if not ids:
        raise loaded.error(("spec", "parallelism", "profile"), f"no profile named {name!r} in the database")
    return _same_shape(loaded, model, repo.load_profile(session, max(ids)))


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


def _same_shape(loaded: LoadedJob, model: ModelConfig, prof: Profile) -> Profile:
    spec = loaded.job.spec
    if prof.model.shape_hash != ModelShape.of(Path(spec.model.path).name, model).shape_hash:
        raise loaded.error(
            ("spec", "parallelism", "profile"),
            f"profile {prof.name} is of another model shape than {spec.model.path}",
        )
    return prof


def initial_layout(
    loaded: LoadedJob, candidates: list[Layout], model: LatencyModel | None, prompts: int
) -> Layout:
    lay = loaded.job.spec.parallelism.initial_layout
    if lay != "auto":
        if lay not in candidates:
            raise loaded.error(("spec", "parallelism", "initialLayout"), f"{lay} is not among {candidates}")
        return lay
    if model is None:
        return candidates[0]
    sp = loaded.job.spec
    n = prompts * sp.samples_per_prompt // sp.pods
    waiting = ReplicaState(np.zeros(0), np.zeros(0), np.zeros(0), n)
    snap = PodSnapshot(
        candidates[0], (waiting,), (True,) * sp.gpus_per_pod, 0, 0.0, 128, sp.sampling.max_new_tokens
    )
    pol = PlannerPolicy(candidates=tuple(candidates), margin=sp.parallelism.margin)
    pred = fit(np.zeros(0), np.zeros(0), np.zeros(0))
    return choose_start(model, snap, pol, pred)
