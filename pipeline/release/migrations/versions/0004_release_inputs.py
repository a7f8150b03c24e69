"""Each release keeps what it was built from besides its spec text: the hardware profile's text
and the resolved model source (`release_inputs`, one row per release, written when it is opened).

Before this, a rollback or re-benchmark read whatever profile was on disk then, and a relative
model source meant nothing away from the spec's directory. Releases opened earlier have no row
(nothing recorded can be recovered): they read the profile from disk, with a warning. Inputs are
never changed: append-only like the events, on both engines; the runtime role may read and insert.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

RUNTIME_ROLE = "model_release_runtime"

POSTGRES = f"""
CREATE OR REPLACE FUNCTION release_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP;
END $$;
CREATE TRIGGER release_inputs_no_change BEFORE UPDATE OR DELETE ON release_inputs
    FOR EACH ROW EXECUTE FUNCTION release_events_append_only();
CREATE TRIGGER release_inputs_no_truncate BEFORE TRUNCATE ON release_inputs
    FOR EACH STATEMENT EXECUTE FUNCTION release_events_append_only();
REVOKE ALL ON release_inputs FROM PUBLIC;
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{RUNTIME_ROLE}') THEN
        GRANT SELECT, INSERT ON release_inputs TO {RUNTIME_ROLE};
    END IF;
END $$;
"""


def upgrade() -> None:
    op.create_table(
        "release_inputs",
        sa.Column("release_id", sa.Integer, sa.ForeignKey("releases.id"), primary_key=True),
        sa.Column("hardware_path", sa.Text, nullable=False),
        sa.Column("hardware_yaml", sa.Text, nullable=False),
        sa.Column("model_source", sa.Text, nullable=False),
    )
    if op.get_bind().dialect.name == "sqlite":
        for what in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER release_inputs_no_{what.lower()} BEFORE {what} ON release_inputs "
                "BEGIN SELECT RAISE(ABORT, 'release_inputs is append-only'); END"
            )
    elif op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRES)


def downgrade() -> None:
    raise NotImplementedError("the registry is a system of record: restore a backup instead")
