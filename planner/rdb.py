"""Optuna RDB storage that several processes can open at once.

Two processes that open a fresh SQLite (or PostgreSQL) database together both try to create its
tables; one of them loses with "table already exists". Opening retries a few times, after a short
random pause, by which time the winner has made the schema."""

from __future__ import annotations

import random
import time

__all__ = ["rdb_storage"]


def rdb_storage(url: str, attempts: int = 6, **kwargs):
    import optuna
    import sqlalchemy.exc

    if url.startswith("sqlite"):
        kwargs.setdefault("engine_kwargs", {"connect_args": {"timeout": 120}})
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError):
            if attempt == attempts - 1:
                raise
            time.sleep(random.uniform(0.2, 1.0))
