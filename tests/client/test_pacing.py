"""The upload window (``storaged.client.pacing``): how many bodies go at once, from a slow
start, halved by a 408 once per episode, grown back by accepted bodies, and no room lost to
a cancelled wait."""

from __future__ import annotations

import asyncio

import pytest

from storaged.client.documents import ClientStats
from storaged.client.errors import BodyTooSlow, NvmeFull, Unavailable
from storaged.client.pacing import ACCEPTED, INITIAL, OTHER, SLOW, UploadWindow, outcome_of


async def _take(window: UploadWindow, n: int) -> list[int]:
    return [await window.acquire() for _ in range(n)]


async def _waits(window: UploadWindow) -> asyncio.Task[int]:
    """An acquire that has started waiting (checked: it is not done)."""
    task = asyncio.ensure_future(window.acquire())
    await asyncio.sleep(0.01)
    assert not task.done(), "the window had room"
    return task


async def test_the_window_starts_full_and_a_body_past_it_waits_for_a_release() -> None:
    window = UploadWindow(3)
    episodes = await _take(window, 3)
    assert window.limit == 3 and window.in_flight == 3
    waiting = await _waits(window)
    window.release(episodes[0], OTHER)
    assert await asyncio.wait_for(waiting, 5) == 0
    assert window.in_flight == 3 and window.limit == 3  # OTHER says nothing of the link


async def test_a_wide_window_starts_slow_and_doubles_per_window_accepted_until_a_408() -> None:
    window = UploadWindow(64)
    assert window.limit == INITIAL == 8 and window.slow_start
    for episode in await _take(window, 8):
        window.release(episode, ACCEPTED)
    assert window.limit == 16
    for episode in await _take(window, 16):
        window.release(episode, ACCEPTED)
    assert window.limit == 32
    (episode,) = await _take(window, 1)
    window.release(episode, SLOW)  # the end of the slow start
    assert window.limit == 16 and not window.slow_start
    for episode in await _take(window, 16):
        window.release(episode, ACCEPTED)
    assert window.limit == 16  # 16 + 16 x 1/(16..17): not quite one more yet
    (episode,) = await _take(window, 1)
    window.release(episode, ACCEPTED)
    assert window.limit == 17


async def test_a_408_halves_the_window_once_per_episode() -> None:
    stats = ClientStats()
    window = UploadWindow(8, stats)
    first = await _take(window, 8)
    # Four bodies sent into the same congestion come back 408: one halving, not four.
    for episode in first[:4]:
        window.release(episode, SLOW)
    assert window.limit == 4 and stats.upload_window_halvings == 1
    # The rest of them were in flight before that halving: they count no more.
    for episode in first[4:]:
        window.release(episode, SLOW)
    assert window.limit == 4 and window.in_flight == 0
    # A body sent after the halving, refused again: a new episode, halved again.
    (later,) = await _take(window, 1)
    window.release(later, SLOW)
    assert window.limit == 2 and stats.upload_window_halvings == 2
    for _ in range(3):  # and never below one (where a 408 narrows it no more)
        (later,) = await _take(window, 1)
        window.release(later, SLOW)
    assert window.limit == 1 and stats.upload_window_halvings == 3


async def test_accepted_bodies_grow_the_window_by_one_per_window_up_to_the_ceiling() -> None:
    window = UploadWindow(4)
    (episode,) = await _take(window, 1)
    window.release(episode, SLOW)
    (episode,) = await _take(window, 1)
    window.release(episode, SLOW)
    assert window.limit == 1
    (episode,) = await _take(window, 1)
    window.release(episode, ACCEPTED)  # 1 + 1/1
    assert window.limit == 2
    for episode in await _take(window, 2):
        window.release(episode, ACCEPTED)  # + 1/2, + 1/2.5
    assert window.limit == 2  # 2.9: a whole window of two is not yet accepted at 2.5
    (episode,) = await _take(window, 1)
    window.release(episode, ACCEPTED)
    assert window.limit == 3
    for _ in range(20):
        (episode,) = await _take(window, 1)
        window.release(episode, ACCEPTED)
    assert window.limit == 4  # the ceiling: max_concurrency


async def test_a_narrower_window_holds_back_bodies_until_enough_are_done() -> None:
    window = UploadWindow(4)
    episodes = await _take(window, 4)
    window.release(episodes[0], SLOW)  # limit 2, three still in flight
    waiting = await _waits(window)
    window.release(episodes[1], OTHER)  # two in flight: still no room under 2
    await asyncio.sleep(0.01)
    assert not waiting.done()
    window.release(episodes[2], OTHER)
    assert await asyncio.wait_for(waiting, 5) == 1  # taken in the new episode
    assert window.in_flight == 2


async def test_a_cancelled_wait_passes_its_room_on() -> None:
    window = UploadWindow(1)
    (episode,) = await _take(window, 1)
    first, second = await _waits(window), await _waits(window)
    window.release(episode, OTHER)  # wakes the first...
    first.cancel()  # ...which is cancelled before it runs: the second gets the room
    assert await asyncio.wait_for(second, 5) == 0
    with pytest.raises(asyncio.CancelledError):
        await first
    assert window.in_flight == 1


def test_a_window_needs_room_for_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        UploadWindow(0)


async def test_outcomes_of_attempts() -> None:
    loop = asyncio.get_running_loop()

    def settled(error: BaseException | None) -> asyncio.Future[object]:
        fut: asyncio.Future[object] = loop.create_future()
        if error is None:
            fut.set_result("answer")
        else:
            fut.set_exception(error)
        return fut

    assert outcome_of(settled(None)) == ACCEPTED
    assert outcome_of(settled(BodyTooSlow(status=408, code="body_too_slow"))) == SLOW
    assert outcome_of(settled(Unavailable(message="no node"))) == OTHER
    assert outcome_of(settled(NvmeFull(status=507, code="nvme_full"))) == OTHER
    assert outcome_of(settled(ConnectionResetError())) == OTHER
    cancelled: asyncio.Future[object] = loop.create_future()
    cancelled.cancel()
    assert outcome_of(cancelled) == OTHER
