"""Node configuration: one frozen dataclass.

Sources, weakest first: the cluster file (TOML), ``STORAGED_*`` environment
variables, command-line flags. Every scalar field ``foo_bar`` can be set by
``STORAGED_FOO_BAR`` and ``--foo-bar``.

Cluster file::

    replication = 3
    max_chunk_size = "64MiB"
    [erasure]
    codec = "zfec"            # or "isal"
    k = 4
    n = 6
    [tiers]
    memory_capacity = "2GiB"
    nvme_capacity = "100GiB"
    cold_capacity = "100GiB"
    [auth]
    token_env = "STORAGED_TOKEN"    # or token = "..."
    admin_token_env = "STORAGED_ADMIN_TOKEN"  # or admin_token = "...": /v1/admin/ only
    cluster_secret_env = "STORAGED_CLUSTER_SECRET"  # or cluster_secret = "..."
    [[nodes]]
    id = "n0"
    url = "http://127.0.0.1:7400"
    peer = "127.0.0.1:8400"       # the peer (replication) protocol's address
    data = "/var/lib/storaged/n0" # nvme/, cold/, catalog/ live under it
    [archive]                     # the archive tier (docs/OPERATIONS.md); optional
    url = "s3://bucket/cluster-a" # or "file:///mnt/lustre/storaged"; the same on every node
    endpoint = "http://10.0.0.9:8080"  # an S3-compatible server (default: AWS's)
    region = "us-east-1"          # credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
    [up]                          # read by `storaged up` alone (storaged/tools/cluster_file.py)
    etcd_port = 23790
    [[retention]]                 # retention policies per name prefix (storaged/retention.py)
    prefix = "job42/"
    keep_last = 3
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from storaged.domains import domain_key, fragments_per_node, sizes
from storaged.retention import Policy, PolicyError, parse_rules


class ConfigError(Exception):
    """The configuration is unusable; the message says why and what to change."""


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}  # fmt: skip


def parse_size(value: object) -> int:
    """``4096``, ``"64MiB"``, ``"2 GB"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (e.g. 4096, '64MiB', '2GB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True, slots=True)
class NodeSpec:
    id: str
    url: str
    peer: str  # "host:port"
    data: str = ""
    #: the failure domain it shares with others (a rack, a switch, a power feed); empty:
    #: a domain of its own (storaged/domains.py)
    domain: str = ""

    @property
    def failure_domain(self) -> str:
        return domain_key(self.id, self.domain)

    @property
    def peer_addr(self) -> tuple[str, int]:
        host, _, port = self.peer.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def http_addr(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        default = 443 if parts.scheme == "https" else 80
        return parts.hostname or "127.0.0.1", parts.port or default


@dataclass(frozen=True, slots=True)
class Config:
    node_id: str = ""
    nodes: tuple[NodeSpec, ...] = ()
    replication: int = 3
    codec: str = "zfec"
    k: int = 4
    n: int = 6
    max_chunk_size: int = 64 * 2**20
    memory_capacity: int = 2 * 2**30
    nvme_capacity: int = 100 * 2**30
    cold_capacity: int = 100 * 2**30
    data: str = ""  # this node's data directory (default: its [[nodes]] entry's `data`)
    token: str = ""
    #: bearer token of the admin endpoints (``/v1/admin/``); see docs/API.md for who may
    #: call them when it is empty
    admin_token: str = ""
    cluster_secret: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    #: how long a PUT waits for RAM before 503 memory_full
    put_wait: float = 10.0
    heartbeat_interval: float = 0.5
    down_after: float = 3.0
    #: unreferenced chunks younger than this are kept (uploads not yet committed)
    gc_grace: float = 3600.0
    gc_interval: float = 30.0
    #: newest checkpoints per prefix whose chunks stay on nvme at their owner once cold
    retain_newest: int = 1
    repair_interval: float = 10.0
    #: a node down for less than this is *away*: its nvme copies and fragments are expected
    #: back, so repair waits for it while every chunk can still lose one more holder; down
    #: longer, it is *gone*: what it held is rebuilt elsewhere (and, on etcd, its member
    #: record is removed). As Ceph's mon_osd_down_out_interval or HDFS's dead-node interval.
    gone_after: float = 600.0
    #: bytes per second a node moves to where placement says after a join or a return
    #: (rebalance); repair of missing copies and fragments is not limited by it
    rebalance_rate: int = 32 * 2**20
    scrub_interval: float = 3600.0
    drain_workers: int = 2
    encode_workers: int = 1
    #: background work (drain, encode) yields to PUTs in flight for at most this long per
    #: chunk, so that acks get the CPU; drain stops yielding when RAM is half dirty
    drain_defer: float = 1.0
    encode_defer: float = 5.0
    #: share of the RAM tier mapped and pre-faulted at start-up as 8 MiB buffers (fresh pages
    #: cost the first writes about twice: see docs/BENCHMARKS.md)
    prefault_fraction: float = 0.25
    #: an idle connection, or one that has not sent complete headers, is closed after this
    keepalive_timeout: float = 15.0
    #: a PUT body that delivers no byte for this long is abandoned (nothing is kept)
    body_timeout: float = 30.0
    #: a PUT body must arrive within max(body_min_time, size / body_min_rate) seconds of its
    #: headers, or it is abandoned like a stalled one: a trickle cannot hold its RAM forever
    body_min_rate: int = 1 * 2**20
    body_min_time: float = 5.0
    #: PUTs in flight (each holding a RAM reservation) per client address; more get 503
    max_client_puts: int = 64
    max_manifest_size: int = 64 * 2**20
    #: a graceful stop (SIGTERM) waits this long at most for PUTs in flight and for the
    #: drain of RAM-only chunks to disk before the node exits
    stop_timeout: float = 120.0
    #: a commit's catalogue writes must end within this many seconds of its chunk check;
    #: the chunks it names are kept at least this long past the check (see pipeline/gc.py)
    commit_window: float = 30.0
    #: a decoded manifest holds at most this many objects (containers and their elements):
    #: it bounds the RAM a small body can expand into
    max_manifest_objects: int = 2_000_000
    #: items of one key in a manifest (shards of one tensor)
    max_items_per_key: int = 16384
    #: chunk ids in one ``POST /v1/chunks/missing``
    max_missing_ids: int = 65536
    #: where this node dials its peers, when not at their advertised ``peer`` address:
    #: ``"n1=127.0.0.1:9101,n2=127.0.0.1:9102"``. For fault-injection proxies on the peer
    #: links (tests/nemesis) and for NAT; empty: dial every peer where the cluster file says.
    peer_routes: str = ""
    #: where membership and the catalogue live: "" = embedded (cluster file, heartbeats,
    #: records on the nodes); "etcd://host:port[,host:port...][/prefix]" = an etcd cluster
    #: (then no cluster file is needed: this node is ``node_id`` at ``url`` and ``peer``)
    coordinator: str = ""
    #: this node's advertised HTTP URL and peer address when no cluster file lists it
    url: str = ""
    peer: str = ""
    #: this node's failure domain when no cluster file lists it (on etcd: its member record
    #: carries it); in a cluster file, each [[nodes]] entry's ``domain``
    domain: str = ""
    #: the archive tier (docs/OPERATIONS.md "Archive tier"): ``s3://bucket[/prefix]`` or
    #: ``file:///path`` (a Lustre or NFS mount), the same on every node of the cluster;
    #: empty: none. Its credentials come from the environment (``AWS_ACCESS_KEY_ID``,
    #: ``AWS_SECRET_ACCESS_KEY``, as AWS's tools), never from the cluster file.
    archive: str = ""
    #: an S3-compatible server (``http://host:port``); empty: AWS's for ``archive_region``
    archive_endpoint: str = ""
    archive_region: str = "us-east-1"
    #: ``http://bucket.host/key`` instead of ``http://host/bucket/key``
    archive_virtual_hosted: bool = False
    #: the bytes this cluster may put in the archive (an object store has no size of its own)
    archive_capacity: int = 2**50
    #: RAM for chunks read through from the archive (no node held them): a cache, not a
    #: copy of the chunk's life (never drained, encoded or counted as a holder)
    archive_cache_size: int = 2**30
    log_level: str = "INFO"
    log_json: bool = False
    #: the retention policy of the cluster file's ``[[retention]]`` tables (on etcd: the
    #: policy ``storaged retention set`` stores there wins); applied by the leader
    retention: Policy = dataclasses.field(default_factory=Policy)
    #: seconds between the retention leader's passes (``pipeline/retention.py``)
    retention_interval: float = 60.0

    # ---- derived -------------------------------------------------------------------------
    @property
    def node(self) -> NodeSpec:
        for spec in self.nodes:
            if spec.id == self.node_id:
                return spec
        if self.coordinator and self.url and self.peer:
            return NodeSpec(self.node_id, self.url.rstrip("/"), self.peer, self.data, self.domain)
        raise ConfigError(f"node {self.node_id!r} is not in the cluster file")

    @property
    def data_dir(self) -> Path:
        return Path(self.data or self.node.data)

    def dial_addr(self, spec: NodeSpec) -> tuple[str, int]:
        """The address this node connects to for peer calls to ``spec``."""
        for route in filter(None, (r.strip() for r in self.peer_routes.split(","))):
            node_id, _, addr = route.partition("=")
            if node_id.strip() == spec.id:
                return NodeSpec(spec.id, spec.url, addr.strip()).peer_addr
        return spec.peer_addr

    def validate(self) -> Config:
        if not self.cluster_secret:
            raise ConfigError(
                "no cluster secret: set [auth] cluster_secret / cluster_secret_env or "
                "STORAGED_CLUSTER_SECRET (peer traffic is always authenticated)"
            )
        if self.coordinator:
            return self._validate_coordinated()
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError("node ids must be unique")
        if not self.nodes:
            raise ConfigError("the cluster file lists no [[nodes]]")
        _ = self.node
        if not self.data_dir.parts:
            raise ConfigError(f"node {self.node_id}: no data directory (set `data`)")
        if not 1 <= self.replication <= len(self.nodes):
            raise ConfigError(
                f"replication={self.replication} needs 1..{len(self.nodes)} (the number of nodes)"
            )
        if not (1 <= self.k < self.n <= 256):
            raise ConfigError(f"erasure k={self.k} n={self.n}: need 1 <= k < n <= 256")
        if self.domain and self.domain != self.node.domain:
            raise ConfigError(
                f"domain {self.domain!r}: node {self.node_id}'s entry in the cluster file says "
                f"{self.node.domain or 'none'}; with a cluster file its [[nodes]] entries say "
                "each node's domain"
            )
        # Fragment i goes to the i-th node of a placement order (wrapping, domains taking
        # turns: storaged/domains.py), so one node holds up to ceil(n / nodes) fragments
        # (more on a small domain's nodes); losing it must leave >= k of them.
        per_node = fragments_per_node(sizes(n.failure_domain for n in self.nodes), self.n)
        if per_node > self.n - self.k:
            raise ConfigError(
                f"erasure k={self.k} of n={self.n} over {len(self.nodes)} nodes puts up to "
                f"{per_node} fragments on one node, but only n-k={self.n - self.k} may be lost: "
                "losing one node could lose cold data. Lower k, raise n, or add nodes "
                f"(with {len(self.nodes)} nodes, e.g. k={max(1, self.n - per_node)} of n={self.n})."
            )
        if self.max_chunk_size <= 0 or self.max_chunk_size > self.memory_capacity:
            raise ConfigError("max_chunk_size must be positive and fit in memory_capacity")
        return self._validate_links()

    def _validate_links(self) -> Config:
        for route in filter(None, (r.strip() for r in self.peer_routes.split(","))):
            _, eq, addr = route.partition("=")
            if not eq or not re.fullmatch(r"\S+:\d+", addr.strip()):
                raise ConfigError(
                    f"peer_routes entry {route!r}: write node=host:port, e.g. n1=127.0.0.1:9101"
                )
        if self.admin_token and self.admin_token == self.token:
            raise ConfigError(
                "admin_token must differ from the client token (else every client is an admin)"
            )
        for name in (
            "body_min_rate",
            "max_client_puts",
            "max_manifest_objects",
            "max_items_per_key",
            "max_missing_ids",
            "rebalance_rate",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.gone_after < 0:
            raise ConfigError(f"gone_after={self.gone_after}: write seconds, 0 or more")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both tls_cert and tls_key")
        if self.archive and not re.fullmatch(r"s3://[^/\s]+(/\S*)?|file:///\S*", self.archive):
            raise ConfigError(
                f"archive {self.archive!r}: write s3://bucket[/prefix] or file:///path"
            )
        if self.archive_endpoint and not re.fullmatch(r"https?://\S+", self.archive_endpoint):
            raise ConfigError(
                f"archive endpoint {self.archive_endpoint!r}: write http(s)://host:port"
            )
        return self

    def _validate_coordinated(self) -> Config:
        """With a coordinator the members come and go at run time: no static checks of
        their number (replication, fragments per node); this node must say where it is."""
        from storaged.coord.target import parse_etcd_url

        try:
            parse_etcd_url(self.coordinator)
        except ValueError as exc:
            raise ConfigError(f"coordinator: {exc}") from None
        if not self.node_id:
            raise ConfigError("with a coordinator, name this node: --node ID")
        if not any(n.id == self.node_id for n in self.nodes):
            if not re.fullmatch(r"https?://\S+", self.url):
                raise ConfigError(f"url {self.url!r}: write this node's http://host:port")
            if not re.fullmatch(r"\S+:\d+", self.peer):
                raise ConfigError(f"peer {self.peer!r}: write this node's peer host:port")
        if not self.data_dir.parts:
            raise ConfigError(f"node {self.node_id}: no data directory (set --data)")
        if self.replication < 1 or not (1 <= self.k < self.n <= 256):
            raise ConfigError("replication >= 1 and 1 <= k < n <= 256 are needed")
        if self.max_chunk_size <= 0 or self.max_chunk_size > self.memory_capacity:
            raise ConfigError("max_chunk_size must be positive and fit in memory_capacity")
        return self._validate_links()


_SCALARS = {f.name: f for f in fields(Config) if f.name not in ("nodes", "retention")}


def _coerce(name: str, raw: object) -> Any:
    kind = _SCALARS[name].type
    try:
        if name.endswith(("_capacity", "_size")) or name == "rebalance_rate":
            return parse_size(raw)
        if kind == "int":
            return int(str(raw))
        if kind == "float":
            return float(str(raw))
        if kind == "bool":
            return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes", "on")
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot use {raw!r}: {exc}") from exc


#: tables whose keys are settings (``[tiers] memory_capacity`` is ``memory_capacity``)
_TABLES = ("erasure", "tiers", "auth", "tls", "timeouts", "archive")
#: what the archive's credentials are read from (never the cluster file: it is shared)
_ARCHIVE_SECRETS = ("access_key_id", "secret_access_key", "session_token")
#: what a node ignores: its own list, and ``storaged up``'s table (storaged/tools/cluster_file.py)
_NOT_SETTINGS = ("nodes", "up", "retention")
_NODE_KEYS = {"id": True, "url": True, "peer": True, "data": False, "domain": False}  # required?


def _file_entries(doc: Mapping[str, Any]) -> list[tuple[str, str, object]]:
    """Every setting of a cluster file as (where it is written, its setting name, value):
    ``("[tiers] memory_capacity", "memory_capacity", "2GiB")``."""
    out: list[tuple[str, str, object]] = []
    for key, value in doc.items():
        if key in _TABLES and isinstance(value, dict):
            for sub, subval in value.items():
                name = str(sub)
                if key == "tls":
                    name = {"cert": "tls_cert", "key": "tls_key"}.get(name, name)
                elif key == "archive":
                    name = "archive" if name == "url" else f"archive_{name}"
                out.append((f"[{key}] {sub}", name, subval))
        elif key not in _NOT_SETTINGS:
            out.append((str(key), str(key), value))
    return out


def _refuse_archive_secret(where: str, name: str) -> None:
    if name.removeprefix("archive_") in _ARCHIVE_SECRETS and name.startswith("archive_"):
        raise ConfigError(
            f"{where}: the archive's credentials are not written in the cluster file; set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in every node's environment"
        )


def _is_setting(name: str) -> bool:
    return name in _SCALARS or name in ("token_env", "admin_token_env", "cluster_secret_env")


def _flatten_file(doc: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    unknown = []
    for where, name, value in _file_entries(doc):
        _refuse_archive_secret(where, name)
        out[name] = value
        if not _is_setting(name):
            unknown.append(where)
    if unknown:
        raise ConfigError(f"unknown setting(s) in the cluster file: {', '.join(unknown)}")
    for secret in ("token", "admin_token", "cluster_secret"):
        env_name = out.pop(f"{secret}_env", None)
        if env_name and not out.get(secret):
            out[secret] = env.get(str(env_name), "")
    return out


def check_file_document(doc: Mapping[str, Any]) -> None:
    """``ConfigError`` naming the first key of a parsed cluster file that is unknown or
    holds a value its setting cannot take (``[tiers] memory_capacity: not a size: ...``).

    Only what each key says alone: whether the settings fit together (replication
    against the number of nodes, say) is ``Config.validate``'s.
    """
    for where, name, value in _file_entries(doc):
        _refuse_archive_secret(where, name)
        if not _is_setting(name):
            raise ConfigError(f"unknown key {where}")
        if isinstance(value, dict | list):
            raise ConfigError(f"{where}: a table or list where a value belongs")
        if name.endswith("_env") and not isinstance(value, str):
            raise ConfigError(f"{where}: write the name of an environment variable")
        if name in _SCALARS:
            try:
                _coerce(name, value)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {str(exc).removeprefix(f'{name}: ')}") from None
    nodes = doc.get("nodes", [])
    if not isinstance(nodes, list):
        raise ConfigError("nodes: write [[nodes]] tables")
    for i, entry in enumerate(nodes):
        if not isinstance(entry, dict):
            raise ConfigError(f"[[nodes]] entry {i + 1}: not a table")
        for key in entry:
            if key not in _NODE_KEYS:
                raise ConfigError(f"[[nodes]] entry {i + 1}: unknown key {key}")
        for key, required in _NODE_KEYS.items():
            if key in entry and not isinstance(entry[key], str):
                raise ConfigError(f"[[nodes]] entry {i + 1}: {key} must be a string")
            if required and key not in entry:
                raise ConfigError(f"[[nodes]] entry {i + 1}: no {key}")
    _retention(doc)


def _retention(doc: Mapping[str, Any]) -> Policy:
    try:
        return parse_rules(doc.get("retention"))
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None


def load_config(
    path: str | os.PathLike[str] | None,
    node_id: str | None,
    *,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The configuration of node ``node_id``: cluster file, then environment, then overrides."""
    doc: dict[str, Any] | None = None
    if path is not None:
        import tomllib  # here: the command line is parsed without it

        try:
            doc = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read cluster file {path}: {exc}") from exc
    return config_from_document(doc, node_id, overrides=overrides, environ=environ)


def config_from_document(
    doc: Mapping[str, Any] | None,
    node_id: str | None,
    *,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """``load_config`` of a cluster file already parsed (None: no file)."""
    values: dict[str, Any] = {}
    nodes: list[NodeSpec] = []
    env = os.environ if environ is None else environ
    retention = Policy()
    if doc is not None:
        values.update(_flatten_file(doc, env))
        retention = _retention(doc)
        for entry in doc.get("nodes", []):
            try:
                nodes.append(
                    NodeSpec(
                        id=str(entry["id"]),
                        url=str(entry["url"]).rstrip("/"),
                        peer=str(entry["peer"]),
                        data=str(entry.get("data", "")),
                        domain=str(entry.get("domain", "")),
                    )
                )
            except KeyError as exc:
                raise ConfigError(f"a [[nodes]] entry lacks {exc}") from exc
    for name in _SCALARS:
        env_value = env.get(f"STORAGED_{name.upper()}")
        if env_value is not None:
            values[name] = env_value
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
    if node_id is not None:
        values["node_id"] = node_id
    coerced = {name: _coerce(name, raw) for name, raw in values.items()}
    return dataclasses.replace(
        Config(nodes=tuple(nodes), retention=retention), **coerced
    ).validate()


def config_field_names() -> list[str]:
    """Scalar settings a flag or environment variable may override."""
    return sorted(_SCALARS)


__all__ = [
    "Config",
    "ConfigError",
    "NodeSpec",
    "check_file_document",
    "config_field_names",
    "config_from_document",
    "load_config",
    "parse_size",
]
