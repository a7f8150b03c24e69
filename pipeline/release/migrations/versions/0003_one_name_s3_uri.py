"""Facts written before the one-name rule called the staged S3 URI `artifact_uri`: renamed to
`s3_uri` in place, once, instead of mapped on every read.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    releases = sa.table("releases", sa.column("id", sa.Integer), sa.column("data", sa.JSON))
    bind = op.get_bind()
    for rid, data in bind.execute(sa.select(releases.c.id, releases.c.data)).all():
        data = json.loads(data) if isinstance(data, str) else data
        if "artifact_uri" in data:
            renamed = {k: v for k, v in data.items() if k != "artifact_uri"} | {"s3_uri": data["artifact_uri"]}
            bind.execute(sa.update(releases).where(releases.c.id == rid).values(data=renamed))


def downgrade() -> None:
    raise NotImplementedError("the registry is a system of record: restore a backup instead")
