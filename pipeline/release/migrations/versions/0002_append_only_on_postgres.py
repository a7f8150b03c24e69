"""Append-only at the database on Postgres too, and what the runtime role may do.

Before this, only SQLite refused changing an event; on Postgres the application's role owned the
tables. Now a trigger refuses UPDATE, DELETE and TRUNCATE of `release_events` for everyone, and the
group role `model_release_runtime` (the running pipeline's login role is a member; the owner runs
migrations) may only read and append, and change a release's status and facts: it cannot touch
an event, nor drop the trigger (only the owner can). Skipped where that role does not exist (a
database with one role): create the role, then grant what this revision grants, by hand.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

RUNTIME_ROLE = "model_release_runtime"

POSTGRES = f"""
CREATE FUNCTION release_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'release_events is append-only: % refused', TG_OP;
END $$;
CREATE TRIGGER release_events_no_change BEFORE UPDATE OR DELETE ON release_events
    FOR EACH ROW EXECUTE FUNCTION release_events_append_only();
CREATE TRIGGER release_events_no_truncate BEFORE TRUNCATE ON release_events
    FOR EACH STATEMENT EXECUTE FUNCTION release_events_append_only();
REVOKE ALL ON releases, release_events, planner_profiles, model_release_version FROM PUBLIC;
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{RUNTIME_ROLE}') THEN
        GRANT SELECT, INSERT ON releases, release_events, planner_profiles TO {RUNTIME_ROLE};
        GRANT UPDATE (status, data, updated_at) ON releases TO {RUNTIME_ROLE};
        GRANT USAGE ON SEQUENCE releases_id_seq, release_events_id_seq, planner_profiles_id_seq TO {RUNTIME_ROLE};
        GRANT SELECT ON model_release_version TO {RUNTIME_ROLE};
    END IF;
END $$;
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRES)


def downgrade() -> None:
    raise NotImplementedError("the registry is a system of record: restore a backup instead")
