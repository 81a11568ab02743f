"""Alembic's environment: migrate on the connection the store hands over
(``config.attributes["connection"]``), inside the store's transaction."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
