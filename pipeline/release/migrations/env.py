"""Alembic's entry: runs the revisions on the connection `registry.upgrade` hands it (never an ini
file's URL: the registry's URL comes from its Connection, with its password)."""

from __future__ import annotations

from alembic import context

from pipeline.release.migrations.env_names import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None, version_table=VERSION_TABLE)
with context.begin_transaction():
    context.run_migrations()
