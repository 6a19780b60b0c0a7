"""``pipeline.ChunkWorkers``, the queue and workers drain, encode and rebalance share:
a chunk offered while pending is queued once, a failure is the stage's to handle and
never stops a worker, and ``close`` ends the workers."""

from __future__ import annotations

import asyncio

from storaged.node.pipeline import ChunkWorkers


class Stage(ChunkWorkers):
    def __init__(self, **options: bool) -> None:
        super().__init__("test", 1, **options)
        self.gate = asyncio.Event()
        self.handled: list[str] = []
        self.failures: list[tuple[str, str]] = []
        self.counts: list[tuple[str, int]] = []

    async def handle(self, chunk_id: str) -> None:
        await self.gate.wait()
        self.handled.append(chunk_id)
        if chunk_id.startswith("bad"):
            raise ValueError(chunk_id)

    def failed(self, chunk_id: str, exc: Exception) -> None:
        self.failures.append((chunk_id, str(exc)))

    def offered(self, chunk_id: str) -> None:
        self.counts.append(("offered", self.pending))

    def taken(self, chunk_id: str) -> None:
        self.counts.append(("taken", self.pending))


async def _settle(stage: Stage) -> None:
    for _ in range(100):
        if not stage.queued:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)


async def test_a_pending_chunk_is_queued_once_until_taken() -> None:
    stage = Stage()
    stage.offer("a")
    stage.offer("a")
    assert stage.queued == 1 and stage.pending == 1
    stage.start()
    await asyncio.sleep(0.01)  # taken, waiting at the gate: no longer pending
    assert stage.pending == 0
    stage.offer("a")  # queued again while the first turn is under way
    assert stage.queued == 1
    stage.gate.set()
    await _settle(stage)
    assert stage.handled == ["a", "a"]
    assert stage.counts[:2] == [("offered", 1), ("taken", 0)]
    await stage.close()


async def test_pending_while_handled_keeps_a_chunk_out_until_its_turn_ends() -> None:
    stage = Stage(pending_while_handled=True)
    stage.start()
    stage.offer("a")
    await asyncio.sleep(0.01)
    stage.offer("a")  # still being handled: not queued again
    assert stage.queued == 0 and stage.pending == 1
    stage.gate.set()
    await _settle(stage)
    assert stage.handled == ["a"] and stage.pending == 0
    await stage.close()


async def test_without_dedup_every_offer_is_queued() -> None:
    stage = Stage(dedup=False)
    stage.offer("a")
    stage.offer("a")
    assert stage.queued == 2 and stage.pending == 0


async def test_a_failure_goes_to_the_stage_and_the_worker_goes_on() -> None:
    stage = Stage()
    stage.gate.set()
    stage.start()
    for chunk_id in ("bad-1", "a", "bad-2", "b"):
        stage.offer(chunk_id)
    await _settle(stage)
    assert stage.handled == ["bad-1", "a", "bad-2", "b"]
    assert stage.failures == [("bad-1", "bad-1"), ("bad-2", "bad-2")]
    await stage.close()
    stage.offer("c")
    await asyncio.sleep(0.02)
    assert stage.handled[-1] == "b"  # closed: no worker takes it
