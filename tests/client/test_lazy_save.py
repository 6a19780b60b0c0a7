"""``AsyncSaver``'s lazy saves (the copy runs behind the caller, the optimizer's step waits
for it) and its staging budget (a state larger than the budget staged in waves), against
real nodes in the test's own event loop, with a real ``torch.optim`` optimizer on CPU tensors.

The copies are slowed down where a test needs the step to come early: the step must then
wait, and the checkpoint must hold the values of the step it was taken at, never a mix.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from storaged.client import checkpoint
from storaged.client.checkpoint import (
    AsyncSaver,
    Shard,
    StagingBuffer,
    _lay_out,
    _plan_waves,
    _stage_wave,
    restore_checkpoint,
    stage_shard,
)
from storaged.client.client import Client
from storaged.client.errors import Unavailable
from storaged.wire import BytesLike
from tests.conftest import TOKEN
from tests.service.inproc import InprocFactory

pytestmark = pytest.mark.timeout(120)

torch = pytest.importorskip("torch")


# --------------------------------------------------------------------------- waves, unit


def awkward_state() -> dict[str, Any]:
    """Small and large items, a strided and a big-endian array, a large msgpack value."""
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((64, 90))
    return {
        "small": np.arange(7, dtype=np.int16),
        "big": rng.standard_normal(5000).astype(np.float32),
        "strided": wide[:, ::3],
        "swapped": np.arange(3001, dtype=">i8"),
        "blob": bytes(range(256)) * 40,
        "step": 11,
    }


@pytest.mark.parametrize("limit", [1, 1000, 4096, 5000, 12345, 1 << 20])
def test_waves_stage_the_bytes_a_whole_copy_stages(limit: int) -> None:
    state = awkward_state()
    ranks = {0: state, 3: {"x": np.ones((40, 40)), "y": 1.5}}
    whole = {rank: stage_shard(rank, s, 1000, StagingBuffer()) for rank, s in ranks.items()}
    layouts = [_lay_out(rank, s, 1000) for rank, s in ranks.items()]
    waves = _plan_waves(layouts, limit)
    got: dict[int, list[bytes]] = {rank: [] for rank in ranks}
    for wave in waves:
        staging = StagingBuffer()
        parts = _stage_wave(layouts, wave, staging)
        assert staging.capacity <= max(limit, 1000)  # a chunk over the limit goes alone
        for (index, lo, hi), chunks in parts:
            assert len(chunks) == hi - lo
            got[layouts[index].rank].extend(bytes(c) for c in chunks)
    for rank, staged in whole.items():
        assert got[rank] == [bytes(c) for c in staged.chunks]


# --------------------------------------------------------------------------- fixtures


@asynccontextmanager
async def client_of(inproc: InprocFactory, **settings: Any) -> AsyncIterator[Client]:
    cluster = await inproc.start(4, **settings)
    async with Client(cluster.urls, token=TOKEN) as client:
        yield client


@pytest.fixture(scope="module", autouse=True)
def warm_optimizer() -> None:
    """torch imports what an optimizer's first step needs on that step (seconds on a loaded
    machine): done here, off the tests' event loops, whose watchdog would take it for a
    blocked loop."""
    _, optimizer = model(0, size=8)
    optimizer.step()


def model(seed: int, size: int = 1 << 20) -> Any:
    """A few CPU parameters (float32) and an SGD optimizer whose step moves every one."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (size, size // 2, 333)]
    for p in params:
        p.grad = torch.ones_like(p)
    return params, torch.optim.SGD(params, lr=1.0)


