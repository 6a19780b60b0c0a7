"""Configuration: the cluster file, then STORAGED_* variables, then flags; refusals say why."""

from __future__ import annotations

from pathlib import Path

import pytest

from storaged.config import ConfigError, load_config, parse_size

CLUSTER = """
replication = 3
max_chunk_size = "8MiB"
[erasure]
codec = "zfec"
k = 4
n = 6
[tiers]
memory_capacity = "1GiB"
[auth]
token_env = "MY_TOKEN"
cluster_secret = "s3cret"
{nodes}
"""


def _write(tmp_path: Path, nodes: int = 4, extra: str = "") -> Path:
    entries = "".join(
        f'[[nodes]]\nid = "n{i}"\nurl = "http://127.0.0.1:{7000 + i}"\n'
        f'peer = "127.0.0.1:{8000 + i}"\ndata = "{tmp_path}/n{i}"\n'
        for i in range(nodes)
    )
    path = tmp_path / "cluster.toml"
    path.write_text(extra + CLUSTER.format(nodes=entries))
    return path


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = _write(tmp_path)
    cfg = load_config(path, "n1", environ={"MY_TOKEN": "tok"})
    assert cfg.max_chunk_size == 8 * 2**20 and cfg.memory_capacity == 2**30
    assert cfg.token == "tok" and cfg.cluster_secret == "s3cret"
    assert cfg.node.url == "http://127.0.0.1:7001" and cfg.node.peer_addr == ("127.0.0.1", 8001)
    assert cfg.data_dir == tmp_path / "n1"
    env = {"STORAGED_MEMORY_CAPACITY": "2GiB", "STORAGED_PUT_WAIT": "3.5"}
    cfg = load_config(path, "n1", environ=env)
    assert cfg.memory_capacity == 2 * 2**30 and cfg.put_wait == 3.5
    cfg = load_config(path, "n1", environ=env, overrides={"memory_capacity": "512MiB"})
    assert cfg.memory_capacity == 512 * 2**20 and cfg.put_wait == 3.5
    assert cfg.gone_after == 600.0 and cfg.rebalance_rate == 32 * 2**20
    cfg = load_config(path, "n1", environ={"STORAGED_REBALANCE_RATE": "8MiB"})
    assert cfg.rebalance_rate == 8 * 2**20


@pytest.mark.parametrize(
    ("nodes", "settings", "message"),
    [
        (4, {"k": "5"}, "losing one node could lose cold data"),
        (2, {}, "replication=3 needs 1..2"),
        (4, {"k": "0"}, "1 <= k < n <= 256"),
        (4, {"max_chunk_size": "4GiB"}, "max_chunk_size"),
        (4, {"memory_capacity": "lots"}, "not a size"),
        (4, {"tls_cert": "/x.pem"}, "TLS needs both"),
        (4, {"gone_after": "-1"}, "gone_after=-1.0: write seconds, 0 or more"),
        (4, {"rebalance_rate": "0"}, "rebalance_rate must be at least 1"),
    ],
)
def test_refusals_say_why(
    tmp_path: Path, nodes: int, settings: dict[str, object], message: str
) -> None:
    path = _write(tmp_path, nodes)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(path, "n0", environ={}, overrides=settings)


def test_unknown_node_and_setting(tmp_path: Path) -> None:
    path = _write(tmp_path)
    with pytest.raises(ConfigError, match="not in the cluster file"):
        load_config(path, "n9", environ={})
    path = _write(tmp_path, extra="typo_setting = 1\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(path, "n0", environ={})


def test_parse_size() -> None:
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("2 GB") == 2 * 10**9
    assert parse_size(4096) == 4096
    for bad in ("", "12 parsecs", True, "-1"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_peer_routes_redirect_dialing_and_bad_ones_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path)
    cfg = load_config(path, "n0", environ={"STORAGED_PEER_ROUTES": "n1=127.0.0.1:9101"})
    n1, n2 = cfg.nodes[1], cfg.nodes[2]
    assert cfg.dial_addr(n1) == ("127.0.0.1", 9101)
    assert cfg.dial_addr(n2) == n2.peer_addr
    with pytest.raises(ConfigError, match="node=host:port"):
        load_config(path, "n0", environ={"STORAGED_PEER_ROUTES": "n1"})
