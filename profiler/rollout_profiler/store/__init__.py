"""The profile/decision database: SQLAlchemy 2 models, URL resolution, typed repository functions and
Alembic migrations (``rollout_profiler.store.migrate``).

Typical use::

    from sqlalchemy.orm import Session
    from rollout_profiler.store import migrate, repo
    from rollout_profiler.store import database

    url = database.resolve_url(None)  # --db > $ROLLOUT_DB_URL > sqlite:///$ROLLOUT_HOME/rollout.db
    migrate.upgrade(url)
    with Session(database.make_engine(url)) as session, session.begin():
        profile_id = repo.save_profile(session, profile)
"""
