"""The registry's schema history (Alembic): one revision per change, so a database written by any
earlier version is brought forward in place instead of only new databases getting new tables.

Its own version table (`model_release_version`): Airflow's metadata uses Alembic's default
`alembic_version`, and the two must never read each other's revision. `Registry` upgrades on open
(`pipeline.release.registry`); `model-release releases migrate --url OWNER_URL` does it as an explicit step, with
the owner's URL, where the running code connects as a role that may not change the schema.
"""

from __future__ import annotations

import logging
from pathlib import Path

# before alembic is imported: it sets up its plugins, saying so at INFO, on import and on every command
logging.getLogger("alembic.runtime.plugins").addFilter(lambda record: record.levelno >= logging.WARNING)

from alembic import command  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402
from sqlalchemy import inspect  # noqa: E402
from sqlalchemy.engine import Connection, Engine  # noqa: E402
from sqlalchemy.exc import DBAPIError, OperationalError  # noqa: E402

from pipeline.core.errors import NotMigrated, ReleaseError  # noqa: E402
from pipeline.release.migrations.env_names import BASELINE, VERSION_TABLE  # noqa: E402

__all__ = ["BASELINE", "VERSION_TABLE", "head", "revision", "upgrade"]


# Alembic says which dialect it found on every context, i.e. on every open: keep the upgrades' lines only
logging.getLogger("alembic.runtime.migration").addFilter(
    lambda record: not record.getMessage().startswith(("Context impl", "Will assume"))
)


def _config(conn: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.attributes["connection"] = conn
    return cfg


def head() -> str:
    """The newest revision this code knows."""
    return str(ScriptDirectory(str(Path(__file__).parent)).get_current_head())


def revision(conn: Connection) -> str | None:
    """The database's revision; None before migrations (an empty database, or one written before them)."""
    return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(engine: Engine, safe_url: str, to: str = "head") -> str:
    """Bring the registry to head (or `to`: tests build an old database); returns the revision it
    was at. A database written before migrations (its tables, no version table) is stamped at the
    baseline first, then upgraded.
    Serialised between processes: SQLite's write lock (BEGIN IMMEDIATE), Postgres' advisory lock."""
    try:
        with engine.connect() as conn:
            was = revision(conn)
    except OperationalError as exc:  # the server is not there, or refuses this role: one line, no traceback
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc).splitlines()[0]
        raise ReleaseError(f"registry {safe_url}: cannot connect: {reason}") from None
    if was == (head() if to == "head" else to):
        return was
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            elif conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(59059)")
            was = revision(conn)  # another process may have migrated while this one waited
            if was is None and inspect(conn).has_table("releases"):
                command.stamp(_config(conn), BASELINE)
            command.upgrade(_config(conn), to)
    except DBAPIError as exc:
        if engine.dialect.name == "postgresql" and getattr(exc.orig, "sqlstate", None) in ("42501",):
            raise NotMigrated(
                f"registry {safe_url}: at revision {was or 'none'}, this code needs {head()}, and this role may not"
                " change the schema: run `model-release releases migrate --url OWNER_URL`"
            ) from None
        raise
    return was or "none"
