"""planner.interrupts.deferred: a signal inside the block is held until a checkpoint, a second one stops at once."""

import os
import signal

import pytest

from planner.interrupts import Interrupted, deferred


def test_deferred_holds_the_first_signal_until_a_checkpoint(capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    reached = []
    with pytest.raises(Interrupted) as info:
        with deferred("resume note", waiting="finishing the unit") as pending:
            assert not pending
            pending.check()  # nothing came: goes on
            os.kill(os.getpid(), signal.SIGTERM)
            reached.append("after the signal")  # the handler only records it
            assert pending and pending.signum == signal.SIGTERM
            pending.check()
            reached.append("past the checkpoint")
    assert reached == ["after the signal"]
    assert info.value.signum == signal.SIGTERM and info.value.note == "resume note"
    assert "SIGTERM: finishing the unit (Ctrl-C again stops at once)" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are put back


def test_deferred_raises_on_leaving_the_block_and_at_once_on_a_second_signal():
    with pytest.raises(Interrupted) as info:
        with deferred() as pending:
            os.kill(os.getpid(), signal.SIGINT)
            assert pending.signum == signal.SIGINT
    assert info.value.signum == signal.SIGINT
    with pytest.raises(Interrupted):
        with deferred() as pending:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the user insists: raised inside the block
            pytest.fail("the second signal did not stop the block")
