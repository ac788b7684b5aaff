"""Show a profile: a plain-text report (``render_table``) and a PNG plot (``write_plot``, matplotlib Agg)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path

from rollout_worker.data.files import read_text
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.profile import Profile, StepPoint

MAX_PANELS = 4  # one subplot per context value up to this many; beyond, only the median context


def step_latency_source(profile: Profile) -> str:
    """Whether the step latencies were measured or modelled, from the provenance, else the method."""
    if "step_latency" in profile.provenance.get("modelled", []):
        return "modelled"
    if "step_latency" in profile.provenance.get("measured", []):
        return "measured"
    return profile.method


def layouts_of(points: Sequence[StepPoint]) -> list[Layout]:
    """The layouts of these points, smallest TP first."""
    return sorted({Layout(p.replicas, p.tp) for p in points}, key=lambda lay: (lay.tp, lay.replicas))


def _kv(label: str, text: str) -> str:
    return f"{label + ':':<10}{text}"


def _of(points: Sequence[StepPoint], lay: Layout) -> list[StepPoint]:
    return [p for p in points if p.replicas == lay.replicas and p.tp == lay.tp]


def _grid(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _step_table(profile: Profile) -> list[str]:
    contexts = sorted({p.context for p in profile.step_latency})
    cell = {(p.replicas, p.tp, p.batch, p.context): p.ms for p in profile.step_latency}
    beyond = {(p.replicas, p.tp, p.batch, p.context) for p in profile.infeasible_points()}
    rows = [["layout", "batch", *(f"ctx {c}" for c in contexts)]]
    for lay in layouts_of(profile.step_latency):
        batches = sorted(
            {p.batch for p in profile.step_latency if (p.replicas, p.tp) == (lay.replicas, lay.tp)}
        )
        for b in batches:
            keys = [(lay.replicas, lay.tp, b, c) for c in contexts]
            rows.append([str(lay), str(b), *(_cell(cell.get(k), k in beyond) for k in keys)])
    return _grid(rows, right=set(range(1, len(rows[0]))))


def _cell(ms: float | None, infeasible: bool) -> str:
    if ms is None:
        return "-"
    return f"{ms:.3f}" + ("!" if infeasible else "")


def _capacity_lines(profile: Profile) -> list[str]:
    if profile.kv_capacity is None:
        return ["kv capacity: not in the profile (treated as unlimited)"]
    caps = sorted(profile.kv_capacity.tokens_per_replica.items())
    lines = ["kv capacity: " + ", ".join(f"TP{t} {n:,} tokens per replica" for t, n in caps)]
    n_bad = len(profile.infeasible_points())
    if n_bad:
        lines.append(
            f"! {n_bad} point(s) beyond that capacity (batch x context > tokens per replica): infeasible, "
            "no engine runs them; the simulator never steps such a state"
        )
    return lines


def _reconfig_table(profile: Profile) -> list[str]:
    if not profile.reconfig_cost:
        return ["(no reconfiguration cost points)"]
    rows = [["src", "dst", "method", "tokens", "bytes", "ms"]]
    for r in profile.reconfig_cost:
        rows.append([r.src, r.dst, r.method, str(r.tokens), str(r.bytes), f"{r.ms:.3f}"])
    return _grid(rows, right={3, 4, 5})


def render_table(profile: Profile) -> str:
    """A plain-text report of ``profile``: header, step-latency grid, reconfiguration points, fitted costs."""
    m, prov = profile.model, profile.provenance
    lines = [
        _kv("profile", profile.name),
        _kv("model", f"{m.name} ({m.architecture}, shape {m.shape_hash}): {m.num_layers} layers, "
            f"hidden {m.hidden_size}, heads {m.num_heads}/{m.num_kv_heads} kv, head_dim {m.head_dim}"),
        _kv("device", f"{profile.device_count} x {profile.device_kind}"
            + (f" ({profile.device_name})" if profile.device_name else "")),
        _kv("dtype", profile.dtype),
        _kv("engine", profile.engine),
        _kv("method", profile.method),
        _kv("created", profile.created or "-"),
    ]  # fmt: skip
    for key in ("measured", "modelled"):
        if prov.get(key):
            lines.append(_kv(key, ", ".join(str(x) for x in prov[key])))
    for key in ("notes", "command"):
        if prov.get(key):
            lines.append(_kv(key, str(prov[key])))
    lines += ["", f"step latency, ms per decode step of one replica ({step_latency_source(profile)}):"]
    lines += _step_table(profile)
    lines += ["", *_capacity_lines(profile)]
    lines += ["", f"reconfiguration cost points ({len(profile.reconfig_cost)}):"]
    lines += _reconfig_table(profile)
    lines += ["", "fitted reconfiguration costs:"]
    lines += [f"  {k:24} {v:g}" for k, v in dataclasses.asdict(profile.costs).items()]
    return "\n".join(lines) + "\n"


def read_profile_file(path: Path) -> Profile:
    """Read and validate a profile JSON file; every failure is a one-line ``UserError``."""
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a profile file")
    try:
        data = json.loads(read_text(path, what="profile file"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path}: a profile must be a JSON object, got {type(data).__name__}")
    return Profile.from_dict(data, where=str(path))


def plot_path(option: Path, profile: Profile) -> Path:
    """Where ``--plot`` writes: the given file, or ``<name>.png`` inside a given folder (``--plot .``)."""
    if option.is_dir():
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", profile.name).strip("._") or "profile"
        return option / f"{safe}.png"
    return option


def plotted_contexts(points: Sequence[StepPoint]) -> list[int]:
    contexts = sorted({p.context for p in points})
    return contexts if len(contexts) <= MAX_PANELS else [contexts[len(contexts) // 2]]


def write_plot(profile: Profile, path: Path) -> Path:
    """Plot step latency against batch, one line per layout and one panel per context; write a PNG."""
    from matplotlib.figure import Figure  # heavy: imported only when plotting
    from matplotlib.ticker import StrMethodFormatter

    source = step_latency_source(profile)
    contexts = plotted_contexts(profile.step_latency)
    ncols = min(2, len(contexts))
    nrows = (len(contexts) + ncols - 1) // ncols
    median_only = len(contexts) < len({p.context for p in profile.step_latency})
    fig = Figure(figsize=(max(7.5, 6.0 * ncols), 4.2 * nrows + 0.8), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax, ctx in zip(axes, contexts, strict=False):
        for lay in layouts_of(profile.step_latency):
            pts = sorted(
                (
                    p
                    for p in profile.step_latency
                    if (p.replicas, p.tp, p.context) == (lay.replicas, lay.tp, ctx)
                ),
                key=lambda p: p.batch,
            )
            if pts:
                ax.plot(
                    [p.batch for p in pts],
                    [p.ms for p in pts],
                    marker="o",
                    linestyle="--" if source == "modelled" else "-",
                    label=f"{lay} ({source})",
                )
        batches = [p.batch for p in profile.step_latency if p.context == ctx]
        if max(batches) >= 8 * min(batches):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
        ax.set_title(f"context {ctx} tokens" + (" (median)" if median_only else ""))
        ax.set_xlabel("running requests per replica (batch)")
        ax.set_ylabel("decode step latency (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(contexts) :]:
        ax.set_visible(False)
    note = "" if source == profile.method else f" (step latency {source})"
    fig.suptitle(
        f"{profile.name}\n{profile.model.name} on {profile.device_count} x {profile.device_kind}, "
        f"{profile.dtype}, {profile.method}{note}",
        fontsize="medium",
    )
    try:
        fig.savefig(path, format="png", dpi=100)
    except OSError as exc:
        raise UserError(f"cannot write plot {path}: {exc.strerror or exc}") from exc
    return path
