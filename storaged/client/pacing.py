"""How many chunk bodies one client uploads at once: the upload window.

A node refuses a body that trickles in slower than its ``body_min_rate`` (408
``body_too_slow``, API.md E4). That happens when the client's own link is oversubscribed:
64 PUTs sharing a 500 Mbit/s link each get a 64th of it, and the bodies that fall behind
are refused and sent again, which costs the link their bytes twice. So the window paces
the uploads as TCP paces a congested path (additive increase, multiplicative decrease):

- it never exceeds the client's ``max_concurrency``, and starts at ``INITIAL`` bodies (the
  client's default ``max_concurrency``) or at ``max_concurrency``, whichever is smaller;
- until the first 408 (slow start), each body accepted grows it by one: it doubles with
  each window of bodies accepted. Started at a wide ``max_concurrency`` (64 PUTs on a
  500 Mbit/s link), all the bodies shared the link alike, all came near the node's budget
  together and most of the first wave was refused (docs/BENCHMARKS.md);
- a 408 halves it (not below one), once per episode: the 408s of bodies that started
  before that halving were sent into the same congestion and do not halve it again;
- after that, each body accepted grows it by 1/window, so a whole window of bodies accepted
  grows it by one, back towards ``max_concurrency``.

Other failures (a node gone, a full disk, a 503) say nothing about the client's link and
leave the window as it is. Only ``paced`` requests take it (``Requests.call``: the chunk
PUTs), each attempt made in a request slot; a hedge, which races an attempt already in,
would not (writes are not hedged).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Final

from storaged.client.documents import ClientStats
from storaged.client.errors import BodyTooSlow

#: the window's start (slow start grows it from there): the client's default max_concurrency
INITIAL: Final = 8
#: what an attempt's outcome says of the link
SLOW: Final = "slow"
ACCEPTED: Final = "accepted"
OTHER: Final = "other"


def outcome_of(attempt: asyncio.Future[Any]) -> str:
    """``SLOW`` for a body refused as too slow, ``ACCEPTED`` for an answer, else ``OTHER``."""
    if attempt.cancelled():
        return OTHER
    error = attempt.exception()
    if error is None:
        return ACCEPTED
    return SLOW if isinstance(error, BodyTooSlow) else OTHER


class UploadWindow:
    """The bodies in flight, at most ``limit`` (between 1 and ``ceiling``). One event loop.
    Each halving counts in ``stats.upload_window_halvings``."""

    def __init__(self, ceiling: int, stats: ClientStats | None = None) -> None:
        if ceiling < 1:
            raise ValueError("an upload window needs a ceiling of at least 1")
        self.ceiling = ceiling
        self.stats = stats if stats is not None else ClientStats()
        self._limit = float(min(ceiling, INITIAL))
        #: no 408 yet: each accepted body grows the window by one
        self.slow_start = True
        self.in_flight = 0
        self._episode = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def limit(self) -> int:
        """Bodies that may be in flight now."""
        return int(self._limit)

    async def acquire(self) -> int:
        """Wait for room, take it; the episode to hand back to ``release``."""
        while self.in_flight >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # it was woken for room it will not take: pass it on
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.in_flight += 1
        return self._episode

    def release(self, episode: int, outcome: str) -> None:
        """A body taken in ``episode`` is done, with ``outcome`` (``outcome_of``)."""
        self.in_flight -= 1
        if outcome == SLOW and episode == self._episode:
            self._episode += 1
            self.slow_start = False
            if self._limit > 1.0:
                self._limit = max(1.0, self._limit / 2)
                self.stats.upload_window_halvings += 1
        elif outcome == ACCEPTED:
            grow = 1.0 if self.slow_start else 1.0 / self._limit
            self._limit = min(float(self.ceiling), self._limit + grow)
        self._wake()

    def _wake(self) -> None:
        room = self.limit - self.in_flight
        for waiter in self._waiters:
            if room <= 0:
                break
            if not waiter.done():
                waiter.set_result(None)
                room -= 1
