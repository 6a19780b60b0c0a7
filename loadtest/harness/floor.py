"""The ack's CPU floor, part by part and role by role, from rates measured in the same run.

An acknowledged chunk cannot cost less than the work its path cannot avoid (issue 20 §1):

- the **client** stages the bytes: one copy into memory the node can take (co-located:
  leased shared memory; the hand-over itself is a few syscalls a chunk), or, remote, one
  BLAKE3 for the chunk's id and one loopback send of the body;
- the **entry node** (the node the client hands the chunk to) sends one copy to each
  holder other than itself, computing one CRC-32C that protects those transfers, and,
  remote, receives the body first;
- **every holder** hashes what it holds once (BLAKE3: a holder keeps nothing it has not
  checked against the id), and a holder that received the chunk from a peer receives it
  and checks its CRC-32C.

``FloorRates`` are those parts' CPU seconds per GB on one thread of this machine, measured
in the run that is compared against them (``measure_rates``); ``role_floors`` adds them up
per node for the chunks a save placed, from the holders the cluster reports (``?plan``) and
the entry each chunk had. The result is CPU seconds, to be set beside the CPU each process
spent during the save: how far each role is from its own floor, not only the total.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3
import crc32c

from loadtest.harness.machine import GB


@dataclass(frozen=True)
class FloorRates:
    """CPU seconds per GB, one thread, each measured here in this run."""

    copy: float  # one memcpy into buffers already faulted in
    blake3: float  # one BLAKE3 (the chunk id)
    crc32c: float  # one CRC-32C
    send: float  # one loopback send (the sender's side of raw TCP)
    recv: float  # one loopback receive (the receiver's side)

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in asdict(self).items()}


def _thread_seconds_per_gb(
    fn: Callable[[memoryview], object], view: memoryview, rounds: int
) -> float:
    """Best of three timed passes of ``rounds`` calls each (a shared machine's noise only
    adds), in thread CPU seconds per GB of ``view``."""
    fn(view)  # warm-up: first touch, lazy tables
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        for _ in range(rounds):
            fn(view)
        best = min(best, time.thread_time() - t0)
    return best / (rounds * len(view) / GB)


def measure_rates(
    sample: bytes | bytearray | memoryview,
    copy_s_per_gb: float,
    loopback: Mapping[str, Any],
    rounds: int = 16,
) -> FloorRates:
    """The parts' rates: BLAKE3 and CRC-32C over ``sample`` (one chunk) here; the copy and
    the loopback's two ends from measurements the caller made in the same run
    (``loopback``: ``raw_loopback``'s result)."""
    view = memoryview(sample).cast("B")
    return FloorRates(
        copy=copy_s_per_gb,
        blake3=_thread_seconds_per_gb(lambda v: blake3.blake3(v).digest(), view, rounds),
        crc32c=_thread_seconds_per_gb(crc32c.crc32c, view, rounds),
        send=float(loopback["client_cpu_s_per_gb"]),
        recv=float(loopback["server_cpu_s_per_gb"]),
    )


@dataclass
class RoleFloor:
    """The floor of one save, in CPU seconds: the client's and each node's."""

    client: float = 0.0
    nodes: dict[str, float] = field(default_factory=dict)
    #: bytes each node took in as the entry, and sent to peers (for the table's notes)
    entered: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.client + sum(self.nodes.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "client_cpu_s": round(self.client, 4),
            "node_cpu_s": {k: round(v, 4) for k, v in sorted(self.nodes.items())},
            "entered_bytes": dict(sorted(self.entered.items())),
            "sent_bytes": dict(sorted(self.sent.items())),
        }


def role_floors(
    holders: Mapping[str, Sequence[str]],
    sizes: Mapping[str, int],
    entry: Callable[[str, Sequence[str]], str],
    rates: FloorRates,
    *,
    colocated: bool,
    nodes: Sequence[str],
) -> RoleFloor:
    """What the save of the chunks in ``holders`` (chunk id -> the nodes holding it hot)
    cannot cost less than, per role. ``entry(chunk, holders)`` names the node the client
    handed the chunk to; ``colocated``: handed over in shared memory (a copy, no socket)
    rather than sent over HTTP (an id hash and a send on the client, a receive on the
    entry)."""
    floor = RoleFloor(nodes={n: 0.0 for n in nodes})
    for chunk, held in holders.items():
        gb = sizes[chunk] / GB
        first = entry(chunk, held)
        floor.entered[first] = floor.entered.get(first, 0) + sizes[chunk]
        if colocated:
            floor.client += gb * rates.copy
        else:
            floor.client += gb * (rates.blake3 + rates.send)
            floor.nodes[first] += gb * rates.recv
        peers = [h for h in held if h != first]
        floor.nodes[first] += gb * (rates.crc32c + rates.send * len(peers))
        floor.sent[first] = floor.sent.get(first, 0) + sizes[chunk] * len(peers)
        if first not in held:
            floor.nodes[first] += gb * rates.blake3  # it checks the id before sending on
        for holder in held:
            floor.nodes[holder] += gb * rates.blake3
        for peer in peers:
            floor.nodes[peer] += gb * (rates.recv + rates.crc32c)
    return floor


def floor_table(rows: Sequence[tuple[str, float, RoleFloor, float, Mapping[str, float]]]) -> str:
    """One line per save and role: CPU spent per acked GB against the floor per GB.

    ``rows``: (what, gb, floor, client CPU s, node CPU s by node name)."""
    lines = [
        "| save | role | CPU s/GB | floor s/GB | x floor |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for what, gb, floor, client_cpu, node_cpu in rows:
        spent = {"client": client_cpu, **node_cpu}
        floors = {"client": floor.client, **floor.nodes}
        for role in ["client", *sorted(node_cpu)]:
            lines.append(_floor_line(what, role, spent[role] / gb, floors.get(role, 0.0) / gb))
        lines.append(_floor_line(what, "all", sum(spent.values()) / gb, floor.total / gb))
    return "\n".join(lines)


def _floor_line(what: str, role: str, spent: float, floor: float) -> str:
    ratio = f"{spent / floor:.2f}" if floor > 0 else "-"
    return f"| {what} | {role} | {spent:.2f} | {floor:.2f} | {ratio} |"
