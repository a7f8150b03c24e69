"""Baseline: the registry as `create_all` made it up to 1b3a689 (releases, their append-only events,
planner profiles; on SQLite the triggers that refuse changing an event).

A database written before migrations existed has exactly these tables: `registry.upgrade` stamps it
at this revision instead of running it.

Revision ID: 0001
Revises:
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "releases",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_key", sa.String(250), nullable=False, unique=True),
        sa.Column("name", sa.String(200), nullable=False, index=True),
        sa.Column("spec_path", sa.Text, nullable=False),
        sa.Column("spec_yaml", sa.Text, nullable=False),
        sa.Column("target", sa.String(20), nullable=False),
        sa.Column("status", sa.String(20), nullable=False, index=True),
        sa.Column("data", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "release_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("release_id", sa.Integer, sa.ForeignKey("releases.id"), nullable=False, index=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(50), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("status_after", sa.String(20), nullable=True),
        sa.Column("detail", sa.JSON, nullable=False),
    )
    op.create_table(
        "planner_profiles",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("hardware", sa.String(200), nullable=False, index=True),
        sa.Column("engine_image", sa.String(500), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
    )
    if op.get_bind().dialect.name == "sqlite":
        for what in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER release_events_no_{what.lower()} BEFORE {what} ON release_events "
                "BEGIN SELECT RAISE(ABORT, 'release_events is append-only'); END"
            )


def downgrade() -> None:
    raise NotImplementedError("the registry is a system of record: restore a backup instead")
