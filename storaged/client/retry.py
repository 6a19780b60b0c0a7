"""When to try a request again, and how long to wait first.

Exponential backoff with full jitter (a uniform draw below the exponential
ceiling) so that many ranks hitting a busy cluster do not retry in lockstep; a
server's ``Retry-After`` is a floor on the wait, with a little jitter on top.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently a logical request is retried.

    A logical request makes at most ``max_attempts`` attempts and starts no new one
    after ``deadline`` seconds. Failing over to another node after a lost connection
    counts as an attempt but does not wait while untried nodes remain.
    """

    max_attempts: int = 8
    #: Ceiling of the first backoff; doubles per attempt up to ``max_delay``.
    base_delay: float = 0.05
    max_delay: float = 2.0
    #: A server's Retry-After is honoured up to this many seconds.
    max_retry_after: float = 30.0
    #: Seconds after which no new attempt starts.
    deadline: float = 120.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError("need 0 <= base_delay <= max_delay")
        if self.max_retry_after < 0 or self.deadline <= 0:
            raise ValueError("max_retry_after must be >= 0 and deadline > 0")

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """Full-jitter backoff before retry number ``retry`` (1 for the first retry)."""
        if retry < 1:
            raise ValueError("retry counts from 1")
        ceiling = min(self.max_delay, self.base_delay * 2 ** min(retry - 1, 62))
        return (rng or random).uniform(0.0, ceiling)

    def delay(
        self, retry: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before retry number ``retry``.

        With a ``retry_after`` from the server the wait is at least that (capped at
        ``max_retry_after``) plus up to ``base_delay`` of jitter; otherwise the
        full-jitter backoff.
        """
        if retry_after is None:
            return self.backoff(retry, rng)
        if retry < 1:
            raise ValueError("retry counts from 1")
        floor = min(max(0.0, retry_after), self.max_retry_after)
        return floor + (rng or random).uniform(0.0, self.base_delay)


NO_RETRY = RetryPolicy(max_attempts=1)
