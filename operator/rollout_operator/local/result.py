"""What one run of a job's pods produced, kept beside its outputs (``run.json``) so that rerunning a finished
job reports it instead of generating it again, and the output directory's guard: it holds one job's samples
only (``job.json``: the hash of every spec field the samples depend on)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.api.sidecar import output_files
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout
from rollout_worker.sidecar.outputs import sha256_of

from rollout_operator.api.job import RolloutJobSpec, samples_hash

RUN_FILE, JOB_FILE, MANIFEST = "run.json", "job.json", "manifest.json"


@dataclass(frozen=True)
class Point:
    """One moment of one pod, for the timeline."""

    t: float
    pod: str
    running: int
    tp: int


@dataclass
class RunResult:
    policy: str
    layout: Layout
    out_dir: Path
    seconds: float
    samples: int
    tokens: int
    events: dict[str, list[ReconfigEvent]]
    decisions: list[dict[str, Any]]
    timeline: list[Point] = field(default_factory=list)
    resumed: int = 0  # samples already in the outputs when this run started
    reused: bool = False  # a finished run reported again, nothing generated
    service: bool = False  # samples = requests the engines finished; tokens unknown
    resumed_tokens: int = 0  # the completion tokens of the ``resumed`` samples (in ``tokens``, not generated)
    closest: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # per pod: the kept decision nearest a switch

    @property
    def generated_tokens(self) -> int:
        """The tokens this run generated: ``tokens`` counts every sample in the outputs."""
        return self.tokens - self.resumed_tokens

    @property
    def tokens_per_s(self) -> float:
        """Generation speed of this run: the tokens it generated over its seconds (a resumed run's
        ``seconds`` cover only what it generated)."""
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "layout": str(self.layout),
            "seconds": self.seconds,
            "samples": self.samples,
            "tokens": self.tokens,
            "events": {p: [e.model_dump(mode="json") for e in evs] for p, evs in self.events.items()},
            "decisions": self.decisions,
            "timeline": [asdict(p) for p in self.timeline],
            "resumed": self.resumed,
            "resumed_tokens": self.resumed_tokens,
            "closest": self.closest,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], out_dir: Path) -> RunResult:
        return cls(
            d["policy"],
            Layout.parse(d["layout"]),
            out_dir,
            float(d["seconds"]),
            int(d["samples"]),
            int(d["tokens"]),
            {p: [ReconfigEvent.model_validate(e) for e in evs] for p, evs in d["events"].items()},
            list(d["decisions"]),
            [Point(**p) for p in d["timeline"]],
            int(d.get("resumed", 0)),
            reused=True,
            resumed_tokens=int(d.get("resumed_tokens", 0)),
            closest=dict(d.get("closest", {})),
        )

    @property
    def switched(self) -> bool:
        """Whether any pod of this run reconfigured (or tried to: a rolled-back switch counts too)."""
        return any(self.events.values())


@dataclass(frozen=True)
class Comparison:
    """``--compare static``: the job's run and the same job's static run, and whether their outputs agree."""

    run: RunResult
    static: RunResult
    identical: bool
    detail: str  # what :func:`~rollout_operator.local.local_job.outputs_equal` found

    @property
    def same_work(self) -> bool:
        """No switch in either run: both ran their starting layout throughout, step for step the same work,
        so their times differ by noise only."""
        return not self.run.switched and not self.static.switched and self.run.layout == self.static.layout

    @property
    def ratio(self) -> float:
        """Static seconds over the run's seconds (above 1: the run was faster)."""
        return self.static.seconds / self.run.seconds if self.run.seconds else 0.0

    @property
    def partial(self) -> bool:
        """A resumed side: its time covers only what it generated."""
        return bool(self.run.resumed or self.static.resumed)


def check_claim(out_dir: Path, spec: RolloutJobSpec, job_name: str) -> None:
    """Refuse an output directory that holds another job's samples (or this job's with other settings):
    samples of two different jobs never mix."""
    path = out_dir / JOB_FILE
    if not path.exists():
        if output_files(out_dir):
            raise UserError(f"{out_dir} holds outputs of an unknown job; give another --output", "--output")
        return
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError):
        have = {}
    if have.get("samples_hash") != samples_hash(spec):
        raise UserError(
            f"{out_dir} holds the outputs of another job or of other settings ({have.get('job', '?')}); "
            "give another --output (or remove that directory)",
            "--output",
        )


def claim(out_dir: Path, spec: RolloutJobSpec, job_name: str) -> None:
    """Make ``out_dir`` this job's (after :func:`check_claim`)."""
    path = out_dir / JOB_FILE
    if path.exists():
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{JOB_FILE}.tmp"
    tmp.write_text(json.dumps({"job": job_name, "samples_hash": samples_hash(spec)}, indent=1) + "\n")
    tmp.replace(path)


def finished(out_dir: Path, policy: str) -> RunResult | None:
    """The recorded result of a finished run of this policy in ``out_dir``, when its outputs are exactly the
    ones its manifest lists; None when the run must (still) be done."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
        stored = json.loads((out_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if stored.get("policy") != policy:
        return None
    for entry in manifest.get("files", []):
        f = out_dir / str(entry.get("file"))
        if not f.is_file() or sha256_of(f) != entry.get("sha256"):
            return None
    try:
        return RunResult.from_json(stored, out_dir)
    except (KeyError, TypeError, ValueError):
        return None


def record(result: RunResult) -> None:
    tmp = result.out_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    tmp.replace(result.out_dir / RUN_FILE)
