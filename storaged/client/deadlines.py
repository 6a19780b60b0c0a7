"""How long a client waits for one node before it asks another too (hedged requests).

A node that hangs (SIGSTOPped, swapping, a stuck disk) still accepts connections: the
kernel completes the handshake from its backlog, so a connect succeeds and the answer
never comes. Without a deadline a request waits out its read timeout (30 s) before it
fails over. Here a read-only request that has not answered within its deadline is sent
to the next candidate node as well; whichever answers first (and verifies, for chunk
bytes) is taken, the other is cancelled. The node that missed its deadline is ordered
last for ``slow_for`` seconds, so that later requests do not each pay the deadline.

Deadlines:

- a metadata request (cluster view, listing, status, plan, manifest, ``missing``):
  ``metadata`` seconds;
- a chunk or fragment read of ``n`` bytes: ``read_floor + n / (read_share * bw)``, where
  ``bw`` is the bandwidth one read has had so far in this client (bytes over seconds of
  the reads of at least ``_MIN_SAMPLE`` bytes, older reads weighing less), and
  ``bandwidth_prior`` before any such read. A read is hedged only once it runs four
  times slower than the reads before it, and never before ``read_floor``.

A hedge costs one more request of the same size (the bytes of a chunk read twice, the
first copy dropped), at most ``max_hedges`` per logical request. So a read past its deadline
whose bytes are still arriving (a byte within the last ``read_floor`` seconds) is not hedged
yet, until ``PROGRESS_CAP`` times its deadline: on a saturated link every read is slow
together and a hedge only takes bandwidth from the others (on 500 mbit links, 16 reads in
flight, hedges were 35 % of what the reader's link carried; docs/BENCHMARKS.md "On capped
links"). A hung node sends nothing and is hedged at its deadline as before. Writes are never
hedged: a PUT or a commit sent twice is not the same as once.

Every figure can be set through ``Client(deadlines=Deadlines(...))`` or, for the
defaults a ``Client`` takes (the CLI's), the ``STORAGED_*`` variables ``from_env`` reads.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Final

#: environment variable -> field of ``Deadlines``
ENV: Final = {
    "STORAGED_METADATA_DEADLINE": "metadata",
    "STORAGED_READ_DEADLINE": "read_floor",
    "STORAGED_READ_SHARE": "read_share",
    "STORAGED_READ_BANDWIDTH": "bandwidth_prior",
    "STORAGED_MAX_HEDGES": "max_hedges",
    "STORAGED_SLOW_FOR": "slow_for",
}

#: a read whose bytes still arrive is hedged at this many times its deadline at the latest
PROGRESS_CAP: Final = 4.0

# Reads smaller than this say more about latency than bandwidth: not measured.
_MIN_SAMPLE: Final = 256 * 1024
# Each new measurement keeps this share of the weight of those before it.
_DECAY: Final = 0.9


@dataclass(frozen=True, slots=True)
class Deadlines:
    """When a read-only request is also sent to the next node (see the module docstring)."""

    #: Seconds a metadata request may take before the next node is asked too.
    metadata: float = 1.5
    #: Seconds every chunk read may take whatever its size.
    read_floor: float = 1.0
    #: A read is late once its bandwidth falls below this share of the measured one.
    read_share: float = 0.25
    #: Bytes per second one read is assumed to get before any is measured.
    bandwidth_prior: float = 100e6
    #: Extra requests per logical request (0: never hedge).
    max_hedges: int = 2
    #: Seconds a node that missed a deadline is ordered after the others.
    slow_for: float = 60.0

    def __post_init__(self) -> None:
        if not self.metadata > 0 or not self.read_floor > 0:
            raise ValueError("metadata and read_floor deadlines must be > 0 seconds")
        if not 0 < self.read_share <= 1:
            raise ValueError("read_share must be in (0, 1]")
        if not self.bandwidth_prior > 0:
            raise ValueError("bandwidth_prior must be > 0 bytes per second")
        if self.max_hedges < 0 or self.slow_for < 0:
            raise ValueError("max_hedges and slow_for must be >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Deadlines:
        """The defaults, with any ``STORAGED_*`` variable of ``ENV`` that is set.

        ``ValueError`` naming the variable for a value that is not a number or is out
        of range."""
        env = os.environ if environ is None else environ
        given: dict[str, Any] = {}
        kinds = {f.name: f.type for f in fields(cls)}
        for var, name in ENV.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                given[name] = int(raw) if kinds[name] in (int, "int") else float(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r}: write a number") from None
        try:
            return replace(cls(), **given)
        except ValueError as exc:
            names = ", ".join(v for v, n in ENV.items() if n in given)
            raise ValueError(f"{names}: {exc}") from None


class Bandwidth:
    """The bandwidth one chunk read has had in this client: bytes over seconds of the
    reads so far, each new read weighing ``1 / (1 - _DECAY)`` times an old one."""

    def __init__(self, deadlines: Deadlines) -> None:
        self._deadlines = deadlines
        self._bytes = 0.0
        self._seconds = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        """Record a read of ``nbytes`` that took ``seconds`` (small reads are ignored)."""
        if nbytes < _MIN_SAMPLE or seconds <= 0:
            return
        self._bytes = self._bytes * _DECAY + nbytes
        self._seconds = self._seconds * _DECAY + seconds

    @property
    def measured(self) -> float | None:
        """Bytes per second, or None before any read was measured."""
        return self._bytes / self._seconds if self._seconds > 0 else None

    def deadline(self, nbytes: int) -> float:
        """Seconds a read of ``nbytes`` may take before the next holder is asked too."""
        d = self._deadlines
        rate = self.measured or d.bandwidth_prior
        return d.read_floor + max(0, nbytes) / (d.read_share * rate)


class Progress:
    """When an attempt last received bytes of its answer (``Requests.call`` gives each
    attempt one; the body readers ``note`` it)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        #: ``time.monotonic()`` of the last bytes received; None before any
        self.last: float | None = None

    def note(self) -> None:
        self.last = time.monotonic()


# Set in each attempt's own task (``Requests.call``): the attempt's ``Progress``.
_PROGRESS: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "progress", default=None
)


def attempt_progress() -> Progress | None:
    """In an attempt of ``Requests.call``: its ``Progress``, for a body reader to note."""
    return _PROGRESS.get()


def set_attempt_progress(progress: Progress) -> None:
    """``Requests.call``, in an attempt's own task."""
    _PROGRESS.set(progress)


class SlowNodes:
    """Nodes that missed a deadline, each ordered last until ``slow_for`` has passed."""

    def __init__(self, slow_for: float) -> None:
        self._slow_for = slow_for
        self._until: dict[str, float] = {}

    def mark(self, node: str) -> None:
        self._until[node] = time.monotonic() + self._slow_for

    def __contains__(self, node: object) -> bool:
        until = self._until.get(node) if isinstance(node, str) else None
        return until is not None and until > time.monotonic()

    def nodes(self) -> list[str]:
        """The nodes slow now."""
        now = time.monotonic()
        return [node for node, until in self._until.items() if until > now]
