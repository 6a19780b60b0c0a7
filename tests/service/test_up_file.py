"""``storaged up`` keeps the operator's cluster file (issue 17), through the real command.

A hand edit of ``[tiers]`` (and a comment) survives a restart, byte for byte, and the
nodes run with it; a restart without flags keeps every value of the file, its ports
included; a flag given overrides the file, one line per override; ``--nvme`` and
``--cold`` set the tiers' capacities. On etcd: the etcd port is kept in the file, so a
node joined by hand finds etcd again after a restart (which needs no
``--coordinator etcd`` again); a taken etcd port is refused, ``--etcd-port`` moves it. A
malformed file is refused in one line naming the file and the key, and left as it was.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from storaged.tools.local_cluster import free_port_block
from tests.service.test_up import (
    Up,
    _alive,
    _client,
    _env,
    _figures,
    _one_line,
    _run_up,
    _wait,
    needs_etcd,
)
from tests.service.test_up import ups as ups  # the fixture: stops every Up after a test

pytestmark = pytest.mark.timeout(300)

MiB, GiB = 2**20, 2**30


def _capacities(up: Up, token: str) -> dict[str, tuple[int, int, int]]:
    """(memory, nvme, cold) capacity of each node, as ``storaged nodes --json`` shows them,
    once every node's has reached the node asked: a peer's usage comes with its heartbeats,
    so right after "4 nodes up" a loaded machine may still show a peer's as 0 (failed so)."""
    deadline = time.monotonic() + 30
    while True:
        listed = _client(up, token, "nodes", "--json")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        rows = json.loads(listed.stdout)["nodes"]
        found = {
            r["id"]: (r["memory"]["capacity"], r["nvme"]["capacity"], r["cold"]["capacity"])
            for r in rows
        }
        if all(all(c) for c in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


def _overrides(up: Up) -> list[str]:
    return [line for line in up.lines if " overrides " in line or " sets " in line]


def test_hand_edits_are_kept_and_flags_override_them_saying_so(
    tmp_path: Path, ups: list[Up]
) -> None:
    data = tmp_path / "cluster"
    config = data / "cluster.toml"
    port = free_port_block(9)
    # A new cluster with --nvme and --cold: in the file like --memory, and in force.
    first = Up(data, port, "--nvme", "2GiB", "--cold", "3GiB")
    ups.append(first)
    first.started()
    token = first.token()
    assert _capacities(first, token) == {f"n{i}": (128 * MiB, 2 * GiB, 3 * GiB) for i in range(4)}
    tiers = tomllib.loads(config.read_text())["tiers"]
    assert tiers == {"memory_capacity": "128MiB", "nvme_capacity": "2GiB", "cold_capacity": "3GiB"}
    assert _overrides(first) == []
    assert first.stop() == 0

    # The operator edits [tiers] by hand, with comments.
    text = config.read_text()
    text = text.replace('nvme_capacity = "2GiB"', 'nvme_capacity = "5GiB"  # the small disk')
    text = "# my cluster: hands off\n" + text
    config.write_text(text)
    config.chmod(0o600)
    before = config.read_bytes()

    # A restart without any flag: the file's ports, tokens and capacities, the file as it was.
    again = Up(data, port, flags=False)
    ups.append(again)
    again.started()
    assert again.token() == token
    assert _capacities(again, token) == {f"n{i}": (128 * MiB, 5 * GiB, 3 * GiB) for i in range(4)}
    assert _overrides(again) == []
    assert config.read_bytes() == before
    assert again.stop() == 0
    assert config.read_bytes() == before

    # Flags given: each override is one line, and applied; what was not given stays.
    third = Up(data, port, "--memory", "256MiB", "--cold", "4GiB", "--nvme", "5GiB", flags=False)
    ups.append(third)
    third.started()
    path = str(config)
    assert _overrides(third) == [
        f'storaged up: --memory 256MiB overrides [tiers] memory_capacity = "128MiB" in {path}',
        f'storaged up: --cold 4GiB overrides [tiers] cold_capacity = "3GiB" in {path}',
    ]  # --nvme 5GiB is what the file says: no override
    assert _capacities(third, token) == {f"n{i}": (256 * MiB, 5 * GiB, 4 * GiB) for i in range(4)}
    text = config.read_text()
    assert text.startswith("# my cluster: hands off\n")
    assert 'nvme_capacity = "5GiB"  # the small disk' in text
    doc = tomllib.loads(text)
    assert doc["tiers"]["memory_capacity"] == "256MiB" and doc["tiers"]["cold_capacity"] == "4GiB"
    assert [n["url"] for n in doc["nodes"]] == [f"http://127.0.0.1:{port + i}" for i in range(4)]
    assert third.stop() == 0


def test_a_port_override_moves_the_nodes_and_is_said(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "cluster"
    config = data / "cluster.toml"
    port, moved = free_port_block(9), free_port_block(9)
    first = Up(data, port)
    ups.append(first)
    first.started()
    token = first.token()
    assert first.stop() == 0

    second = Up(data, moved, "--port", str(moved), flags=False)
    ups.append(second)
    second.started()
    assert _overrides(second) == [
        f"storaged up: --port {moved} overrides the nodes' HTTP ports {port}-{port + 3} in {config}"
    ]
    doc = tomllib.loads(config.read_text())
    assert [n["url"] for n in doc["nodes"]] == [f"http://127.0.0.1:{moved + i}" for i in range(4)]
    assert [n["peer"] for n in doc["nodes"]] == [f"127.0.0.1:{port + 4 + i}" for i in range(4)]
    # "nodes up" is each node serving; n0 hears n3 a heartbeat later (a full run at load
    # 16 asked before it had).
    _wait("n0 sees n3 alive", lambda: _sees_alive(second, token, "n3"))
    assert second.stop() == 0


def _file_as_up_writes_it(data: Path, port: int) -> Path:
    """The cluster file ``up --port PORT --peer-port PORT+4 --memory 128MiB`` makes, without
    starting its nodes (the refusals below need no running cluster)."""
    from storaged.tools.cluster_file import UpFlags, plan
    from storaged.tools.local_cluster import LocalCluster

    file = plan(data / "cluster.toml", UpFlags(port=port, peer_port=port + 4, memory="128MiB"))
    cluster = LocalCluster(nodes=4, data=data, port=port, peer_port=port + 4, token="t")
    file.set_auth(cluster.keep_auth(file.auth()))
    assert file.write()
    return file.path


EDITS = {
    "toml": ("[tiers]", "[tiers\n", "is not valid TOML"),
    "unknown-in-table": (
        "[tiers]",
        "[tiers]\nram_capacity = 5",
        "unknown key [tiers] ram_capacity",
    ),
    "unknown-top": ("replication = 3", "replicaton = 3", "unknown key replicaton"),
    "size": ('"128MiB"', '"lots"', "[tiers] memory_capacity: not a size: 'lots'"),
    "misfit": ("replication = 3", "replication = 9", "replication=9 needs 1..4"),
    "node-id": ('id = "n2"', 'id = "x2"', "[[nodes]] entry 3 (x2): storaged up names"),
    "up-table": ("[auth]", "[up]\nports = 3\n[auth]", "[up] is for --coordinator etcd"),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_malformed_cluster_file_is_refused_in_one_line_and_left_as_it_is(
    tmp_path: Path, case: str
) -> None:
    data = tmp_path / "cluster"
    port = free_port_block(9)
    config = _file_as_up_writes_it(data, port)
    old, new, named = EDITS[case]
    text = config.read_text()
    assert old in text
    config.write_text(text.replace(old, new, 1))
    before = config.read_bytes()

    for flags in ((), ("--memory", "256MiB")):  # without flags, and with one to apply
        refused = _run_up(data, port, *flags, flags=False)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        line = _one_line(refused.stderr)
        assert line.startswith(f"storaged up: {config}"), line
        assert named in line, line
        assert refused.stdout == ""  # no override said, nothing started
        assert config.read_bytes() == before
        assert not list(data.glob("n*/node.pid"))


def test_a_bad_flag_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    port = free_port_block(9)
    for flags, named in (
        (("--nvme", "lots"), "--nvme lots: not a size"),
        (("--nodes", "0"), "--nodes: at least 1"),
        (("--etcd-port", "2379"), "--etcd-port is for --coordinator etcd"),
        (("--port", str(port), "--peer-port", str(port + 2)), "ports overlap"),
    ):
        refused = _run_up(data, port, *flags, flags=False)
        assert refused.returncode == 2, refused.stderr
        assert named in _one_line(refused.stderr)
        assert not (data / "cluster.toml").exists()
    config = _file_as_up_writes_it(data, port)
    before = config.read_bytes()
    refused = _run_up(data, port, "--cold", "1.5 lots", flags=False)
    assert refused.returncode == 2
    assert "--cold 1.5 lots: not a size" in _one_line(refused.stderr)
    assert config.read_bytes() == before


# --------------------------------------------------------------------------- on etcd


def _etcd_url(up: Up) -> str:
    line = up.lines[up.wait_for("  etcd etcd://")]
    return line.split()[1]


def _serve_by_hand(data: Path, etcd_url: str, node: str, port: int) -> subprocess.Popen[bytes]:
    """A node joined by hand, as the README shows, to ``up``'s etcd."""
    node_dir = data.parent / f"hand-{node}"
    node_dir.mkdir(exist_ok=True)
    log = open(node_dir / "node.log", "ab")  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "storaged", "serve", "--config",
             str(data / "cluster.toml"), "--coordinator", etcd_url, "--node", node,
             "--url", f"http://127.0.0.1:{port}", "--peer", f"127.0.0.1:{port + 1}",
             "--data", str(node_dir)],
            stdout=log, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip
    finally:
        log.close()


def _sees_alive(up: Up, token: str, node: str) -> bool:
    try:
        entry = _figures(up, token, 0).get(node)
    except (AssertionError, OSError):
        return False
    return entry is not None and bool(entry["alive"])


@needs_etcd
def test_etcd_port_is_kept_and_a_node_joined_by_hand_survives_a_restart(
    tmp_path: Path, ups: list[Up]
) -> None:
    data = tmp_path / "cluster"
    config = data / "cluster.toml"
    port = free_port_block(9)
    first = Up(data, port, "--coordinator", "etcd")
    ups.append(first)
    first.started()
    token = first.token()
    url = _etcd_url(first)
    etcd_port = int(url.rpartition(":")[2])
    assert tomllib.loads(config.read_text())["up"] == {
        "nodes": 4, "port": port, "peer_port": port + 4, "etcd_port": etcd_port,
    }  # fmt: skip
    assert any(f"etcd gets port {etcd_port}" in line for line in first.lines), first.output
    blob = os.urandom(300_000)
    (tmp_path / "in.bin").write_bytes(blob)
    saved = _client(first, token, "save", str(tmp_path / "in.bin"), "kept/one",
                    "--format", "raw", "--no-progress")  # fmt: skip
    assert saved.returncode == 0, saved.stderr

    hand_port = free_port_block(2)
    hand = _serve_by_hand(data, url, "n9", hand_port)
    try:
        _wait("n0 sees the node joined by hand", lambda: _sees_alive(first, token, "n9"))
        before = config.read_bytes()
        assert first.stop() == 0

        # No --coordinator etcd this time: the file says etcd; the same port, the same file.
        again = Up(data, port, flags=False)
        ups.append(again)
        again.started()
        assert _etcd_url(again) == url
        assert config.read_bytes() == before
        assert _overrides(again) == [] and "etcd gets port" not in again.output
        assert hand.poll() is None  # it waited for etcd meanwhile
        _wait("n0 sees the node joined by hand again", lambda: _sees_alive(again, token, "n9"))
        listing = _client(again, token, "ls", "kept/", "--json")
        assert listing.returncode == 0, listing.stderr
        assert [c["name"] for c in json.loads(listing.stdout)["checkpoints"]] == ["kept/one"]
        assert again.stop() == 0
    finally:
        if hand.poll() is None:
            hand.send_signal(signal.SIGTERM)
            try:
                hand.wait(timeout=60)
            except subprocess.TimeoutExpired:
                hand.kill()
                hand.wait(timeout=10)


@needs_etcd
def test_a_taken_etcd_port_is_refused_and_etcd_port_moves_it(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "cluster"
    config = data / "cluster.toml"
    port = free_port_block(9)
    first = Up(data, port, "--coordinator", "etcd")
    ups.append(first)
    first.started()
    etcd_port = int(_etcd_url(first).rpartition(":")[2])
    assert first.stop() == 0
    before = config.read_bytes()

    for taken, what in ((etcd_port, "port"), (etcd_port + 1, "peer port")):
        with socket.create_server(("127.0.0.1", taken)):
            refused = _run_up(data, port, flags=False)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        line = _one_line(refused.stderr)
        assert f"etcd's {what} {taken} ([up] etcd_port = {etcd_port} in {config})" in line, line
        assert "taken by another process" in line and "--etcd-port" in line, line
        assert "nodes up" not in refused.stdout
        assert config.read_bytes() == before
    assert not _alive(int((data / "etcd.pid").read_text()))

    moved = free_port_block(2)
    again = Up(data, port, "--etcd-port", str(moved), flags=False)
    ups.append(again)
    again.started()
    assert _overrides(again) == [
        f"storaged up: --etcd-port {moved} overrides [up] etcd_port = {etcd_port} in {config}"
    ]
    assert _etcd_url(again) == f"etcd://127.0.0.1:{moved}"
    assert tomllib.loads(config.read_text())["up"]["etcd_port"] == moved
    assert again.stop() == 0
    # Still taken when given explicitly: said so, nothing changed.
    after = config.read_bytes()
    with socket.create_server(("127.0.0.1", moved)):
        refused = _run_up(data, port, "--etcd-port", str(moved), flags=False)
    assert refused.returncode == 1
    assert f"etcd's port {moved} (--etcd-port {moved}) is taken" in _one_line(refused.stderr)
    assert config.read_bytes() == after
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(int((data / "etcd.pid").read_text())):
        time.sleep(0.1)
