"""The cluster file as ``storaged up`` keeps it (storaged/tools/cluster_file.py), without nodes.

An override edits only its own line (comments, order and every other byte stay); a
restart's plan without flags changes nothing; what follows ``--nodes`` follows it only
where ``up`` chose the value; the coordinator switches both ways, the layout kept; an
etcd file of an older ``up`` gets its port drawn once. tests/service/test_up_file.py
drives the same through the real command and real nodes.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path

import pytest

from storaged.tools.cluster_file import ClusterFile, ClusterFileError, UpFlags, plan
from storaged.tools.local_cluster import LocalCluster, free_port_block


def _written(path: Path, flags: UpFlags) -> ClusterFile:
    """Plan and write as ``up`` does, auth included."""
    file = plan(path, flags)
    layout = file.layout
    cluster = LocalCluster(layout.nodes, path.parent, layout.port, layout.peer_port, token="t")
    file.set_auth(cluster.keep_auth(file.auth()))
    file.write()
    return file


def _diff(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def test_an_override_edits_its_line_alone(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    _written(path, UpFlags(port=7400))
    text = path.read_text().replace("[tiers]", "# sized for the test box\n[tiers]")
    text = text.replace('cold_capacity = "100GiB"', 'cold_capacity = "1TiB"   # the big array')
    path.write_text(text + "\n# end of file\n")
    before = path.read_text()

    unchanged = _written(path, UpFlags(port=7400, memory="2048MiB"))  # = 2GiB: no override
    assert not unchanged.changed and unchanged.said == []
    assert path.read_text() == before

    file = _written(path, UpFlags(memory="3GiB", replication=2))
    assert file.said == [
        f'storaged up: --memory 3GiB overrides [tiers] memory_capacity = "2GiB" in {path}',
        f"storaged up: --replication 2 overrides replication = 3 in {path}",
    ]
    assert _diff(before, path.read_text()) == [
        "-replication = 3",
        "+replication = 2",
        '-memory_capacity = "2GiB"',
        '+memory_capacity = "3GiB"',
    ]


def test_what_follows_nodes_follows_only_where_up_chose_it(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    _written(path, UpFlags())
    file = _written(path, UpFlags(nodes=2))
    doc = tomllib.loads(path.read_text())
    assert (doc["replication"], doc["erasure"]["k"], doc["erasure"]["n"]) == (2, 3, 6)
    assert [n["id"] for n in doc["nodes"]] == ["n0", "n1"]
    assert file.said[0] == f"storaged up: --nodes 2 overrides the 4 nodes of {path}"
    assert len(file.said) == 3  # replication and erasure: each said

    # Set by hand: kept when the number of nodes changes again.
    path.write_text(path.read_text().replace("k = 3", "k = 2"))
    file = _written(path, UpFlags(nodes=5))
    doc = tomllib.loads(path.read_text())
    assert (doc["replication"], doc["erasure"]["k"]) == (3, 2)
    assert [n["url"] for n in doc["nodes"]][-1] == "http://127.0.0.1:7404"
    assert [n["data"] for n in doc["nodes"]][-1] == str(tmp_path / "n4")


def test_the_coordinator_switches_both_ways_keeping_the_layout(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    port = free_port_block(9)
    _written(path, UpFlags(port=port, peer_port=port + 4))
    file = _written(path, UpFlags(coordinator="etcd"))
    doc = tomllib.loads(path.read_text())
    assert "nodes" not in doc
    assert {k: doc["up"][k] for k in ("nodes", "port", "peer_port")} == {
        "nodes": 4, "port": port, "peer_port": port + 4,
    }  # fmt: skip
    etcd_port = doc["up"]["etcd_port"]
    assert file.layout.etcd_port == etcd_port
    assert {etcd_port, etcd_port + 1}.isdisjoint(file.layout.node_ports)
    assert "--coordinator etcd overrides the embedded coordinator" in file.said[0]
    assert f"etcd gets port {etcd_port}" in file.said[1]

    before = path.read_bytes()
    again = plan(path, UpFlags())  # no flag: still etcd, same port
    assert again.layout.etcd_port == etcd_port and not again.said
    assert path.read_bytes() == before

    back = _written(path, UpFlags(coordinator="embedded"))
    doc = tomllib.loads(path.read_text())
    assert "up" not in doc and back.layout.etcd_port is None
    assert doc["nodes"][3]["url"] == f"http://127.0.0.1:{port + 3}"
    assert "checkpoints committed on etcd are not listed" in back.said[0]


def test_an_older_etcd_file_gets_its_port_kept(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    # As the `up` before issue 17 wrote it on etcd: no [[nodes]], no [up].
    LocalCluster(4, tmp_path, 7400, coordinator="etcd://127.0.0.1:1").write_config()
    file = _written(path, UpFlags())
    assert file.layout.etcd_port
    assert tomllib.loads(path.read_text())["up"]["etcd_port"] == file.layout.etcd_port
    assert plan(path, UpFlags()).layout.etcd_port == file.layout.etcd_port


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ("[up]\nnodes = 4\nports = 7400\n", "unknown key [up] ports"),
        ("[up]\nnodes = 4\netcd_port = 99999\n", "[up] etcd_port: write a number 1..65535"),
        ("[up]\nnodes = 4\nport = 7400\npeer_port = 7402\n", "the nodes' ports overlap"),
    ],
)
def test_a_bad_up_table_is_refused(tmp_path: Path, table: str, named: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('replication = 3\n[auth]\ncluster_secret = "s"\n' + table)
    with pytest.raises(ClusterFileError, match=named.replace("[", r"\[").replace("]", r"\]")):
        plan(path, UpFlags())
