"""Where the operator finds a job's profile (``spec.parallelism.profile``): a JSON file at that path, else a
file of that name in the operator's profiles directory, else a profile of that name in its database."""

from __future__ import annotations

from pathlib import Path

from rollout_profiler.profile import Profile
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from rollout_operator.cluster.plan import Refusal

FIELD = "spec.parallelism.profile"


def _from_file(path: Path) -> Profile | Refusal:
    try:
        return Profile.from_json(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Refusal(FIELD, f"{path.name} is not a profile ({exc})")


def find_profile(name: str | None, profiles_dir: Path | None, db: Engine) -> Profile | Refusal | None:
    if name is None:
        return None
    for path in (Path(name), *([profiles_dir / Path(name).name] if profiles_dir is not None else [])):
        if path.is_file():
            return _from_file(path)
    from rollout_profiler.store import repo

    with Session(db) as session:
        ids = [p.id for p in repo.list_profiles(session) if p.name == name]
        if ids:
            return repo.load_profile(session, max(ids))
    where = f"not a file, not in {profiles_dir}," if profiles_dir is not None else "not a file,"
    return Refusal(FIELD, f"no profile {name!r}: {where} and none of that name in the database")
