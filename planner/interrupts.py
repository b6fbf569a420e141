"""Ctrl-C and SIGTERM (what Slurm and Kubernetes send) handled alike.

`Terminated` raises SIGTERM like Ctrl-C, so the same cleanup runs. `deferred()` holds both signals
back while a unit of work that must not be cut in half runs (one trial of a stored study): the
work stops at its next checkpoint, and the signal is raised when the block ends, as `Interrupted`,
with a note on how to resume."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["Terminated", "Interrupted", "Pending", "deferred"]


class Terminated(KeyboardInterrupt):
    """SIGTERM raised like Ctrl-C."""

    signum = signal.SIGTERM


class Interrupted(KeyboardInterrupt):
    """A signal that was held back until the work reached a safe point."""

    def __init__(self, signum: int, note: str = ""):
        super().__init__(note)
        self.signum = signum
        self.note = note


class Pending:
    """The first signal received inside `deferred()`, or None."""

    signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None


@contextmanager
def deferred(note: str = "") -> Iterator[Pending]:
    """Hold SIGINT and SIGTERM back for the block: the block polls the yielded Pending and stops at
    a safe point; on leaving the block a received signal is raised as Interrupted(signum, note). A
    second Ctrl-C while waiting stops at once. Outside the main thread (where Python cannot install
    handlers) nothing is held back."""
    pending = Pending()
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return

    def hold(signum, frame):
        if pending:  # the second signal: the user insists
            raise Interrupted(signum, note)
        pending.signum = signum

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield pending
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if pending:
        raise Interrupted(pending.signum, note)
