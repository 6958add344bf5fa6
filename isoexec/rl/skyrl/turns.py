"""Arms of one seed taking turns step by step: run k of every arm, then step k+1 (``rl.interleave: step``).

Each arm's ``RayPPOTrainer.train`` runs in a thread of its own (:func:`run_in_turns`), on the arm's own
engine actors and policy worker group; :class:`TurnCallback`, a SkyRL ``TrainingCallback``, makes the
threads take turns. SkyRL 0.4's loop (``skyrl/train/trainer.py``, ``RayPPOTrainer.train``) fires
``on_step_start`` before it opens ``Timer("step")`` and ``on_log`` after the step timer closed (the
weight sync is inside the step): the callback waits for the arm's turn in ``on_step_start`` and hands the
turn on in ``on_log``, so no arm ever waits inside a timed phase and no two arms' steps overlap. A slow
stretch of the machine then lands on neighbouring steps of every arm, and the overhead paired per step
(:func:`isoexec.report.stats.paired_times`) cancels it.

The first step waits until every arm has reached it (start-ups and the first weight syncs, which run
outside the steps, never overlap a timed step). An arm whose run ends or fails leaves the rotation; when
one fails, every arm waiting for its turn raises :class:`TurnsAborted` and :func:`run_in_turns` raises the
failing arm's own error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from isoexec.rl.skyrl import compat

compat.install()  # before the first skyrl import (compat item 1)

from skyrl.train.utils.callbacks import TrainingCallback  # noqa: E402


class TurnsAborted(RuntimeError):
    """Another arm of the seed failed; this arm stops at its next turn."""


class StepTurns:
    """The turn of ``names`` (in this order, round after round) among threads, one step each.

    Args:
        names: the arms, in the order they step (distinct).

    Raises:
        ValueError: ``names`` is empty or repeats a name.
    """

    def __init__(self, names: Sequence[str]):
        if not names or len(set(names)) != len(names):
            raise ValueError(f"turns need distinct arm names, got {list(names)}")
        self.order = list(names)
        self.waited_s = {n: 0.0 for n in names}  # seconds each arm spent waiting for its turn
        self._active = set(names)  # arms whose run has not ended
        self._arrived: set[str] = set()  # arms that asked for a turn at least once
        self._turn = 0  # index into order of the arm whose turn it is
        self._holder: str | None = None  # the arm stepping now
        self._failed: str | None = None
        self._cond = threading.Condition()

    def _ready(self, name: str) -> bool:
        return self._failed is not None or (
            self._arrived >= self._active and self._holder is None and self.order[self._turn] == name)

    def acquire(self, name: str) -> None:
        """Block until it is ``name``'s turn (its first turn: until every running arm has arrived).

        Raises:
            TurnsAborted: another arm failed (at once, or while waiting).
            ValueError: ``name`` is not a running arm of these turns.
        """
        t0 = time.perf_counter()
        with self._cond:
            if name not in self._active and self._failed is None:
                raise ValueError(f"arm {name!r} is not a running arm of these turns ({', '.join(self.order)})")
            self._arrived.add(name)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._ready(name))
            if self._failed is not None:
                raise TurnsAborted(f"arm {name} stops: arm {self._failed} of its seed failed")
            self._holder = name
        self.waited_s[name] += time.perf_counter() - t0

    def release(self, name: str) -> None:
        """``name`` finished its step: the turn passes to the next running arm. No-op unless it holds the turn."""
        with self._cond:
            if self._holder == name:
                self._holder = None
                self._advance()
                self._cond.notify_all()

    def leave(self, name: str, failed: bool = False) -> None:
        """``name``'s run ended (``failed``: with an error): it leaves the rotation, the turn passes on if
        it was ``name``'s, and after a failure every waiting arm raises :class:`TurnsAborted`."""
        with self._cond:
            self._active.discard(name)
            if failed and self._failed is None:
                self._failed = name
            if self._holder == name:
                self._holder = None
            if self._holder is None and self.order[self._turn] == name:
                self._advance()
            self._cond.notify_all()

    def _advance(self) -> None:
        """Move the turn to the next running arm after the current one (unchanged when none runs)."""
        for k in range(1, len(self.order) + 1):
            i = (self._turn + k) % len(self.order)
            if self.order[i] in self._active:
                self._turn = i
                return


class TurnCallback(TrainingCallback):
    """SkyRL callback of arm ``name`` in ``turns``: waits for the turn before each step (``on_step_start``,
    outside SkyRL's step timer) and hands it on after the step's log (``on_log``)."""

    def __init__(self, turns: StepTurns, name: str):
        self.turns, self.name = turns, name

    def on_step_start(self, trainer, callback_input, control) -> None:
        self.turns.acquire(self.name)

    def on_log(self, trainer, callback_input, control) -> None:
        self.turns.release(self.name)


def run_in_turns(turns: StepTurns, trains: Sequence[Callable[[], None]]) -> None:
    """Run ``trains[i]`` (arm ``turns.order[i]``'s whole training, which takes turns through a
    :class:`TurnCallback`) each in a thread; return when all ended.

    Raises:
        ValueError: not one train per arm.
        BaseException: the first failing arm's own error (the others stop at their next turn).
    """
    if len(trains) != len(turns.order):
        raise ValueError(f"{len(trains)} trainings for {len(turns.order)} arms ({', '.join(turns.order)})")
    errors: dict[str, BaseException] = {}

    def body(name: str, train: Callable[[], None]) -> None:
        try:
            train()
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread below
            errors[name] = e
            turns.leave(name, failed=not isinstance(e, TurnsAborted))
        else:
            turns.leave(name)

    threads = [threading.Thread(target=body, args=(n, t), name=f"isoexec-arm-{n}", daemon=True)
               for n, t in zip(turns.order, trains)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors.values() if not isinstance(e, TurnsAborted)), None)
    if first is not None:
        raise first
