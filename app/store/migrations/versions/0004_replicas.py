"""The replicas that share this store, and values the cluster shares.

``replicas``: one row per live replica id, with the instance that holds it (a token kept
in the replica's state directory, so the same replica restarted holds it again) and its
last heartbeat; a second process with the same id and another instance is refused while
the row is fresh. ``cluster``: values every replica must agree on (the cache-salt secret).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(256), primary_key=True),
        sa.Column("instance", sa.String(64), nullable=False),
        sa.Column("heartbeat", sa.Float, nullable=False),
    )
    op.create_table(
        "cluster",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cluster")
    op.drop_table("replicas")
