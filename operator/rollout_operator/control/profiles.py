"""Where a job's profile comes from, for ``rolloutctl run`` and the operator alike (``parallelism.profile``):

- a name that is a file (at that path, else in ``profiles_dir``, the operator's shipped profiles): that JSON;
- a name that looks like a file (``*.json``) but is none: refused;
- any other name: the newest profile of that name in the database (one query);
- no name: the best stored profile of the model's shape on the job's device, ranks and dtype, when the
  caller knows the shape (``rolloutctl run`` reads the model; the operator does not: None).

A profile of another model shape than the caller's is refused. Refusals name ``spec.parallelism.profile``.
"""

from __future__ import annotations

from pathlib import Path

from rollout_profiler.profile import Profile
from sqlalchemy.orm import Session

from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.control.jobplan import Refusal

FIELD = "spec.parallelism.profile"


def _from_file(path: Path) -> Profile | Refusal:
    try:
        return Profile.from_json(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Refusal(FIELD, f"{path.name} is not a profile ({exc})")


def _named(name: str, session: Session | None, profiles_dir: Path | None) -> Profile | Refusal | None:
    for path in (Path(name), *([profiles_dir / Path(name).name] if profiles_dir is not None else [])):
        if path.is_file():
            return _from_file(path)
    if name.endswith(".json"):
        return Refusal(FIELD, f"profile file not found: {name}")
    if session is None:
        return None
    from rollout_profiler.store import repo

    found = repo.find_profile_named(session, name)
    if found is not None:
        return found
    where = f"not a file, not in {profiles_dir}," if profiles_dir is not None else "not a file,"
    return Refusal(FIELD, f"no profile {name!r}: {where} and none of that name in the database")


def find_profile(
    spec: RolloutJobSpec,
    session: Session | None,
    profiles_dir: Path | None = None,
    shape_hash: str | None = None,
) -> Profile | Refusal | None:
    """The job's profile (see the module's docstring); None when it names none and none is stored.
    ``session`` None: files only (a check before any database is opened)."""
    name = spec.parallelism.profile
    if name is None:
        if shape_hash is None or session is None:
            return None
        from rollout_profiler.store import repo

        return repo.find_profile(session, shape_hash, spec.engine.device, spec.gpus_per_pod, spec.model.dtype)
    prof = _named(name, session, profiles_dir)
    if isinstance(prof, Profile) and shape_hash is not None and prof.model.shape_hash != shape_hash:
        return Refusal(FIELD, f"profile {prof.name} is of another model shape than {spec.model.path}")
    return prof
