"""Arms taking turns step by step (``rl.interleave: step``, :mod:`isoexec.rl.skyrl.turns`): threads that fire
SkyRL's callback events in ``RayPPOTrainer.train``'s order step in the arms' order, one at a time, and wait
only outside their steps; an arm that fails ends the others and its own error surfaces; SkyRL fires the
two events where the turns need them."""

import inspect
import threading
import time

import pytest

pytest.importorskip("skyrl", reason="the skyrl extra is not installed")

from isoexec.rl.skyrl.turns import StepTurns, TurnCallback, TurnsAborted, run_in_turns  # noqa: E402

pytestmark = pytest.mark.timeout(60)  # a deadlock fails the test instead of hanging the suite


def _arm_loop(turns, name, steps, events, lock, start_delay=0.0, fail_at=None, step_s=0.002):
    """One arm's training as SkyRL's loop fires it: on_step_start, the timed step, on_log (per step)."""
    cb = TurnCallback(turns, name)

    def train():
        time.sleep(start_delay)  # start-up (engines, workers, the first weight sync)
        for k in range(steps):
            cb.on_step_start(None, None, None)
            with lock:
                events.append(("open", name, k, time.perf_counter()))
            if k == fail_at:
                raise RuntimeError(f"{name} broke at step {k}")
            time.sleep(step_s)
            with lock:
                events.append(("close", name, k, time.perf_counter()))
            cb.on_log(None, None, None)

    return train


def _steps(events):
    return [(name, k) for what, name, k, _ in events if what == "open"]


def test_arms_step_in_turns_one_at_a_time_after_every_start_up():
    names = ["native", "isoexec", "native-tis"]
    turns, events, lock = StepTurns(names), [], threading.Lock()
    # the last arm starts up slowest: nobody's step 0 may begin before it has arrived
    trains = [_arm_loop(turns, n, 4, events, lock, start_delay=0.15 if n == "native-tis" else 0.0) for n in names]
    t0 = time.perf_counter()
    run_in_turns(turns, trains)
    assert _steps(events) == [(n, k) for k in range(4) for n in names]
    # steps never overlap: every open is followed by the same step's close
    assert [(e[0], e[1], e[2]) for e in events] == [(w, n, k) for k in range(4) for n in names for w in ("open", "close")]
    assert events[0][3] - t0 >= 0.15
    # the waits are the gaps between an arm's steps (every arm waited for the two others), never inside its step
    assert all(w > 0 for w in turns.waited_s.values())


def test_an_arm_failing_mid_run_ends_the_others_with_its_own_error():
    names = ["a", "b", "c"]
    turns, events, lock = StepTurns(names), [], threading.Lock()
    trains = [_arm_loop(turns, n, 5, events, lock, fail_at=2 if n == "b" else None) for n in names]
    with pytest.raises(RuntimeError, match="b broke at step 2"):
        run_in_turns(turns, trains)
    # b's step 2 opened and broke; c never began step 2 (it stopped at its turn), and a no step 3
    assert _steps(events)[-1] == ("b", 2) and ("c", 2) not in _steps(events) and ("a", 3) not in _steps(events)
    with pytest.raises(TurnsAborted, match="arm b of its seed failed"):
        turns.acquire("a")


def test_an_arm_ending_early_leaves_the_rotation():
    names = ["a", "b"]
    turns, events, lock = StepTurns(names), [], threading.Lock()
    run_in_turns(turns, [_arm_loop(turns, "a", 1, events, lock), _arm_loop(turns, "b", 3, events, lock)])
    assert _steps(events) == [("a", 0), ("b", 0), ("b", 1), ("b", 2)]


def test_turns_refuse_bad_arms():
    with pytest.raises(ValueError, match=r"distinct arm names, got \['a', 'a'\]"):
        StepTurns(["a", "a"])
    turns = StepTurns(["a", "b"])
    with pytest.raises(ValueError, match="arm 'z' is not a running arm of these turns"):
        turns.acquire("z")
    with pytest.raises(ValueError, match="1 trainings for 2 arms"):
        run_in_turns(turns, [lambda: None])


def test_skyrl_waits_for_the_turn_outside_its_step_timer():
    """The turns rely on SkyRL 0.4's loop: on_step_start before ``Timer("step")`` opens, on_log after the
    step (weight sync included) closed; a SkyRL that moves either event fails here."""
    from skyrl.train.trainer import RayPPOTrainer

    src = inspect.getsource(RayPPOTrainer.train)
    start, step = src.index('self._fire("on_step_start")'), src.index('with Timer("step", self.all_timings)')
    sync = src.index('with Timer("sync_weights", self.all_timings)', step)
    log = src.index('self._fire("on_log", logs=log_payload)')
    assert start < step < sync < log
    # on_log is outside the step block: its indentation is the step block's own, not deeper
    indent = lambda i: i - src.rindex("\n", 0, i) - 1  # noqa: E731
    assert indent(log) == indent(step)
