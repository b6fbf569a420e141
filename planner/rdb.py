"""Optuna RDB storage that several processes can open at once.

Two processes that open a fresh SQLite (or PostgreSQL) database together both try to create its
tables; one of them loses with "table already exists". Opening retries a few times, after a short
random pause, by which time the winner has made the schema."""

from __future__ import annotations

import random
import time
from pathlib import Path

__all__ = ["rdb_storage"]

DRIVERS = {"postgresql": "psycopg2-binary", "mysql": "PyMySQL", "mariadb": "PyMySQL", "oracle": "oracledb", "mssql": "pyodbc"}


def rdb_storage(url: str, attempts: int = 6, **kwargs):
    """Optuna RDB storage at `url`; a malformed URL or a database that cannot be opened is a
    SpecError (exit code 2) naming the URL."""
    import optuna
    import sqlalchemy.exc

    from planner.errors import SpecError

    if url.startswith("sqlite:///"):
        kwargs.setdefault("engine_kwargs", {"connect_args": {"timeout": 120}})
        folder = Path(url[len("sqlite:///") :]).parent
        if not folder.is_dir():
            raise SpecError(f"--storage {url}: folder {folder} does not exist")
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except sqlalchemy.exc.ArgumentError as exc:
            raise SpecError(f"--storage {url!r}: not a database URL (e.g. sqlite:///study.db, postgresql://host/db): {exc}") from None
        except ImportError:
            scheme = url.split(":", 1)[0].split("+")[0]
            driver = DRIVERS.get(scheme, "the database's Python driver")
            raise SpecError(f"--storage {url}: no driver for {scheme} is installed: pip install {driver}") from None
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError) as exc:
            if attempt == attempts - 1:
                raise SpecError(f"--storage {url}: cannot open the database: {exc.orig}") from None
            time.sleep(random.uniform(0.2, 1.0))
        except sqlalchemy.exc.DatabaseError as exc:  # a file that is not a database: retrying cannot help
            raise SpecError(f"--storage {url}: not an Optuna database ({exc.orig}); point --storage at a new file or an Optuna "
                            "database") from None  # fmt: skip
