"""Where sessions outlive the process: a small interface, SQL behind it.

The service talks to a ``SessionStore`` only (``base``); ``sql`` implements it on
SQLite (the default, one server) and PostgreSQL (several replicas, one database),
with versioned Alembic migrations in ``migrations/``. ``open_store`` picks one from
the settings.
"""

from app.store.base import (
    LeaseRefused,
    NullStore,
    SessionExistsError,
    SessionRecord,
    SessionStore,
    StoredObject,
    StoreUnavailableError,
)
from app.store.factory import open_store

__all__ = [
    "LeaseRefused",
    "NullStore",
    "SessionExistsError",
    "SessionRecord",
    "SessionStore",
    "StoreUnavailableError",
    "StoredObject",
    "open_store",
]
