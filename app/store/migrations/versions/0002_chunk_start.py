"""A chunk may continue the transcript from an earlier point than its end; a chat
session keeps its conversation as messages.

A chat session whose template rewrites an earlier turn (or whose instructions change)
keeps the longest prefix its context shares with the new rendering and recomputes
the rest: the chunk that does so records where it starts. NULL: at the end. To render
the conversation again the session keeps it: ``sessions.chat``, JSON (its instructions
and messages, replies included), NULL where the context is not a chat's.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("session_chunks") as batch:
        batch.add_column(sa.Column("start", sa.Integer, nullable=True))
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("chat", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("chat")
    with op.batch_alter_table("session_chunks") as batch:
        batch.drop_column("start")
