"""The client CLI against a real 4-node cluster, and ``storaged demo`` end to end.

Round trips of .npz, .safetensors and torch files through ``storaged save`` and
``storaged restore``; ls/status/rm in text and JSON; the failures a user meets
(wrong token, unreachable cluster, unknown or existing checkpoint, unreadable or
unwritable files, bad names) give one readable line and a non-zero status; the
demo's byte check catches a flipped byte, and the demo cleans up after Ctrl-C.

Node processes (``LocalCluster``), not in-process nodes: the command under test is a
process of its own (its output, exit status and Ctrl-C are what is checked), and the demo
starts and SIGKILLs node processes itself.
"""

from __future__ import annotations

import asyncio
import http.server
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from storaged.cli import main
from storaged.client.command import ByteProgress, run_async
from storaged.tools.demo import build_model, shares
from storaged.tools.local_cluster import LocalCluster, free_port_block, new_token
from tests.client.helpers import client_for
from tests.conftest import ADMIN_TOKEN, TOKEN

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]


class Run(NamedTuple):
    status: int
    out: str
    err: str


@pytest.fixture
def cli(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """``cli(*args) -> Run(status, stdout, stderr)`` against the module's cluster."""

    def run(*args: str, token: str | None = TOKEN, url: str | None = None) -> Run:
        capsys.readouterr()
        argv = [*args, "--url", url or ",".join(cluster.urls), "--no-progress"]
        if args[0] in ("ls", "status", "rm"):
            argv.remove("--no-progress")
        if token is not None:
            argv += ["--token", token]
        status = main(argv)
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return Run(status, out, err)

    yield run


def _name(tag: str) -> str:
    return f"cli/{tag}-{time.monotonic_ns() % 10**9}"


# --------------------------------------------------------------------------- round trips


@pytest.mark.quick
def test_npz_round_trip(cli: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "weight": rng.standard_normal((700, 1000), dtype=np.float32),  # several 1 MiB chunks
        "ids": rng.integers(-(2**40), 2**40, size=333, dtype=np.int64),
        "mask": rng.random(17) > 0.5,
        "scalar": np.array(3.25),
        "file": np.arange(5, dtype=np.uint8),  # np.savez(file=...) would clash with this key
        "empty": np.zeros((0, 3), dtype=np.float16),
    }
    src = tmp_path / "in.npz"
    np.savez(src, **{k: v for k, v in arrays.items() if k != "file"})  # type: ignore[arg-type]
    with np.load(src) as z:
        assert "file" not in z.files
    # np.savez cannot name a member "file": add it the way the CLI writes members.
    import zipfile

    with zipfile.ZipFile(src, "a") as archive, archive.open("file.npy", "w") as member:
        np.lib.format.write_array(member, arrays["file"])
    name = _name("npz")

    r = cli("save", str(src), name, "--chunk-size", "1MiB")
    assert r.status == 0, r.err
    assert f"saved {name}: 6 items" in r.out

    dst = tmp_path / "out.npz"
    r = cli("restore", name, str(dst))
    assert r.status == 0, r.err
    assert f"restored {name} into {dst}: 6 items" in r.out
    with np.load(dst, allow_pickle=False) as z:
        assert sorted(z.files) == sorted(arrays)
        for key, want in arrays.items():
            got = z[key]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert np.array_equal(got, want), key
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp file left"


def _torch() -> Any:
    return pytest.importorskip("torch")


def test_safetensors_round_trip(cli: Any, tmp_path: Path) -> None:
    torch = _torch()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(2)
    tensors = {
        "embed.weight": torch.randn(513, 768, generator=gen).to(torch.bfloat16),
        "layers.0.weight": torch.randn(300, 1000, generator=gen),
        "layers.0.bias": torch.randn(1000, generator=gen).to(torch.float16),
        "steps": torch.arange(10, dtype=torch.int32),
        "fp8": torch.randn(64, generator=gen).to(torch.float8_e4m3fn),
    }
    src = tmp_path / "model.safetensors"
    safetensors_torch.save_file(tensors, str(src), metadata={"format": "pt", "step": "7"})
    name = _name("st")

    r = cli("save", str(src), name, "--chunk-size", "1MiB")
    assert r.status == 0, r.err

    for target in ("back.safetensors", "back.pt"):
        dst = tmp_path / target
        r = cli("restore", name, str(dst))
        assert r.status == 0, r.err
        if target.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(dst), framework="pt") as f:
                assert f.metadata() == {"format": "pt", "step": "7"}
                got = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        else:
            got = torch.load(dst, weights_only=True)
        assert sorted(got) == sorted(tensors)
        for key, want in tensors.items():
            assert got[key].dtype == want.dtype, key
            assert got[key].shape == want.shape, key
            assert torch.equal(got[key].view(torch.uint8), want.view(torch.uint8)), key

    # Into .npz: bfloat16 and float8 come back as their same-width integers, said on stderr.
    dst = tmp_path / "back.npz"
    r = cli("restore", name, str(dst))
    assert r.status == 0 and "bfloat16" in r.err
    with np.load(dst) as z:
        assert z["embed.weight"].dtype == np.uint16
        assert np.array_equal(
            z["embed.weight"], tensors["embed.weight"].view(torch.int16).numpy().view(np.uint16)
        )
        assert np.array_equal(z["layers.0.weight"], tensors["layers.0.weight"].numpy())


