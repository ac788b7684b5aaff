"""Loading a RolloutJob manifest from YAML: every error names the YAML path and the line
(``job.yaml:14: spec.parallelism.candidates[2]: 3x1 uses 3 ranks, but gpusPerPod is 2``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError
from rollout_worker.data.files import read_text
from rollout_worker.errors import FieldPath, UserError, field_errors

from rollout_operator.api.job import RolloutJob

Path_ = FieldPath


@dataclass(frozen=True)
class LoadedJob:
    """A validated job and where each of its fields stood in the file (for later checks' messages)."""

    job: RolloutJob
    file: str
    lines: dict[Path_, int]

    def error(self, path: Path_, message: str) -> UserError:
        return UserError(f"{_where(self.file, self.lines, path)}: {dotted(path)}: {message}")


def dotted(path: Path_) -> str:
    """("spec", "parallelism", "candidates", 2) -> "spec.parallelism.candidates[2]"."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(document)"


def _lines(node: yaml.Node, path: Path_ = ()) -> dict[Path_, int]:
    out: dict[Path_, int] = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            sub = (*path, key.value)
            out[sub] = key.start_mark.line + 1
            for p, line in _lines(value, sub).items():
                out.setdefault(p, line)
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            out.update(_lines(value, (*path, i)))
    return out


def _where(file: str, lines: dict[Path_, int], path: Path_) -> str:
    """file:line of ``path``, or of its closest ancestor that the file has (a missing field)."""
    for n in range(len(path), -1, -1):
        if path[:n] in lines:
            return f"{file}:{lines[path[:n]]}"
    return file


class _Refused(yaml.YAMLError):
    """A YAML construct a job file may not use, at its mark."""

    def __init__(self, mark: yaml.Mark, message: str) -> None:
        super().__init__(message)
        self.mark, self.message = mark, message


class _JobLoader(yaml.SafeLoader):
    """The safe loader, stricter: no aliases (an alias bomb expands a kilobyte into gigabytes, refused
    here before anything is expanded) and no duplicate keys (YAML would keep the last one silently)."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(
                event.start_mark,
                f"alias *{event.anchor}: a job file may not use anchors and aliases (write the value out)",
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        self.flatten_mapping(node)  # merge keys (<<), as the base does
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, list | dict):  # unhashable: the base class refuses it below
                continue
            if key in seen:
                raise _Refused(key_node.start_mark, f"duplicate key {key!r} (YAML would keep the last one)")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _document(text: str, file: str) -> tuple[yaml.Node | None, object]:
    """The file's node tree (for lines) and its data; YAML errors name the file and line."""
    loader = _JobLoader(text)
    try:
        node = loader.get_single_node()
        return node, None if node is None else loader.construct_document(node)
    except _Refused as exc:
        raise UserError(f"{file}:{exc.mark.line + 1}: {exc.message}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{file}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    finally:
        loader.dispose()


def parse_job(text: str, file: str = "job.yaml") -> LoadedJob:
    node, data = _document(text, file)
    if node is None or not isinstance(data, dict):
        raise UserError(
            f"{file}: expected a RolloutJob manifest (a mapping with apiVersion, kind, metadata, spec)"
        )
    lines = _lines(node)
    try:
        job = RolloutJob.model_validate(data)
    except ValidationError as exc:
        msgs = [f"{_where(file, lines, path)}: {dotted(path)}: {msg}" for path, msg in field_errors(exc, 10)]
        raise UserError("\n".join(msgs)) from None
    return LoadedJob(job, file, lines)


def load_job(path: str | Path) -> LoadedJob:
    return parse_job(read_text(path, what="job file"), str(path))
