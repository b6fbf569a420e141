"""Ctrl-C and SIGTERM (what Slurm and Kubernetes send) handled alike.

`Terminated` raises SIGTERM like Ctrl-C, so the same cleanup runs. `deferred()` holds both signals
back while a unit of work that must not be cut in half runs (one trial of a stored study, one
training step): the work stops at its next checkpoint, and the signal is raised when the block
ends, as `Interrupted`, with a note on how to resume. A KeyboardInterrupt raised at an arbitrary
bytecode inside torch can leave its mode stacks half-popped ("trying to pop from empty mode stack")
and replace the interrupt by that error, so work running torch stops only at such points."""

from __future__ import annotations

import signal
import sys
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

    def __init__(self, note: str = ""):
        self.note = note

    def __bool__(self) -> bool:
        return self.signum is not None

    def check(self) -> None:
        """Stop here (raise Interrupted) if a signal came: for checkpoints inside the work."""
        if self.signum is not None:
            raise Interrupted(self.signum, self.note)


@contextmanager
def deferred(note: str = "", waiting: str = "") -> Iterator[Pending]:
    """Hold SIGINT and SIGTERM back for the block: the block polls the yielded Pending and stops at
    a safe point; on leaving the block a received signal is raised as Interrupted(signum, note). On
    the first signal `waiting` (what the work finishes first) is printed to stderr; a second Ctrl-C
    while waiting stops at once. Outside the main thread (where Python cannot install handlers)
    nothing is held back."""
    pending = Pending(note)
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return

    def hold(signum, frame):
        if pending:  # the second signal: the user insists
            raise Interrupted(signum, note)
        pending.signum = signum
        if waiting:
            print(f"{signal.Signals(signum).name}: {waiting} (Ctrl-C again stops at once)", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield pending
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    pending.check()