def test_torch_nested_round_trip(cli: Any, tmp_path: Path) -> None:
    torch = _torch()
    obj: dict[str, Any] = {
        "model": {"w": torch.randn(40, 30), "b": torch.zeros(30, dtype=torch.bfloat16)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(40, 30)}},
            "param_groups": [{"lr": 0.001, "params": [0, 1]}],
        },
        "epoch": 3,
        "name": "run-a",
    }
    src = tmp_path / "ckpt.pt"
    torch.save(obj, src)
    name = _name("pt")
    r = cli("save", str(src), name)
    assert r.status == 0, r.err

    dst = tmp_path / "back.pt"
    r = cli("restore", name, str(dst))
    assert r.status == 0, r.err
    got = torch.load(dst, weights_only=True)
    assert got["epoch"] == 3 and got["name"] == "run-a"
    assert got["optimizer"]["param_groups"] == [{"lr": 0.001, "params": [0, 1]}]
    assert set(got["optimizer"]["state"]) == {0}  # the int key survives
    want_avg = obj["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], want_avg)
    assert torch.equal(got["optimizer"]["state"][0]["step"], torch.tensor(5.0))
    assert torch.equal(got["model"]["w"], obj["model"]["w"])
    assert got["model"]["b"].dtype == torch.bfloat16

    # .safetensors: the tensors, and the non-tensor values as JSON in its metadata.
    dst = tmp_path / "back.safetensors"
    r = cli("restore", name, str(dst))
    assert r.status == 0, r.err
    from safetensors import safe_open

    with safe_open(str(dst), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.w"), obj["model"]["w"])
        values = json.loads(f.metadata()["storaged.values"])
    assert values["epoch"] == 3 and values["name"] == "run-a"
    # raw holds one item and no values: refused before anything is written
    raw = tmp_path / "back.bin"
    r = cli("restore", name, str(raw), "--format", "raw")
    assert r.status == 1 and "non-tensor values" in r.err and "epoch" in r.err
    assert not raw.exists()


def test_save_wait_cold(cli: Any, tmp_path: Path) -> None:
    src = tmp_path / "a.npz"
    np.savez(src, x=np.random.default_rng(3).random(50_000))
    name = _name("wait")
    r = cli("save", str(src), name, "--wait", "cold", "--timeout", "120")
    assert r.status == 0, r.err
    assert f"{name} is cold" in r.out
    assert "cold 1/1" in r.err  # the counts as they changed
    r = cli("status", name, "--json")
    assert json.loads(r.out)["state"] == "cold"


# --------------------------------------------------------------------------- ls / status / rm


@pytest.mark.quick
def test_ls_status_rm(cli: Any, tmp_path: Path) -> None:
    src = tmp_path / "a.npz"
    np.savez(src, x=np.arange(1000, dtype=np.float64))
    prefix = _name("ls")
    names = [f"{prefix}/step-{i}" for i in (2, 1)]
    for name in names:
        assert cli("save", str(src), name)[0] == 0

    r = cli("ls", prefix)
    assert r.status == 0, r.err
    lines = r.out.splitlines()
    header = ["NAME", "STATE", "SIZE", "SHARED", "RAM", "NVME", "COLD", "STORED", "CREATED"]
    assert lines[0].split() == header
    assert [line.split()[0] for line in lines[1:]] == sorted(names)
    assert all(line.split()[1] in ("memory", "nvme", "cold") for line in lines[1:])

    r = cli("ls", prefix, "--json")
    assert r.status == 0, r.err
    doc = json.loads(r.out)
    assert [c["name"] for c in doc["checkpoints"]] == sorted(names)
    assert all(c["bytes"] == 8000 for c in doc["checkpoints"])
    # the same file twice: each shares its one chunk with the other
    assert all(c["costs"]["shared"] == 8000 for c in doc["checkpoints"])
    r = cli("ls", prefix, "--no-costs")
    assert r.out.splitlines()[0].split() == ["NAME", "STATE", "SIZE", "CREATED"]
    assert (
        "costs" not in json.loads(cli("ls", prefix, "--json", "--no-costs").out)["checkpoints"][0]
    )
    assert all(isinstance(c["created"], float) for c in doc["checkpoints"])

    r = cli("status", names[0], "--json")
    assert r.status == 0, r.err
    st = json.loads(r.out)
    assert st["name"] == names[0] and st["chunks"] == 1
    assert st["memory"] >= st["nvme"] >= st["cold"]
    r = cli("status", names[0])
    assert r.status == 0 and r.out.splitlines()[0].split() == ["name", names[0]]
    assert "chunks  1" in r.out

    r = cli("rm", names[0])
    assert r.status == 0 and r.out.strip() == f"deleted {names[0]}"
    r = cli("ls", prefix, "--json")
    assert [c["name"] for c in json.loads(r.out)["checkpoints"]] == [names[1]]
    r = cli("ls", prefix + "-nothing-here")
    assert r.status == 0 and r.out == ""


def _ls_rows(out: str) -> dict[str, dict[str, str]]:
    """``ls`` text output as {name: {column: cell}}; cells are two or more spaces apart."""
    lines = out.splitlines()
    header = re.split(r"\s{2,}", lines[0].strip())
    return {
        cells[0]: dict(zip(header, cells, strict=True))
        for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:])
    }


