"""The blocked-event-loop guard of tests/conftest.py: what it counts as the loop's own work.

A loop thread that waits for a worker thread of the default executor to start stands in
``Thread.start`` (it waits until the OS runs the new thread): on a starved machine that
took over 0.5 s, and it is scheduling, not a block by the code under test; so is a loop
that waits in an executor's ``submit`` for the lock such a start holds. Anything else in
``threading`` (a lock of the code taken in the loop, say) still counts. Nor does the cyclic garbage
collector's time in the loop thread count: its length is the process's heap.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import thread as cf_thread
from typing import Any

import pytest

from tests.conftest import _BLOCKED, _guarded_loop, _in_loop_machinery


def test_an_executor_starting_a_worker_is_loop_machinery(monkeypatch: pytest.MonkeyPatch) -> None:
    frames: list[types.FrameType] = []
    start = threading.Thread.start

    def recording_start(self: threading.Thread) -> None:
        frames.append(sys._getframe())
        start(self)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(lambda: 7).result() == 7
    monkeypatch.undo()
    assert frames, "the executor started no thread"
    assert _in_loop_machinery(frames[0])

    # A thread started by the code itself, or a wait on a lock, is not.
    own: list[types.FrameType] = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: own.append(sys._getframe()))
    threading.Thread(target=lambda: None).start()
    monkeypatch.undo()
    assert own and not _in_loop_machinery(own[0])
    assert not _in_loop_machinery(sys._getframe())


def test_a_child_watcher_starting_its_thread_is_loop_machinery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A subprocess started from the loop: asyncio's child watcher starts a thread to wait
    for it, and the loop waits for that thread to run (soak run 39's teardown, at load 15)."""
    frames: list[types.FrameType] = []
    start = threading.Thread.start

    def recording_start(self: threading.Thread) -> None:
        frames.append(sys._getframe())
        start(self)

    async def run_true() -> int:
        proc = await asyncio.create_subprocess_exec("true")
        return await proc.wait()

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    assert asyncio.run(run_true()) == 0
    monkeypatch.undo()
    assert frames, "no thread was started for the subprocess"
    assert any(_in_loop_machinery(f) for f in frames)


def _hold_loop(hold: Callable[[], object]) -> list[str]:
    """Run ``hold()`` in a coroutine on a guarded loop; what the guard reported (cleared)."""

    async def main() -> None:
        await asyncio.sleep(0.2)  # the watchdog sees the loop running, beating
        hold()
        await asyncio.sleep(0.1)

    loop = _guarded_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    reported = list(_BLOCKED)
    _BLOCKED.clear()
    return reported


def test_a_long_garbage_collection_in_the_loop_is_not_a_block() -> None:
    """A collection that holds the loop for 0.8 s (made long by a gc callback, as
    hypothesis's runs in every collection) is the interpreter's work: not reported."""

    def slow_callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            time.sleep(0.8)

    gc.callbacks.append(slow_callback)
    try:
        reported = _hold_loop(gc.collect)
    finally:
        gc.callbacks.remove(slow_callback)
    assert reported == []


def test_the_loop_held_as_long_by_the_code_is_a_block() -> None:
    """The control: the same 0.8 s in the code (a sleep standing for blocking I/O) is."""
    reported = _hold_loop(lambda: time.sleep(0.8))
    assert len(reported) == 1 and "loop blocked for over" in reported[0]
    assert "_hold_loop" in reported[0] or "<lambda>" in reported[0]


def _held_by_another_thread(lock: Any, seconds: float) -> None:
    """Returns once another thread holds ``lock``, which it lets go after ``seconds``."""
    taken = threading.Event()

    def holder() -> None:
        with lock:
            taken.set()
            time.sleep(seconds)

    threading.Thread(target=holder, daemon=True).start()
    taken.wait(10)


def test_waiting_for_the_executors_lock_while_another_thread_starts_a_worker_is_not_a_block() -> (
    None
):
    """Every executor's ``submit`` takes one lock the process's executors share, and holds it
    while it starts a worker: a DCP executor in the test's thread held it past 0.5 s on a
    starved machine, and the loop's ``to_thread`` waited (a full run, stop 29). Here another
    thread holds that lock 0.8 s while the loop submits."""

    def submit_while_held() -> None:
        _held_by_another_thread(cf_thread._global_shutdown_lock, 0.8)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(lambda: 7).result() == 7

    assert _hold_loop(submit_while_held) == []


def test_waiting_in_the_loop_for_a_lock_of_the_code_is_a_block() -> None:
    """The control: the loop waiting 0.8 s for a lock the code's other thread holds is."""
    lock = threading.Lock()

    def wait_for_lock() -> None:
        _held_by_another_thread(lock, 0.8)
        with lock:
            pass

    reported = _hold_loop(wait_for_lock)
    assert len(reported) == 1 and "wait_for_lock" in reported[0]
