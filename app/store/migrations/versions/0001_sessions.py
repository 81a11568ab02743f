"""Sessions and their transcripts, one token-id run per chunk.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("defaults", sa.Text, nullable=False),
        sa.Column("metadata", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("close_reason", sa.String(64)),
        sa.Column("num_chunks", sa.Integer, nullable=False),
        sa.Column("num_tokens", sa.Integer, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("last_activity", sa.Float, nullable=False),
        # Which replica may extend the session now, and until when.
        sa.Column("lease_holder", sa.String(256)),
        sa.Column("lease_expires", sa.Float),
    )
    op.create_index("sessions_owner_status", "sessions", ["owner", "status"])
    op.create_index("sessions_status_last_activity", "sessions", ["status", "last_activity"])
    op.create_table(
        "session_chunks",
        sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("idx", sa.Integer, primary_key=True),
        # Little-endian int32 token ids: what the chunk added to the session's context.
        sa.Column("token_ids", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("session_chunks")
    op.drop_index("sessions_status_last_activity", "sessions")
    op.drop_index("sessions_owner_status", "sessions")
    op.drop_table("sessions")
