"""The store the settings ask for."""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings
from app.store.base import NullStore, SessionStore


def store_url(settings: Settings) -> str | None:
    """The database URL: ``store_url`` as given, SQLite in the state directory by
    default, None for ``none`` (no store)."""
    if settings.store_url == "none":
        return None
    if settings.store_url:
        return settings.store_url
    return f"sqlite:///{Path(settings.resolved_state_dir()) / 'sessions.db'}"


def open_store(settings: Settings) -> SessionStore:
    url = store_url(settings)
    if url is None:
        return NullStore()
    from app.store.sql import SQLSessionStore

    return SQLSessionStore(url)