def state_of(params: Sequence[Any]) -> dict[str, Any]:
    """The parameters as numpy views of their memory (no copy), as a saver sees them."""
    return {f"p{i}": p.detach().numpy() for i, p in enumerate(params)}


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every item copied into staging memory first sleeps 50 ms in its thread (so the step
    certainly comes early); the times the copies ended."""
    ended: list[float] = []
    copy = checkpoint._copy_item

    def slow(item: Any, into: Any) -> None:
        time.sleep(0.05)
        copy(item, into)
        ended.append(time.monotonic())

    monkeypatch.setattr(checkpoint, "_copy_item", slow)
    return ended


async def restored(client: Client, name: str) -> dict[str, Any]:
    return await restore_checkpoint(client, name)


# --------------------------------------------------------------------------- lazy saves


async def test_a_step_on_the_loop_waits_for_the_lazy_copy(
    inproc: InprocFactory, slow_copies: list[float]
) -> None:
    """The training loop runs on the event loop's thread: ``step`` blocks it until the copy
    threads are done, and every checkpoint holds exactly the values of its step."""
    params, optimizer = model(1)
    async with client_of(inproc) as client, AsyncSaver(client) as saver:
        hook = saver.hold_optimizer(optimizer)
        expected, handles = {}, []
        for step in range(3):
            expected[step] = {k: v.copy() for k, v in state_of(params).items()}
            handle = await saver.save(f"lazy/{step}", {0: state_of(params)}, lazy=True)
            assert len(slow_copies) == 3 * step  # returned before this save copied anything
            optimizer.step()  # early: the copy takes at least 150 ms
            assert len(slow_copies) == 3 * (step + 1)  # the step ran after every copy
            handles.append(handle)
        for handle in handles:
            await handle.staged()
            assert (await handle.acked()).commit is not None
        hook.remove()
        for step, values in expected.items():
            back = await restored(client, f"lazy/{step}")
            for key, value in values.items():
                assert np.array_equal(back[key], value), (step, key)
        assert not np.array_equal(state_of(params)["p0"], expected[2]["p0"])


async def test_a_training_thread_with_a_budget_steps_after_every_wave(
    inproc: InprocFactory, slow_copies: list[float]
) -> None:
    """The usual shape: training on its own thread, the saver's loop free. With a budget of
    a fraction of the state the copy runs in waves; the step waits for the last one."""
    params, optimizer = model(2)
    total = sum(p.numel() * 4 for p in params)
    async with (
        client_of(inproc) as client,
        AsyncSaver(client, staging_budget=total // 3, chunk_size=256 << 10) as saver,
    ):
        saver.hold_optimizer(optimizer)
        loop = asyncio.get_running_loop()
        expected: dict[int, dict[str, Any]] = {}
        handles: list[Any] = []

        def train() -> None:
            for step in range(3):
                expected[step] = {k: v.copy() for k, v in state_of(params).items()}
                save = saver.save(f"waves/{step}", {0: state_of(params)}, lazy=True)
                handles.append(asyncio.run_coroutine_threadsafe(save, loop).result(30))
                optimizer.step()
                # every wave was copied before the step went on
                assert all(gate.is_open() for gate in saver._copying)

        await asyncio.to_thread(train)
        for handle in handles:
            assert (await handle.acked()).commit is not None
        for step, values in expected.items():
            back = await restored(client, f"waves/{step}")
            for key, value in values.items():
                assert np.array_equal(back[key], value), (step, key)


async def test_a_loop_thread_step_cannot_wait_for_waves_it_would_block(
    inproc: InprocFactory, slow_copies: list[float]
) -> None:
    """On the loop's thread the hook refuses (no deadlock) while waves still copy; after
    ``await saver.staged()`` the step goes through."""
    params, optimizer = model(3)
    total = sum(p.numel() * 4 for p in params)
    async with (
        client_of(inproc) as client,
        AsyncSaver(client, staging_budget=total // 3, chunk_size=256 << 10) as saver,
    ):
        saver.hold_optimizer(optimizer)
        before = {k: v.copy() for k, v in state_of(params).items()}
        handle = await saver.save("refused/0", {0: state_of(params)}, lazy=True)
        with pytest.raises(RuntimeError, match=r"await saver\.staged"):
            optimizer.step()
        assert np.array_equal(state_of(params)["p0"], before["p0"])  # the hook ran first
        await saver.staged()
        optimizer.step()
        await handle.acked()
        back = await restored(client, "refused/0")
        assert all(np.array_equal(back[k], v) for k, v in before.items())


async def test_a_budget_save_not_lazy_returns_once_all_waves_are_copied(
    inproc: InprocFactory,
) -> None:
    rng = np.random.default_rng(4)
    a, t = rng.standard_normal((512, 300)), rng.standard_normal((64, 64))[:, ::2]
    state: dict[str, Any] = {"a": a, "b": np.arange(10), "step": 3, "t": Shard(t, (64, 32), (0, 0))}
    async with (
        client_of(inproc) as client,
        AsyncSaver(client, staging_budget=200_000, chunk_size=64 << 10) as saver,
    ):
        prepared = await saver.prepare({0: state})
        assert prepared == 2 * 100_000
        source = {"a": a.copy(), "t": t.copy()}
        handle = await saver.save("budget/0", {0: state})
        a[...] = 0  # allowed: save returned
        t[...] = 0
        result = await handle.acked()
        assert result.commit is not None and handle.staged_bytes > 6 * 200_000
        back = await restored(client, "budget/0")
        assert np.array_equal(back["a"], source["a"]) and np.array_equal(back["t"], source["t"])
        assert back["step"] == 3 and np.array_equal(back["b"], np.arange(10))


async def test_lazy_saves_of_several_ranks_with_and_without_a_budget(
    inproc: InprocFactory, slow_copies: list[float]
) -> None:
    """Two ranks' boxes of one array and a replicated one, lazily: the copies of both ranks
    (a thread each, or waves crossing from one rank's stream to the next) end before
    ``staged`` returns; the state changes right after, and each checkpoint restores whole."""
    rng = np.random.default_rng(8)
    g = rng.standard_normal((400, 300))
    bias = np.arange(300.0)
    async with client_of(inproc) as client:
        for budget in (None, 300_000):
            states = {
                r: {"g": Shard(g[r * 200 : (r + 1) * 200], g.shape, (r * 200, 0)), "b": bias}
                for r in range(2)
            }
            before = g.copy()
            async with AsyncSaver(client, staging_budget=budget, chunk_size=64 << 10) as saver:
                handle = await saver.save(f"ranks/{budget}", states, lazy=True)
                await saver.staged()
                g += 1.0  # the next step
                result = await handle.acked()
                assert sorted(result.shards) == [0, 1] and result.commit is not None
            back = await restored(client, f"ranks/{budget}")
            assert np.array_equal(back["g"], before) and np.array_equal(back["b"], bias)


# --------------------------------------------------------------------------- failures


class FailingPuts(Client):
    """A real client whose chunk uploads fail (as with too few live nodes)."""

    async def put_chunks(
        self, chunks: Sequence[BytesLike], chunk_ids: Sequence[str] | None = None
    ) -> list[str]:
        raise Unavailable(message="refused by the test")

    async def put_chunk(self, data: BytesLike, chunk_id: str | None = None) -> str:
        raise Unavailable(message="refused by the test")


async def test_an_upload_failing_after_a_lazy_copy_neither_blocks_nor_hides(
    inproc: InprocFactory,
) -> None:
    cluster = await inproc.start(4)
    params, optimizer = model(5, size=1 << 16)
    for budget in (None, 300_000):
        async with FailingPuts(cluster.urls, token=TOKEN, shm=False) as client:
            saver = AsyncSaver(client, staging_budget=budget, chunk_size=64 << 10, shm=False)
            saver.hold_optimizer(optimizer)
            handle = await saver.save("failed/lazy", {0: state_of(params)}, lazy=True)
            if budget is None:
                optimizer.step()  # the copy needs no loop: the step waits, then goes on
            with pytest.raises(Unavailable):
                await asyncio.wait_for(handle.acked(), 30)
            if budget is not None:  # the first wave's upload failed: copying stopped
                with pytest.raises(Unavailable):
                    await handle.staged()
            optimizer.step()  # not blocked by the failed save
            await asyncio.wait_for(saver.aclose(), 30)
            assert await client.list("failed/") == []


async def test_a_failed_copy_is_reported_and_the_saver_recovers(
    inproc: InprocFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    params, optimizer = model(6, size=1 << 16)

    def broken(item: Any, into: Any) -> None:
        raise MemoryError("copy failed in the test")

    async with client_of(inproc) as client, AsyncSaver(client) as saver:
        saver.hold_optimizer(optimizer)
        with monkeypatch.context() as patch:
            patch.setattr(checkpoint, "_copy_item", broken)
            handle = await saver.save("broken/0", {0: state_of(params)}, lazy=True)
            optimizer.step()  # the failed copy does not hold the step
            with pytest.raises(MemoryError):
                await handle.staged()
            with pytest.raises(MemoryError):
                await handle.acked()
        # its staging buffers came back: the next save is not stuck behind it
        after = {k: v.copy() for k, v in state_of(params).items()}
        handle = await asyncio.wait_for(saver.save("broken/1", {0: after}, lazy=True), 10)
        await handle.acked()
        assert [c.name for c in await client.list("broken/")] == ["broken/1"]
        back = await restored(client, "broken/1")
        assert all(np.array_equal(back[k], v) for k, v in after.items())


async def test_aclose_right_after_a_lazy_save_waits_for_its_copy_and_upload(
    inproc: InprocFactory, slow_copies: list[float]
) -> None:
    params, _ = model(7, size=1 << 16)
    before = {k: v.copy() for k, v in state_of(params).items()}
    async with client_of(inproc) as client:
        saver = AsyncSaver(client)
        handle = await saver.save("closed/0", {0: state_of(params)}, lazy=True)
        assert not slow_copies  # nothing copied yet
        await saver.aclose()
        assert len(slow_copies) == 3 and handle.done()
        assert (await handle.acked()).commit is not None
        back = await restored(client, "closed/0")
        assert all(np.array_equal(back[k], v) for k, v in before.items())


async def test_a_lazy_save_still_refuses_a_bad_state_at_once(inproc: InprocFactory) -> None:
    async with client_of(inproc) as client, AsyncSaver(client) as saver:
        with pytest.raises(TypeError):
            await saver.save("bad/0", {0: {"x": object()}}, lazy=True)
        handle = await saver.save("bad/1", {0: {"x": np.ones(3)}}, lazy=True)
        await handle.acked()


def test_threads_see_the_gate_open_without_the_loop() -> None:
    """The gate opens in the copy's own thread: a thread blocked on it needs no loop turn."""

    async def main() -> None:
        gate = checkpoint._StagingGate(asyncio.get_running_loop(), 2, needs_loop=False)
        threads = [threading.Thread(target=gate.part_done) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert gate.is_open() and gate.wait_blocking() is None  # the loop has not run
        await gate.wait()

    asyncio.run(main())