def test_ls_shows_what_each_checkpoint_costs(
    cli: Any, cluster: LocalCluster, tmp_path: Path
) -> None:
    """Two checkpoints with a tensor in common each show exactly the bytes of the chunks
    both name as shared; one with nothing in common shows 0. Once one is cold and evicted
    from RAM and nvme, its RAM and NVME columns fall to 0 and what it stores is its
    fragments: n of ceil(size / k) bytes per chunk."""
    rng = np.random.default_rng(21)
    frozen = rng.standard_normal(3 * 2**18).astype(np.float32)  # 3 MiB: three 1 MiB chunks
    prefix = _name("costs")
    contents = {
        "a": {"frozen": frozen, "head": rng.standard_normal(2**18).astype(np.float32)},
        "b": {"frozen": frozen, "head": rng.standard_normal(2**18).astype(np.float32)},
        "c": {"alone": rng.standard_normal(2**18 + 5).astype(np.float32)},
    }
    for tag, arrays in contents.items():
        np.savez(tmp_path / f"{tag}.npz", **arrays)  # type: ignore[arg-type]
        wait = ["--wait", "cold", "--timeout", "120"] if tag == "a" else []
        r = cli(
            "save", str(tmp_path / f"{tag}.npz"), f"{prefix}/{tag}", "--chunk-size", "1MiB", *wait
        )
        assert r.status == 0, r.err

    async def facts() -> tuple[dict[str, dict[str, int]], int, int]:
        async with client_for(cluster) as client:
            chunks = {}
            for tag in contents:
                manifest = await client.get_manifest(f"{prefix}/{tag}")
                chunks[tag] = {c: n for s in manifest["shards"] for c, n in s["chunks"]}
            erasure = client.cluster.erasure
            assert erasure is not None
            return chunks, erasure.k, erasure.n

    chunks, k, n = run_async(facts)
    both = set(chunks["a"]) & set(chunks["b"])
    shared = sum(chunks["a"][c] for c in both)
    assert len(both) == 3 and shared == frozen.nbytes  # what the test means to set up

    def listed() -> dict[str, Any]:
        r = cli("ls", prefix + "/", "--json")
        assert r.status == 0, r.err
        return {c["name"].rsplit("/", 1)[1]: c for c in json.loads(r.out)["checkpoints"]}

    doc = listed()
    for tag in ("a", "b"):
        assert doc[tag]["costs"]["shared"] == shared, doc[tag]
        assert doc[tag]["costs"]["shared_chunks"] == 3
    assert doc["c"]["costs"]["shared"] == 0 and doc["c"]["costs"]["shared_chunks"] == 0
    # sharing counts every checkpoint, not only those listed
    alone = json.loads(cli("ls", f"{prefix}/a", "--json").out)["checkpoints"]
    assert [c["costs"]["shared"] for c in alone] == [shared]
    a = doc["a"]["costs"]
    assert doc["a"]["state"] == "cold" and a["chunks"] == len(chunks["a"]) and a["lost"] == 0
    fragments = sum(n * -(-size // k) for size in chunks["a"].values())
    assert a["cold"] == {
        "chunks": len(chunks["a"]),
        "bytes": doc["a"]["bytes"],
        "stored": fragments,
    }
    assert a["memory"]["bytes"] + a["nvme"]["bytes"] > 0  # hot copies still there
    assert a["stored"] == a["memory"]["stored"] + a["nvme"]["stored"] + fragments
    rows = _ls_rows(cli("ls", prefix + "/").out)
    assert rows[f"{prefix}/c"]["SHARED"] == "0 B"
    assert rows[f"{prefix}/a"]["SHARED"] == "3.00 MiB" == rows[f"{prefix}/b"]["SHARED"]

    async def evict() -> None:
        async with client_for(cluster) as client:
            await client.evict(f"{prefix}/a", "nvme", admin_token=ADMIN_TOKEN)

    run_async(evict)
    a = listed()["a"]["costs"]
    assert a["memory"] == {"chunks": 0, "bytes": 0, "stored": 0}, a
    assert a["nvme"] == {"chunks": 0, "bytes": 0, "stored": 0}, a
    assert a["cold"]["chunks"] == len(chunks["a"]) and a["stored"] == fragments
    row = _ls_rows(cli("ls", prefix + "/").out)[f"{prefix}/a"]
    assert row["RAM"] == row["NVME"] == "0 B" and row["STATE"] == "cold"
    assert row["COLD"] == "4.00 MiB"


def test_ls_costs_count_what_live_nodes_hold(
    cluster_factory: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With a node killed, ``ls`` still answers at once, and its tier columns count only
    what the live nodes hold: exactly the nvme copies and the fragments the plan names on
    the other nodes, nothing lost (six fragments over four nodes leave at least k=4).
    Repair and GC are held off (``repair_interval``, ``gone_after``, ``gc_interval``) so that
    nothing changes the holdings between the plan and the listing: GC's retention trims the
    nvme copies of a cold chunk but for its owner's of the newest checkpoint of a prefix
    (``k/frozen`` here), and a pass between the plan and the listing took ``k/hot``'s (failed
    under load: nvme counted 0)."""
    cluster = cluster_factory(repair_interval=3600.0, gone_after=3600.0, gc_interval=3600.0)

    def cli(*args: str) -> Run:
        capsys.readouterr()
        status = main([*args, "--url", ",".join(cluster.urls), "--token", TOKEN])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return Run(status, out, err)

    rng = np.random.default_rng(8)
    for tag in ("hot", "frozen"):  # nvme copies only / fragments only
        np.savez(tmp_path / f"{tag}.npz", w=rng.standard_normal(5 * 2**18).astype(np.float32))
        r = cli(
            "save", str(tmp_path / f"{tag}.npz"), f"k/{tag}", "--chunk-size", "1MiB",
            "--wait", "cold", "--timeout", "120", "--no-progress",
        )  # fmt: skip
        assert r.status == 0, r.err

    async def holdings() -> tuple[dict[str, Any], dict[str, dict[str, int]], int]:
        async with client_for(cluster) as client:
            await client.evict("k/hot", "memory", admin_token=ADMIN_TOKEN)
            await client.evict("k/frozen", "nvme", admin_token=ADMIN_TOKEN)
            plans, sizes = {}, {}
            for tag in ("hot", "frozen"):
                plans[tag] = await client.plan(f"k/{tag}")
                manifest = await client.get_manifest(f"k/{tag}")
                sizes[tag] = {c: n for s in manifest["shards"] for c, n in s["chunks"]}
            erasure = client.cluster.erasure
            assert erasure is not None
            return plans, sizes, erasure.k

    plans, sizes, k = run_async(holdings)
    assert all(h.tier != "memory" for hs in plans["hot"].values() for h in hs), plans["hot"]
    assert all(h.tier == "cold" for hs in plans["frozen"].values() for h in hs)
    # the nvme copies of k/hot (the plan names fragments only of nodes without a copy)
    plans["hot"] = {c: [h for h in hs if h.tier == "nvme"] for c, hs in plans["hot"].items()}
    counts: dict[str, int] = {}
    for hs in plans["hot"].values():
        for h in hs:
            counts[h.node] = counts.get(h.node, 0) + 1
    dead = max(counts, key=lambda n: counts[n])  # the node with the most nvme copies
    cluster.kill(int(dead[1:]))

    started = time.monotonic()
    r = cli("ls", "k/", "--json")
    took = time.monotonic() - started
    assert r.status == 0, r.err
    doc = {c["name"]: c["costs"] for c in json.loads(r.out)["checkpoints"]}

    hot = doc["k/hot"]
    assert hot["memory"] == {"chunks": 0, "bytes": 0, "stored": 0}, hot
    held = {c for c, hs in plans["hot"].items() if any(h.node != dead for h in hs)}
    assert hot["nvme"] == {
        "chunks": len(held),
        "bytes": sum(sizes["hot"][c] for c in held),
        "stored": sum(
            sizes["hot"][c] for c, hs in plans["hot"].items() for h in hs if h.node != dead
        ),
    }, (hot, dead)
    before = sum(sizes["hot"][c] for c, hs in plans["hot"].items() for _ in hs)
    assert hot["nvme"]["stored"] < before  # the dead node's copies are gone from the count
    assert hot["lost"] == 0

    frozen = doc["k/frozen"]
    kept = {
        c: [i for h in hs if h.node != dead for i in h.fragments]
        for c, hs in plans["frozen"].items()
    }
    assert all(len(set(ids)) >= k for ids in kept.values()), kept  # what the test relies on
    assert frozen["memory"]["stored"] == frozen["nvme"]["stored"] == 0, frozen
    assert frozen["cold"] == {
        "chunks": len(kept),
        "bytes": sum(sizes["frozen"].values()),
        "stored": sum(len(ids) * -(-sizes["frozen"][c] // k) for c, ids in kept.items()),
    }, (frozen, dead)
    assert frozen["stored"] == frozen["cold"]["stored"] and frozen["lost"] == 0
    every = sum(len(h.fragments) for hs in plans["frozen"].values() for h in hs)
    assert sum(map(len, kept.values())) < every  # the dead node held some of them
    r = cli("ls", "k/")
    assert r.status == 0 and len(r.out.splitlines()) == 3, r
    print(f"ls --json with {dead} killed: {took:.2f} s")


# --------------------------------------------------------------------------- failures


def test_wrong_token(cli: Any, tmp_path: Path) -> None:
    src = tmp_path / "a.npz"
    np.savez(src, x=np.arange(10))
    for args in (("ls",), ("status", "cli/x"), ("save", str(src), "cli/x")):
        r = cli(*args, token="not-the-token")
        assert r.status == 1, args
        assert "refused the token (HTTP 401)" in r.err, r.err
        assert len(r.err.strip().splitlines()) == 1
    r = cli("ls", token=None)  # no token at all
    assert r.status == 1 and "401" in r.err


def test_a_new_token_is_always_a_value_the_cli_parses() -> None:
    """``storaged up`` writes the tokens users pass as ``--token T``: one starting
    with ``-`` would be a parse error (a URL-safe token did one time in 64 and failed
    a CI run). 2,000 draws would meet such a token with near certainty."""
    from storaged.cli import _parser  # the real parser, without running a command

    parser = _parser()
    for _ in range(2000):
        token = new_token()
        assert len(token) >= 32 and not token.startswith("-"), token
        args = parser.parse_args(["ls", "--token", token])
        assert args.token == token


def test_unreachable_cluster(cli: Any) -> None:
    port = free_port_block(1)
    began = time.monotonic()
    r = cli("ls", url=f"http://127.0.0.1:{port}")
    assert r.status == 1
    assert "cannot reach the cluster" in r.err and str(port) in r.err
    assert time.monotonic() - began < 60


class _OtherServer(http.server.BaseHTTPRequestHandler):
    """Not storaged: a web server's HTML page, or etcd's plain-text 404."""

    body = b"<html><body>" + b"<p>a web page</p>" * 500 + b"</body></html>"
    content_type = "text/html"
    status = 404

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _EtcdLike(_OtherServer):
    body = b"404 page not found\n"
    content_type = "text/plain; charset=utf-8"


class _PageFor200(_OtherServer):
    status = 200


@pytest.mark.parametrize("handler", [_OtherServer, _EtcdLike, _PageFor200])
def test_a_server_that_is_not_storaged_is_named_as_such(
    cli: Any, handler: type[http.server.BaseHTTPRequestHandler]
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        for url in (f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"):
            r = cli("ls", url=url)
            assert r.status == 1, r
            line = r.err.strip()
            assert len(line.splitlines()) == 1 and "<html" not in line and "<p>" not in line
            assert line.startswith("storaged ls: error: not a storaged node at "), line
            assert f"127.0.0.1:{port}" in line, line
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_url_without_a_scheme_is_http(cli: Any, cluster: LocalCluster) -> None:
    bare = ",".join(url.removeprefix("http://") for url in cluster.urls)
    r = cli("ls", url=bare, token=TOKEN)
    assert r.status == 0, r.err
    r = cli("ls", url="ftp://127.0.0.1:1")
    assert r.status == 2 and "--url" in r.err


async def test_a_closed_port_fails_at_the_first_refusal_for_a_command() -> None:
    """Nothing listening: a command's client (refused_fails_fast) gives up after one try of
    each URL; a job's client backs off and retries, as across a node's restart."""
    from storaged.client import Client, ConnectionFailed

    ports = [free_port_block(1), free_port_block(1)]
    urls = [f"127.0.0.1:{p}" for p in ports]
    fast = Client(urls, refused_fails_fast=True)
    with pytest.raises(ConnectionFailed):
        await fast.open()  # asks for the cluster document: each URL once, then no retry
    assert (fast.stats.requests, fast.stats.retries) == (len(urls), 0)
    patient = Client(urls)
    with pytest.raises(ConnectionFailed):
        await patient.open()
    assert patient.stats.retries >= 1 and patient.stats.requests > len(urls)


def test_unknown_checkpoint(cli: Any, tmp_path: Path) -> None:
    name = _name("missing")
    for args in (("status", name), ("rm", name), ("restore", name, str(tmp_path / "x.npz"))):
        r = cli(*args)
        assert r.status == 1, args
        assert f"no checkpoint named {name}" in r.err
    assert list(tmp_path.iterdir()) == []  # the restore left no file behind


def test_existing_name(cli: Any, tmp_path: Path) -> None:
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(a, x=np.arange(10))
    np.savez(b, x=np.arange(11))
    name = _name("exists")
    assert cli("save", str(a), name)[0] == 0
    for src in (a, b):  # the same or other content: names are immutable either way
        r = cli("save", str(src), name)
        assert r.status == 1
        assert f"a checkpoint named {name} already exists" in r.err

    # restore refuses to overwrite a file, unless told to
    dst = tmp_path / "out.npz"
    dst.write_bytes(b"keep me")
    r = cli("restore", name, str(dst))
    assert r.status == 1 and "--force" in r.err
    assert dst.read_bytes() == b"keep me"
    assert cli("restore", name, str(dst), "--force")[0] == 0
    with np.load(dst) as z:
        assert np.array_equal(z["x"], np.arange(10))


def test_bad_input_files(cli: Any, tmp_path: Path) -> None:
    garbage = np.random.default_rng(4).bytes(4096)
    cases = {
        "missing.npz": None,
        "garbage.npz": garbage,
        "garbage.safetensors": garbage,
        "garbage.pt": garbage,
        "short.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{}",
    }
    (tmp_path / "plain.npz").write_bytes(b"")
    np.save(tmp_path / "array.npy", np.arange(3))
    os.replace(tmp_path / "array.npy", tmp_path / "array.npz")  # a .npy under an .npz name
    for filename, content in cases.items():
        if content is not None:
            (tmp_path / filename).write_bytes(content)
    expected = {
        "missing.npz": "cannot read",
        "garbage.npz": "not a readable .npz",
        "plain.npz": "not a readable .npz",
        "array.npz": "not an .npz archive",
        "garbage.safetensors": "not a readable .safetensors",
        "short.safetensors": "not a readable .safetensors",
        "garbage.pt": "not a readable torch file",
    }
    for filename, message in expected.items():
        r = cli("save", str(tmp_path / filename), _name("bad"))
        assert r.status == 1, filename
        assert message in r.err, (filename, r.err)
        assert len(r.err.strip().splitlines()) == 1, r.err

    unreadable = tmp_path / "noperm.npz"
    np.savez(unreadable, x=np.arange(3))
    unreadable.chmod(0)
    if os.access(unreadable, os.R_OK):  # root reads anything: test a directory instead
        unreadable = tmp_path / "dir.npz"
        unreadable.mkdir()
    r = cli("save", str(unreadable), _name("bad"))
    assert r.status == 1 and "cannot read" in r.err

    # an .npz whose arrays cannot be saved (strings)
    np.savez(tmp_path / "strings.npz", s=np.array(["a", "bc"]))
    r = cli("save", str(tmp_path / "strings.npz"), _name("bad"))
    assert r.status == 1 and "cannot save arrays of dtype" in r.err

    # usage errors: exit status 2, before any request
    r = cli("save", str(tmp_path / "x.txt"), _name("bad"))
    assert r.status == 2 and "unknown file type .txt" in r.err
    r = cli("save", str(tmp_path / "garbage.npz"), "../bad name")
    assert r.status == 2 and "invalid checkpoint name" in r.err
    r = cli("status", "/leading-slash")
    assert r.status == 2
    r = cli("restore", "cli/x", str(tmp_path / "missing-dir" / "out.npz"))
    assert r.status == 1 and "cannot write" in r.err


def test_missing_libraries(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch, torch files get a clear error, not a traceback; .safetensors files
    (bfloat16 included) need neither torch nor the safetensors package: the CLI parses them."""
    torch = _torch()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    st_file = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": torch.arange(4, dtype=torch.bfloat16)}, str(st_file))
    pt_file = tmp_path / "m.pt"
    torch.save({"w": torch.ones(4)}, pt_file)

    with monkeypatch.context() as m:
        for module in ("torch", "safetensors", "safetensors.numpy", "safetensors.torch"):
            m.setitem(sys.modules, module, None)  # import -> ImportError
        r = cli("save", str(pt_file), _name("nolib"))
        assert r.status == 1 and "needs PyTorch" in r.err
        name = _name("nolib")
        r = cli("save", str(st_file), name)
        assert r.status == 0, r.err
        r = cli("restore", name, str(tmp_path / "back.pt"))
        assert r.status == 1 and "needs PyTorch" in r.err
        r = cli("restore", name, str(tmp_path / "back.safetensors"))
        assert r.status == 0, r.err
    from safetensors import safe_open

    with safe_open(str(tmp_path / "back.safetensors"), framework="pt") as f:
        got = f.get_tensor("w")
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.arange(4, dtype=torch.bfloat16))


# --------------------------------------------------------------------------- pieces of the demo


def test_shares_are_uneven_and_cover() -> None:
    for rows in (4, 5, 97, 10_000):
        parts = shares(rows, [1.3, 0.7, 1.1, 0.9])
        assert [o for o, _ in parts] == [0, *np.cumsum([c for _, c in parts])[:-1].tolist()]
        assert sum(c for _, c in parts) == rows
        assert all(c >= 1 for _, c in parts)
    counts = [c for _, c in shares(10_000, [1.3, 0.7, 1.1, 0.9])]
    assert len(set(counts)) == 4
    with pytest.raises(ValueError):
        shares(3, [1.0] * 4)


def test_demo_check_finds_a_flipped_byte() -> None:
    model = build_model(96 << 20, ranks=4)
    arrays = model.materialize()
    assert sum(a.nbytes for a in arrays.values()) > 95 << 20
    # every 8 MiB block of every tensor is distinct: nothing would dedup
    heads = [
        a.reshape(-1).view(np.uint8)[i : i + 64].tobytes()
        for a in arrays.values()
        for i in range(0, a.nbytes, 8 << 20)
    ]
    assert len(set(heads)) == len(heads) > len(arrays)
    # the values look like weights (finite, small), not random bits
    assert np.all(np.abs(arrays["layers.0.mlp.weight"]) < 1.0)

    targets = model.restore_targets(2)
    for target in targets:
        for key, array in arrays.items():
            shard = target[key]
            offset = shard.offsets[0]
            shard.array[...] = array[offset : offset + len(shard.array)]
    returned = {k: v for values in (model.common, *model.per_rank) for k, v in values.items()}
    checked, wrong = model.verify(targets, returned)
    assert checked == model.nbytes and wrong == {}

    targets[1]["lm_head.weight"].array.reshape(-1).view(np.uint8)[12345] ^= 1
    targets[0]["layers.0.attn.qkv.weight"].array[-1, -1] = np.float32(7.0)
    returned["step"] = 999
    checked, wrong = model.verify(targets, returned)
    assert sorted(wrong) == ["layers.0.attn.qkv.weight", "lm_head.weight", "step"]
    assert wrong["lm_head.weight"] == 1 and wrong["step"] == 1
    assert 1 <= wrong["layers.0.attn.qkv.weight"] <= 4


def test_byte_progress_follows_the_counter() -> None:
    counter = [0]
    out = io.StringIO()

    async def transfer() -> None:
        async with ByteProgress(
            lambda: counter[0], 1000, "x", enabled=True, interval=0.01, file=out
        ):
            for _ in range(10):
                counter[0] += 90
                await asyncio.sleep(0.02)

    run_async(transfer)
    text = out.getvalue()
    assert "x:" in text and "100%" in text
    assert "90.0B/" in text or " 90" in text or "180" in text  # an intermediate state was drawn


# --------------------------------------------------------------------------- the demo


def _demo_env() -> dict[str, str]:
    return {**os.environ, "PYTHONASYNCIODEBUG": "", "PYTHONPATH": str(REPO)}


def test_demo_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "storaged", "demo", "--size", "64MiB", "--data", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=200,
        env=_demo_env(),
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "save() returned after" in out
    assert "killed node n1 (SIGKILL)" in out
    assert "restoring onto 2 ranks (saved by 4)" in out
    assert "verified: all" in out and "bytes equal the source" in out
    for figure in ("stall", "ack", "nvme", "cold", "restore"):
        assert f"  {figure} " in out
    assert list(tmp_path.iterdir()) == []  # the cluster's data is gone


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_demo_interrupted_cleans_up(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "storaged", "demo", "--size", "512MiB", "--data", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_demo_env(),
        cwd=REPO,
        start_new_session=True,  # our SIGINT goes to the demo only, as a lone Ctrl-C would not
    )
    assert proc.stdout is not None
    seen = []
    pids: list[int] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("cluster:"):
                pids = [int(p.read_text()) for p in tmp_path.glob("*/n*/node.pid")]
            if "saving demo/" in line:
                break
        assert len(pids) == 4, "".join(seen)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted" in rest and "Traceback" not in rest
    assert list(tmp_path.iterdir()) == []
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def test_demo_keeps_node_logs_on_failure(tmp_path: Path) -> None:
    # A STORAGED_TOKEN left in the shell (as `storaged up` suggests exporting) once reached
    # the demo's nodes and overrode their token: start-up then failed after a minute with
    # "nodes [...] do not see [...] alive", and the logs went with the data directory.
    env = {**_demo_env(), "STORAGED_TOKEN": "a-token-of-another-cluster"}
    proc = subprocess.run(
        [sys.executable, "-m", "storaged", "demo", "--size", "16MiB", "--data", str(tmp_path),
         "--timeout", "0", "--no-progress"],
        capture_output=True, text=True, timeout=200, env=env, cwd=REPO,
    )  # fmt: skip
    # The cluster started and the checkpoint was acknowledged; it cannot be cold at once.
    assert "acknowledged after" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "waiting for cold" in proc.stderr and "Traceback" not in proc.stderr
    kept = [line for line in proc.stdout.splitlines() if line.startswith("node logs kept in ")]
    assert len(kept) == 1, proc.stdout
    where = Path(kept[0].removeprefix("node logs kept in "))
    assert where.parent == tmp_path
    logs = sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file())
    assert logs == [f"n{i}/node.log" for i in range(4)]  # the data and the secrets are gone
    assert "serving http://127.0.0.1" in (where / "n0" / "node.log").read_text()
