"""Objects of OpenAI's stateful APIs kept beside their sessions: stored responses and
conversation items.

A response or an item belongs to the session that holds its context; it goes when its
session is purged (``ON DELETE CASCADE``, and explicitly in ``expire``). ``seq`` orders
a session's objects of one kind (a conversation's items); ``data`` is the object's JSON.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_objects",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("data", sa.Text, nullable=False),
    )
    op.create_index("api_objects_session_kind_seq", "api_objects", ["session_id", "kind", "seq"])


def downgrade() -> None:
    op.drop_index("api_objects_session_kind_seq", "api_objects")
    op.drop_table("api_objects")
