"""PyTorch Distributed Checkpoint on storaged: dcp.save / async_save / load against a real cluster.

The nodes are in-process (``inproc_cluster``: real nodes in the test's event loop). DCP's
writer and reader are synchronous (each runs its own event loop in a worker thread and
blocks its caller until it is done), so every DCP call, and the ``storaged`` command's
``main``, runs in a thread (``asyncio.to_thread``) while the nodes keep serving in the
test's loop.

The multi-process test runs this module as a script (``python -m tests.client.test_dcp
CONFIG``): each process is one gloo rank on 127.0.0.1, against the same in-process nodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future as ConcurrentFuture
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import (
    _load_state_dict_from_keys as dcp_load_whole,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from storaged.client import CheckpointNotFound, Client
from storaged.client.checkpoint import Shard, StagedShard, save_checkpoint
from storaged.client.dcp import BYTES_DTYPE, FRAMEWORK, StoragedReader, StoragedWriter
from tests.conftest import TOKEN
from tests.service.inproc import InprocCluster

pytestmark = [pytest.mark.torch, pytest.mark.timeout(280)]

REPO = Path(__file__).resolve().parents[2]
#: Small chunks, so that streams span many chunks and reads cross chunk boundaries.
CHUNK = 1024
#: Seconds a group of rank processes may take in all (each imports torch: ~4 s of CPU).
WORKER_TIMEOUT = 120.0


def _name(tag: str) -> str:
    return f"dcp-{uuid.uuid4().hex[:12]}/{tag}"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes: equal bits element by element, NaNs and bfloat16 included."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
    assert got.shape == want.shape, (key, got.shape, want.shape)
    assert torch.equal(_bits(got), _bits(want)), f"{key}: values differ"


async def _manifest(cluster: InprocCluster, name: str) -> dict[str, Any]:
    async with Client(cluster.urls, token=TOKEN) as client:
        return await client.get_manifest(name)


async def _committed(cluster: InprocCluster, name: str) -> bool:
    try:
        await _manifest(cluster, name)
    except CheckpointNotFound:
        return False
    return True


def _mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "f32": torch.randn(33, 17, generator=g),
        "f32t": torch.randn(9, 40, generator=g),
        "bf16": torch.randn(8, 3, 5, generator=g).to(torch.bfloat16),
        "cast": torch.randn(6, 6, generator=g).to(torch.bfloat16),
        "f16": torch.randn(10, generator=g).half(),
        "f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(-5, 1000, dtype=torch.int64),  # 8 KiB: several chunks
        "u8": torch.randint(0, 256, (7, 7), generator=g, dtype=torch.uint8),
        "flag": torch.rand(11, generator=g) > 0.5,
        "c64": torch.randn(4, 4, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "nested": {"layer": {"weight": torch.randn(4, 4, generator=g)}},
        "extra": {"step": 1234, "tag": "τ-check", "lrs": [0.1, 0.01]},
    }


def _blank_like(state: Mapping[str, Any]) -> dict[str, Any]:
    blank: dict[str, Any] = {}
    for key, value in state.items():
        if key == "cast":  # loaded into float32: DCP casts
            blank[key] = torch.zeros(value.shape, dtype=torch.float32)
        elif key == "f32t":  # a non-contiguous destination
            blank[key] = torch.zeros(value.shape[1], value.shape[0]).t()
        elif isinstance(value, torch.Tensor):
            blank[key] = torch.zeros_like(value)
        elif isinstance(value, dict):
            blank[key] = _blank_like(value)
        else:
            blank[key] = type(value)()
    return blank


def _assert_state_equal(got: Mapping[str, Any], want: Mapping[str, Any], prefix: str = "") -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key, value in want.items():
        where = prefix + key
        if key == "cast":
            _assert_same(got[key], value.float(), where)
        elif isinstance(value, torch.Tensor):
            _assert_same(got[key], value, where)
        elif isinstance(value, dict):
            _assert_state_equal(got[key], value, where + ".")
        else:
            assert got[key] == value, where


def _upload_result(result: Any) -> ConcurrentFuture[Any]:
    return result.upload_completion if isinstance(result, AsyncSaveResponse) else result


# ---------------------------------------------------------------------- single process


@pytest.mark.quick
async def test_round_trip_several_dtypes(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    name = _name("mixed")
    state = _mixed_state()
    writer = StoragedWriter(cluster.urls, name, TOKEN, chunk_size=CHUNK)
    await asyncio.to_thread(dcp_save, state, storage_writer=writer, no_dist=True)
    assert writer.last_commit is not None and writer.last_commit.created

    manifest = await _manifest(cluster, name)
    assert manifest["meta"]["framework"] == FRAMEWORK
    assert manifest["meta"]["world_size"] == 1
    [shard] = manifest["shards"]
    items = {item["key"]: item for item in shard["items"]}
    assert items["bf16"]["dtype"] == "bfloat16"
    assert items["f8"]["dtype"] == "float8_e4m3fn"
    assert items["bf16"]["global_shape"] == [8, 3, 5] and items["bf16"]["shape"] == [8, 3, 5]
    assert items["bf16"]["offsets"] == [0, 0, 0] and items["bf16"]["length"] == 8 * 3 * 5 * 2
    assert items["scalar"]["global_shape"] == [] and items["scalar"]["dtype"] == "float32"
    assert items["nested.layer.weight"]["dtype"] == "float32"
    for key in ("extra.step", "extra.tag", "extra.lrs"):
        assert items[key]["dtype"] == BYTES_DTYPE
        assert items[key]["global_shape"] == items[key]["shape"] == []
    assert manifest["meta"]["dcp"]["planner_data"]["nested.layer.weight"] == [
        "nested",
        "layer",
        "weight",
    ]

    loaded = _blank_like(state)
    destinations = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    reader = StoragedReader(cluster.urls, name, TOKEN)
    await asyncio.to_thread(dcp_load, loaded, storage_reader=reader, no_dist=True)
    _assert_state_equal(loaded, state)
    for key, tensor in destinations.items():  # loaded in place
        assert loaded[key] is tensor, key
    assert reader.last_read is not None
    # Every saved tensor byte is read once (in its saved dtype), and nothing more.
    saved = [v for v in state.values() if isinstance(v, torch.Tensor)]
    saved.append(state["nested"]["layer"]["weight"])
    assert reader.last_read.tensor_bytes == sum(t.numel() * t.element_size() for t in saved)


async def test_load_without_a_template_rebuilds_the_nesting(inproc_cluster: InprocCluster) -> None:
    """DCP's template-free load (what dcp_to_torch_save uses) needs shapes, dtypes and
    the planner's flattening map: all of it comes back from the manifest."""
    name = _name("whole")
    state = {
        "model": {"w": torch.randn(5, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "step": 9,
    }
    urls = inproc_cluster.urls
    writer = StoragedWriter(urls, name, TOKEN)
    await asyncio.to_thread(dcp_save, state, storage_writer=writer, no_dist=True)
    whole = await asyncio.to_thread(
        dcp_load_whole, storage_reader=StoragedReader(urls, name, TOKEN)
    )
    _assert_state_equal(whole, state)


async def test_loads_a_checkpoint_saved_by_the_numpy_client(inproc_cluster: InprocCluster) -> None:
    """The manifest is framework-neutral: numpy shards from two ranks load into torch."""
    name = _name("numpy")
    full = np.arange(7 * 6, dtype=np.float32).reshape(7, 6)
    states: dict[int, dict[str, Any]] = {
        0: {"a": Shard(full[:4], (7, 6), (0, 0)), "note": "numpy"},
        1: {"a": Shard(full[4:], (7, 6), (4, 0))},
    }

    urls = inproc_cluster.urls
    async with Client(urls, token=TOKEN) as client:
        await save_checkpoint(client, name, states)
    out = {"a": torch.zeros(7, 6)}
    reader = StoragedReader(urls, name, TOKEN)
    await asyncio.to_thread(dcp_load, out, storage_reader=reader, no_dist=True)
    _assert_same(out["a"], torch.from_numpy(full), "a")
    # Its msgpack value is not a DCP object: left out of the metadata, so asking for it fails.
    with pytest.raises(CheckpointException, match="Missing key"):
        reader = StoragedReader(urls, name, TOKEN)
        await asyncio.to_thread(dcp_load, {"note": ""}, storage_reader=reader, no_dist=True)


async def test_names_are_immutable_and_missing_ones_fail_cleanly(
    inproc_cluster: InprocCluster,
) -> None:
    urls = inproc_cluster.urls
    name = _name("once")
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    writer = StoragedWriter(urls, name, TOKEN)
    await asyncio.to_thread(dcp_save, state, storage_writer=writer, no_dist=True)
    changed = {"w": state["w"] + 1}
    with pytest.raises(CheckpointException, match="already exists"):
        writer = StoragedWriter(urls, name, TOKEN)
        await asyncio.to_thread(dcp_save, changed, storage_writer=writer, no_dist=True)
    out = {"w": torch.zeros(3, 4)}
    reader = StoragedReader(urls, name, TOKEN)
    await asyncio.to_thread(dcp_load, out, storage_reader=reader, no_dist=True)
    _assert_same(out["w"], state["w"], "w")  # the first save stands

    with pytest.raises(CheckpointException, match="checkpoint_not_found"):
        reader = StoragedReader(urls, _name("none"), TOKEN)
        await asyncio.to_thread(dcp_load, out, storage_reader=reader)
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        StoragedWriter(urls, "../escape", TOKEN)
    # A load whose state dict asks for a key the checkpoint lacks is refused by DCP.
    with pytest.raises(CheckpointException, match="Missing key"):
        await asyncio.to_thread(
            dcp_load,
            {"w": torch.zeros(3, 4), "absent": torch.zeros(2)},
            storage_reader=StoragedReader(urls, name, TOKEN),
            no_dist=True,
        )


async def test_checkpoint_id_names_the_checkpoint(inproc_cluster: InprocCluster) -> None:
    writer = StoragedWriter(inproc_cluster.urls, _name("unused"), TOKEN)
    reader = StoragedReader(inproc_cluster.urls, _name("unused"), TOKEN)
    state = {"a": torch.ones(5, dtype=torch.int32)}
    for step in range(2):
        name = _name(f"step-{step}")
        state["a"] += step
        await asyncio.to_thread(
            dcp_save, state, checkpoint_id=name, storage_writer=writer, no_dist=True
        )
        out = {"a": torch.zeros(5, dtype=torch.int32)}
        await asyncio.to_thread(
            dcp_load, out, checkpoint_id=name, storage_reader=reader, no_dist=True
        )
        _assert_same(out["a"], state["a"], name)


async def test_async_save_completes_and_keeps_the_staged_values(
    inproc_cluster: InprocCluster,
) -> None:
    cluster = inproc_cluster
    name = _name("async")
    state = _mixed_state()
    want = {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
        if k not in ("nested", "extra")
    }
    result = await asyncio.to_thread(
        dcp_async_save,
        {k: state[k] for k in want},
        storage_writer=StoragedWriter(cluster.urls, name, TOKEN, chunk_size=CHUNK),
        no_dist=True,
    )
    # The state was staged (copied) before async_save returned: changing it now must
    # not change what is saved.
    state["f32"].add_(100.0)
    state["i64"].zero_()
    await asyncio.to_thread(_upload_result(result).result, timeout=60)
    assert await _committed(cluster, name)
    loaded = _blank_like(want)
    reader = StoragedReader(cluster.urls, name, TOKEN)
    await asyncio.to_thread(dcp_load, loaded, storage_reader=reader, no_dist=True)
    _assert_state_equal(loaded, want)


class _FailAfterUpload(StoragedWriter):
    """A writer whose chunks are all acknowledged, then its rank fails anyway."""

    async def _put_chunks(self, client: Client, staged: StagedShard) -> list[str]:
        ids = await super()._put_chunks(client, staged)
        raise RuntimeError(f"injected failure after {len(ids)} chunks were acknowledged")


async def test_failed_upload_commits_nothing(inproc_cluster: InprocCluster) -> None:
    cluster = inproc_cluster
    state = {"w": torch.randn(64, 64), "step": 3}
    name = _name("failed")
    writer = _FailAfterUpload(cluster.urls, name, TOKEN, chunk_size=CHUNK)
    with pytest.raises(CheckpointException, match="injected failure"):
        await asyncio.to_thread(dcp_save, state, storage_writer=writer, no_dist=True)
    assert not await _committed(cluster, name)

    refused = _name("refused")
    with pytest.raises(CheckpointException, match="unauthorized"):
        wrong = StoragedWriter(cluster.urls, refused, "wrong-token")
        await asyncio.to_thread(dcp_save, state, storage_writer=wrong, no_dist=True)
    assert not await _committed(cluster, refused)


# ---------------------------------------------------------------------- several processes

#: Global tensors of the multi-process test, and how 2 ranks save / 3 ranks load them.
_LAYOUTS: dict[str, tuple[tuple[str, int | None], tuple[str, int | None]]] = {
    "w": (("shard", 0), ("shard", 1)),  # 7 rows over 2 ranks: 4 + 3; 301 columns over 3
    "v": (("shard", 1), ("shard", 0)),  # 250 columns over 2; 7 rows over 3: 3 + 3 + 1
    "r": (("replicate", None), ("replicate", None)),
}
_EXTRA = {"step": 42, "note": "saved by 2 ranks"}


def _global_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2024)
    return {
        "w": torch.randn(7, 301, generator=g),
        "v": torch.randn(7, 250, generator=g).to(torch.bfloat16),
        "r": torch.arange(100, dtype=torch.int64) * 3,
    }


def _rank_main(config: dict[str, Any]) -> None:
    """One rank of a save (2 processes) or a load (3 processes); raises on any mismatch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    rank, world = int(config["rank"]), int(config["world"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{config['store']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = _global_tensors()
        which = 0 if config["mode"] == "save" else 1

        def placement(key: str) -> list[Shard | Replicate]:
            kind, dim = _LAYOUTS[key][which]
            return [Shard(dim)] if kind == "shard" and dim is not None else [Replicate()]

        url, token = config["urls"], config["token"]
        if config["mode"] == "save":
            state: dict[str, Any] = {
                k: distribute_tensor(t, mesh, placement(k)) for k, t in full.items()
            }
            state["extra"] = dict(_EXTRA)
            # Rank 1 fails after its chunks are acknowledged: every rank sees the save
            # fail and the coordinator commits nothing.
            failing = _FailAfterUpload if rank == 1 else StoragedWriter
            try:
                dcp_save(
                    state, storage_writer=failing(url, config["failed"], token, chunk_size=CHUNK)
                )
            except CheckpointException as exc:  # DCP's, a BaseException
                assert "injected failure" in str(exc), exc
            else:
                raise AssertionError("a save with a failing rank succeeded")
            dcp_save(
                state, storage_writer=StoragedWriter(url, config["name"], token, chunk_size=CHUNK)
            )
        else:
            loaded: dict[str, Any] = {
                k: distribute_tensor(torch.zeros_like(t), mesh, placement(k))
                for k, t in full.items()
            }
            loaded["extra"] = {"step": -1, "note": ""}
            reader = StoragedReader(url, config["name"], token, coalesce_gap=0)
            dcp_load(loaded, storage_reader=reader)
            for key, want in full.items():
                got = loaded[key]
                assert isinstance(got, DTensor)
                _assert_same(got.full_tensor(), want, key)
            assert loaded["extra"] == _EXTRA, loaded["extra"]
            # Only the bytes of this rank's boxes crossed the network.
            stats = reader.last_read
            assert stats is not None
            local = sum(
                t.to_local().numel() * t.to_local().element_size()
                for t in loaded.values()
                if isinstance(t, DTensor)
            )
            assert stats.tensor_bytes == local, (stats, local)
            assert stats.bytes_downloaded == stats.tensor_bytes + stats.value_bytes, stats
    finally:
        dist.destroy_process_group()


def _run_ranks(config: dict[str, Any], world: int, store: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "GLOO_SOCKET_IFNAME": "lo",  # gloo's own sockets stay on the loopback
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.client.test_dcp",
                json.dumps({**config, "rank": rank, "world": world, "store": str(store)}),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    outputs: list[bytes] = []
    deadline = time.monotonic() + WORKER_TIMEOUT
    try:
        for proc in procs:
            left = max(1.0, deadline - time.monotonic())
            outputs.append(proc.communicate(timeout=left)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        text = out.decode(errors="replace")[-6000:]
        assert proc.returncode == 0, f"{config['mode']} rank {rank} failed:\n{text}"


async def test_dtensor_saved_by_2_ranks_loads_into_3(
    inproc_cluster: InprocCluster, tmp_path: Path
) -> None:
    cluster = inproc_cluster
    config: dict[str, Any] = {
        "urls": cluster.urls,
        "token": TOKEN,
        "name": _name("dtensor"),
        "failed": _name("dtensor-failed"),
    }
    await asyncio.to_thread(_run_ranks, {**config, "mode": "save"}, 2, tmp_path / "save.store")

    assert not await _committed(cluster, config["failed"])
    manifest = await _manifest(cluster, config["name"])
    assert manifest["meta"]["world_size"] == 2
    assert [shard["rank"] for shard in manifest["shards"]] == [0, 1]
    boxes = {
        (shard["rank"], item["key"]): (item["offsets"], item["shape"])
        for shard in manifest["shards"]
        for item in shard["items"]
    }
    assert boxes[(0, "w")] == ([0, 0], [4, 301]) and boxes[(1, "w")] == ([4, 0], [3, 301])
    assert boxes[(0, "v")] == ([0, 0], [7, 125]) and boxes[(1, "v")] == ([0, 125], [7, 125])
    # Replicated: saved once, by whichever rank DCP's dedup picked.
    assert [rank for rank in (0, 1) if (rank, "r") in boxes] in ([0], [1])

    await asyncio.to_thread(_run_ranks, {**config, "mode": "load"}, 3, tmp_path / "load.store")


def _main(argv: list[str]) -> int:
    try:
        _rank_main(json.loads(argv[0]))
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


@pytest.mark.parametrize("cls", [StoragedWriter, StoragedReader])
def test_writer_and_reader_name_their_cluster_and_checkpoint_alike(
    cls: type[StoragedWriter] | type[StoragedReader],
) -> None:
    # No node is contacted: what both sides share is checked without a cluster.
    one = cls("http://127.0.0.1:1", "runs/a", "secret-token", client_options={"max_concurrency": 2})
    assert one.urls == ["http://127.0.0.1:1"] and one.checkpoint_id == "runs/a"
    assert repr(one) == f"{cls.__name__}(['http://127.0.0.1:1'], 'runs/a')"  # no token
    many = cls(["http://127.0.0.1:1", "http://127.0.0.1:2"], "runs/b")
    assert many.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert cls.validate_checkpoint_id(Path("runs/ok"))
    assert not cls.validate_checkpoint_id("../escape")
    one.reset("runs/c")
    assert one.name == "runs/c" and one.checkpoint_id == "runs/c"
    with pytest.raises(ValueError, match="node URL"):
        cls([], "runs/a")
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        cls("http://127.0.0.1:1", "../escape")
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        one.reset("../escape")


#: A process whose worker thread is still inside torch's settle of a future when the main
#: thread ends it. The callback stands for DCP's own, which run in the settling thread after
#: the waiter has woken; ``registered`` makes sure it is on the future before it settles.
EXIT_WHILE_SETTLING = """
import threading, time
from storaged.client.dcp import _spawn, _torch_future

registered = threading.Event()
future = _torch_future(_spawn(lambda: registered.wait(30) and 7, "test"))
future.add_done_callback(lambda f: time.sleep(0.5))
registered.set()
print(future.wait(), flush=True)
"""


def test_a_process_that_exits_while_a_future_settles_exits_cleanly() -> None:
    # Without the exit's wait for settles in flight, this aborted (status -6) every time:
    # "terminate called without an active exception".
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_SETTLING],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert (proc.returncode, proc.stdout) == (0, "7\n"), proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr


Cli = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
def cli(inproc_cluster: InprocCluster, capsys: pytest.CaptureFixture[str]) -> Cli:
    """The ``storaged`` command (its ``main``, in this process: torch is imported already;
    in a thread, as it runs an event loop of its own) against the test's cluster:
    ``await cli(*args) -> (status, stdout, stderr)``."""
    from storaged.cli import main

    urls = ",".join(inproc_cluster.urls)

    async def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = await asyncio.to_thread(
            main, [*args, "--url", urls, "--token", TOKEN, "--no-progress"]
        )
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return status, out, err

    return run


async def test_storaged_restore_exports_a_dcp_checkpoint_with_non_tensor_values(
    inproc_cluster: InprocCluster, cli: Cli, tmp_path: Path
) -> None:
    """Every value the DCP writer saved comes back: tensors as tensors, the rest (a step, a
    learning rate, a tuple of betas, a name, a nested dict) in the safetensors metadata
    (``storaged.values``) or as themselves in a .pt; an .npz takes the scalars and refuses
    the rest in one line; a value the safe unpickler refuses is refused, saying why."""
    from safetensors import safe_open

    name = _name("values")
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    half = torch.ones(5, dtype=torch.bfloat16)
    values = {"step": 1200, "lr": 0.25, "betas": (0.9, 0.999), "run": "exp-7"}
    state = {"model": {"w": weight, "h": half}, **values, "extra": {"seen": [1, 2, 3]}}
    writer = StoragedWriter(inproc_cluster.urls, name, TOKEN)
    await asyncio.to_thread(dcp_save, state, storage_writer=writer, no_dist=True)
    flat = {"model.w": weight, "model.h": half}
    flat_values: dict[str, Any] = {**values, "extra.seen": [1, 2, 3]}

    out = tmp_path / "out.safetensors"
    status, _, err = await cli("restore", name, str(out))
    assert status == 0, err
    with safe_open(str(out), framework="pt") as f:
        assert set(f.keys()) == set(flat)
        for key, want in flat.items():
            _assert_same(f.get_tensor(key), want, key)
        kept = json.loads(f.metadata()["storaged.values"])
    # JSON has no tuples: the betas come back as a list
    assert kept == {**flat_values, "betas": [0.9, 0.999]}

    pt = tmp_path / "out.pt"
    status, _, err = await cli("restore", name, str(pt))
    assert status == 0, err
    loaded = torch.load(pt, weights_only=True)
    assert set(loaded) == set(flat) | set(flat_values)
    for key, want in flat.items():
        _assert_same(loaded[key], want, key)
    assert {k: loaded[k] for k in flat_values} == flat_values  # the tuple stays a tuple

    # the safetensors saved again: its values are values of the new checkpoint
    again = _name("again")
    status, _, err = await cli("save", str(out), again)
    assert status == 0, err
    pt_again = tmp_path / "again.pt"
    status, _, err = await cli("restore", again, str(pt_again))
    assert status == 0, err
    reloaded = torch.load(pt_again, weights_only=True)
    assert {k: reloaded[k] for k in flat_values} == {**flat_values, "betas": [0.9, 0.999]}

    # .npz: numbers and strings, not a list of two... it is an array; a dict is refused
    status, _, err = await cli("restore", name, str(tmp_path / "out.npz"))
    assert status == 0, err
    with np.load(tmp_path / "out.npz") as z:
        assert int(z["step"]) == 1200 and str(z["run"]) == "exp-7"
        assert z["betas"].tolist() == [0.9, 0.999]
    nested = _name("nested")
    await asyncio.to_thread(
        dcp_save,
        {"w": weight, "opts": {"a": (1, {"b": 2})}},
        storage_writer=StoragedWriter(inproc_cluster.urls, nested, TOKEN),
        no_dist=True,
    )
    status, _, err = await cli("restore", nested, str(tmp_path / "nested.npz"))
    assert status == 1 and "opts.a" in err and ".npz cannot hold" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "nested.npz").exists()

    # raw cannot hold several items, nor values: one line, nothing written
    status, _, err = await cli("restore", name, str(tmp_path / "out.bin"), "--format", "raw")
    assert status != 0 and "non-tensor values" in err and len(err.strip().splitlines()) == 1


class _Opaque:
    """A value only a full unpickler can rebuild."""

    def __init__(self, n: int) -> None:
        self.n = n


async def test_storaged_restore_refuses_a_value_only_a_full_unpickler_reads(
    inproc_cluster: InprocCluster, cli: Cli, tmp_path: Path
) -> None:
    name = _name("opaque")
    state = {"w": torch.zeros(3), "thing": _Opaque(3)}
    writer = StoragedWriter(inproc_cluster.urls, name, TOKEN)
    await asyncio.to_thread(dcp_save, state, storage_writer=writer, no_dist=True)
    for out in ("x.safetensors", "x.pt"):
        status, _, err = await cli("restore", name, str(tmp_path / out))
        assert status == 1, err
        assert "thing" in err and "weights_only" in err and "StoragedReader" in err, err
        assert len(err.strip().splitlines()) == 1
        assert not (tmp_path / out).exists()
