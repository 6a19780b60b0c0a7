"""The cluster file as ``storaged up`` keeps it: the operator's, changed only by flags given.

Without ``DIR/cluster.toml``, ``up`` makes one from its flags and defaults. With one, the
file is the operator's: every key in it is kept, hand edits included, and so are its
comments and their order (it is edited in place with tomlkit, not written anew). A flag
given on the command line with a value other than the file's overrides it, and each such
override is said in one line; a flag not given never changes the file. A restart without
flags leaves the file byte for byte as it was.

Where ``up`` runs its nodes is read back from the file too:

- embedded coordination: the ``[[nodes]]`` list, laid out as ``up`` writes it (ids
  ``n0``, ``n1``, ... on 127.0.0.1, HTTP and peer ports consecutive from n0's);
- ``--coordinator etcd``: a file without ``[[nodes]]`` (the members register in etcd),
  with an ``[up]`` table that the nodes ignore: ``nodes``, ``port``, ``peer_port`` and
  ``etcd_port``, the local etcd member's client port (its peer port is the next one),
  drawn once and kept so that a node joined by hand still finds etcd after a restart.

A file ``up`` cannot use (not TOML, an unknown key, a value its setting cannot take,
nodes laid out otherwise, settings that do not fit together) is refused in one line
naming the file and the key, before anything is written or started.
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import tomlkit
from tomlkit.container import Container
from tomlkit.items import AoT, Table

from storaged.config import ConfigError, check_file_document, config_from_document, parse_size
from storaged.tools.local_cluster import (
    ClusterError,
    choose_etcd_port,
    default_erasure,
    write_private,
)

DEFAULT_NODES = 4
DEFAULT_PORT = 7400
#: n0's peer port when none is given: its HTTP port plus this
PEER_PORT_GAP = 1000
DEFAULT_REPLICATION = 3
#: the tier capacities of a new file: --memory, --nvme, --cold
DEFAULT_CAPACITY = {"memory": "2GiB", "nvme": "100GiB", "cold": "100GiB"}
#: the keys of ``[up]`` (etcd mode only)
UP_KEYS = ("nodes", "port", "peer_port", "etcd_port")
#: tables whose keys are settings (as storaged.config flattens them)
_SETTING_TABLES = ("erasure", "tiers", "auth", "tls", "timeouts")


class ClusterFileError(ClusterError):
    """The cluster file, or a flag of ``up``, cannot be used: one line naming the file and
    the key (or the flag)."""


@dataclass(frozen=True)
class UpFlags:
    """What the operator gave on ``up``'s command line; None: not given."""

    nodes: int | None = None
    port: int | None = None
    peer_port: int | None = None
    memory: str | None = None
    nvme: str | None = None
    cold: str | None = None
    replication: int | None = None
    coordinator: str | None = None  # "embedded" or "etcd"
    etcd_port: int | None = None


@dataclass(frozen=True)
class Layout:
    """Where ``up`` runs the cluster: node ``n<i>`` on ``port + i`` and ``peer_port + i``."""

    nodes: int
    port: int
    peer_port: int
    https: bool = False
    #: the local etcd member's client port (its peer port is the next); None: embedded
    etcd_port: int | None = None

    @property
    def node_ports(self) -> set[int]:
        return {base + i for base in (self.port, self.peer_port) for i in range(self.nodes)}


@dataclass
class ClusterFile:
    """The cluster file ``up`` runs with, flags applied; written by ``write`` if changed."""

    path: Path
    doc: tomlkit.TOMLDocument
    #: the file's content as read; None when there was no file
    before: dict[str, Any] | None
    layout: Layout
    #: one line per flag that changed the file, and per value ``up`` chose for it
    said: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.before is None or self.doc.unwrap() != self.before

    def auth(self) -> dict[str, Any]:
        """The ``[auth]`` table as it stands."""
        table = self.doc.get("auth")
        return dict(table.unwrap()) if isinstance(table, Table) else {}

    def set_auth(self, auth: Mapping[str, Any]) -> None:
        """Make ``[auth]`` hold ``auth``, touching only the keys whose value differs."""
        table = self.doc.get("auth")
        if not isinstance(table, Table):
            table = tomlkit.table()
            self.doc["auth"] = table
        _sync(table, auth)

    def check(self, environ: Mapping[str, str]) -> None:
        """``ClusterFileError`` unless node n0 would start with this file (the settings fit
        together: replication and erasure against the nodes, capacities, tokens)."""
        overrides: dict[str, object] = {}
        if self.layout.etcd_port is not None:
            overrides = {
                "coordinator": f"etcd://127.0.0.1:{self.layout.etcd_port}",
                "url": f"http://127.0.0.1:{self.layout.port}",
                "peer": f"127.0.0.1:{self.layout.peer_port}",
                "data": str(self.path.parent / "n0"),
            }
        try:
            config_from_document(self.doc.unwrap(), "n0", overrides=overrides, environ=environ)
        except ConfigError as exc:
            raise ClusterFileError(f"{self.path}: {exc}") from None

    def write(self) -> bool:
        """Write the file (mode 0600, replaced at once) if it changed; whether it did.

        An unchanged file is left as it is, but for its mode: it holds the cluster secret.
        """
        if self.changed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_private(self.path, tomlkit.dumps(self.doc).encode())
            return True
        if stat.S_IMODE(self.path.stat().st_mode) != 0o600:
            os.chmod(self.path, 0o600)
        return False


def plan(path: Path, flags: UpFlags) -> ClusterFile:
    """The cluster file at ``path`` (or a new one) with ``flags`` applied, not yet written.

    ``ClusterFileError`` for a file that cannot be used as it is, or a flag that cannot be
    applied to it; nothing is written either way.
    """
    text = _read(path)
    if text is None:
        return _new(path, flags)
    try:
        before = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # It may hold the only copy of the cluster's secret: never overwrite it blindly.
        raise ClusterFileError(f"{path} is not valid TOML ({exc}): fix or remove it") from None
    try:
        check_file_document(before)
    except ConfigError as exc:
        raise ClusterFileError(f"{path}: {exc}") from None
    kept = _kept_layout(path, before)
    etcd = kept.etcd if flags.coordinator is None else flags.coordinator == "etcd"
    _check_etcd_flag(flags, etcd, f"{path} is for the embedded coordinator")
    layout = Layout(
        nodes=_first(flags.nodes, kept.nodes, DEFAULT_NODES),
        port=_first(flags.port, kept.port, DEFAULT_PORT),
        peer_port=_first(
            flags.peer_port,
            kept.peer_port,
            _first(flags.port, kept.port, DEFAULT_PORT) + PEER_PORT_GAP,
        ),
        https=kept.https,
        etcd_port=_first(flags.etcd_port, kept.etcd_port, 0) if etcd else None,
    )
    _check_ports(layout)
    edit = _Edit(path, tomlkit.parse(text), before)
    edit.coordinator(flags, kept, etcd)
    edit.layout(flags, kept, layout)
    for flag, value in (("memory", flags.memory), ("nvme", flags.nvme), ("cold", flags.cold)):
        if value is not None:
            edit.size(f"--{flag}", value, f"{flag}_capacity")
    edit.replication(flags, kept, layout)
    edit.erasure(flags, kept, layout)
    layout = edit.place(layout)
    return ClusterFile(path, edit.doc, before, layout, edit.said)


# ---- reading ------------------------------------------------------------------------------
def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ClusterFileError(f"cannot read {path}: {exc}") from None


@dataclass(frozen=True)
class _Kept:
    """Where the file says the cluster runs; None where it says nothing."""

    etcd: bool
    nodes: int | None = None
    port: int | None = None
    peer_port: int | None = None
    etcd_port: int | None = None
    https: bool = False


def _kept_layout(path: Path, doc: Mapping[str, Any]) -> _Kept:
    nodes = doc.get("nodes") or []
    up = doc.get("up")
    if up is not None:
        if nodes:
            raise ClusterFileError(
                f"{path}: [up] is for --coordinator etcd, but the file lists [[nodes]] (the "
                "embedded coordinator's): remove one of them"
            )
        if not isinstance(up, dict):
            raise ClusterFileError(f"{path}: up: write an [up] table")
        for key, value in up.items():
            if key not in UP_KEYS:
                raise ClusterFileError(
                    f"{path}: unknown key [up] {key} (it may hold {', '.join(UP_KEYS)})"
                )
            low, high = (1, 10_000) if key == "nodes" else (1, 65535)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ClusterFileError(f"{path}: [up] {key}: write a number {low}..{high}")
        return _Kept(
            etcd=True,
            nodes=up.get("nodes"),
            port=up.get("port"),
            peer_port=up.get("peer_port"),
            etcd_port=up.get("etcd_port"),
        )
    if not nodes:
        # Neither: an etcd cluster's file of an `up` that did not keep its ports yet.
        return _Kept(etcd=True)
    port = peer_port = 0
    schemes = set()
    for i, entry in enumerate(nodes):
        where = f"{path}: [[nodes]] entry {i + 1} ({entry['id']})"
        if entry["id"] != f"n{i}":
            raise ClusterFileError(
                f'{where}: storaged up names its nodes n0, n1, ... in order (id = "n{i}"); '
                "run other layouts with storaged serve"
            )
        parts = urlsplit(entry["url"])
        try:
            http = parts.port
        except ValueError:
            http = None
        if parts.scheme not in ("http", "https") or parts.hostname != "127.0.0.1" or not http:
            raise ClusterFileError(
                f"{where}: url {entry['url']!r}: storaged up runs its nodes at "
                "http://127.0.0.1:PORT (run others with storaged serve)"
            )
        host, _, peer_text = entry["peer"].rpartition(":")
        if host != "127.0.0.1" or not peer_text.isdigit():
            raise ClusterFileError(
                f"{where}: peer {entry['peer']!r}: storaged up runs its nodes at 127.0.0.1:PORT"
            )
        if i == 0:
            port, peer_port = http, int(peer_text)
        elif http != port + i or int(peer_text) != peer_port + i:
            raise ClusterFileError(
                f"{where}: storaged up runs n{i} on n0's ports + {i} (url port {port + i}, "
                f"peer port {peer_port + i}); change them all with --port and --peer-port"
            )
        schemes.add(parts.scheme)
    if len(schemes) > 1:
        raise ClusterFileError(f"{path}: [[nodes]]: every url is http or every one https")
    return _Kept(etcd=False, nodes=len(nodes), port=port, peer_port=peer_port,
                 https="https" in schemes)  # fmt: skip


def _first(*values: int | None) -> int:
    for value in values:
        if value is not None:
            return value
    raise AssertionError("no default")


def _check_etcd_flag(flags: UpFlags, etcd: bool, why: str) -> None:
    if flags.etcd_port is not None and not etcd:
        raise ClusterFileError(f"--etcd-port is for --coordinator etcd ({why})")


def _check_ports(layout: Layout) -> None:
    http = set(range(layout.port, layout.port + layout.nodes))
    peer = set(range(layout.peer_port, layout.peer_port + layout.nodes))
    if layout.nodes < 1:
        raise ClusterFileError("--nodes: at least 1")
    for what, base in (("--port", layout.port), ("--peer-port", layout.peer_port)):
        if not 1 <= base <= 65536 - layout.nodes:
            raise ClusterFileError(f"{what} {base}: the {layout.nodes} nodes need ports 1..65535")
    if http & peer:
        raise ClusterFileError(
            f"the nodes' ports overlap (HTTP {_span(layout.port, layout.nodes)}, peer "
            f"{_span(layout.peer_port, layout.nodes)}): give --port or --peer-port"
        )
    if layout.etcd_port:
        taken = {layout.etcd_port, layout.etcd_port + 1} & layout.node_ports
        if not 1 <= layout.etcd_port <= 65534:
            raise ClusterFileError(f"etcd port {layout.etcd_port}: write a port 1..65534")
        if taken:
            raise ClusterFileError(
                f"etcd port {layout.etcd_port} (and {layout.etcd_port + 1} for its peers) "
                f"overlaps the nodes' ports: give another with --etcd-port"
            )


def _span(base: int, count: int) -> str:
    return f"{base}" if count == 1 else f"{base}-{base + count - 1}"


# ---- a new file ---------------------------------------------------------------------------
def _new(path: Path, flags: UpFlags) -> ClusterFile:
    etcd = flags.coordinator == "etcd"
    _check_etcd_flag(flags, etcd, "the embedded coordinator is the default")
    port = _first(flags.port, DEFAULT_PORT)
    layout = Layout(
        nodes=_first(flags.nodes, DEFAULT_NODES),
        port=port,
        peer_port=_first(flags.peer_port, port + PEER_PORT_GAP),
        etcd_port=_first(flags.etcd_port, 0) if etcd else None,
    )
    _check_ports(layout)
    k, n = default_erasure(layout.nodes)
    doc = tomlkit.document()
    doc["replication"] = _first(flags.replication, min(DEFAULT_REPLICATION, layout.nodes))
    doc["erasure"] = {"codec": "zfec", "k": k, "n": n}
    tiers = tomlkit.table()
    for flag, value in (("memory", flags.memory), ("nvme", flags.nvme), ("cold", flags.cold)):
        _parse_flag_size(f"--{flag}", value or DEFAULT_CAPACITY[flag])
        tiers[f"{flag}_capacity"] = value or DEFAULT_CAPACITY[flag]
    doc["tiers"] = tiers
    doc["auth"] = tomlkit.table()  # filled by set_auth, before the nodes' list
    edit = _Edit(path, doc, {})
    layout = edit.place(layout)
    return ClusterFile(path, edit.doc, None, layout, edit.said)


def _parse_flag_size(flag: str, value: str) -> int:
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise ClusterFileError(f"{flag} {value}: {exc}") from None


# ---- editing ------------------------------------------------------------------------------
class _Edit:
    """Flags applied to a parsed file, each override said in ``said``."""

    def __init__(self, path: Path, doc: tomlkit.TOMLDocument, before: Mapping[str, Any]):
        self.path, self.doc, self.before = path, doc, before
        self.said: list[str] = []

    def say(self, line: str) -> None:
        self.said.append(f"storaged up: {line}")

    def _locate(self, name: str) -> tuple[Container | Table, str] | None:
        """The table holding setting ``name`` (top level or a settings table) and its
        written name (``[tiers] memory_capacity``); None if the file does not set it."""
        if name in self.doc:
            return self.doc, name
        for table_name in _SETTING_TABLES:
            table = self.doc.get(table_name)
            if isinstance(table, Table) and name in table:
                return table, f"[{table_name}] {name}"
        return None

    def size(self, flag: str, value: str, name: str) -> None:
        wanted = _parse_flag_size(flag, value)
        found = self._locate(name)
        if found is None:
            tiers = self.doc.get("tiers")
            if not isinstance(tiers, Table):
                tiers = tomlkit.table()
                self.doc["tiers"] = tiers
            tiers[name] = value
            self.say(f"{flag} {value} sets [tiers] {name} in {self.path} (it was not set)")
            return
        table, where = found
        old = table[name].unwrap()
        if parse_size(old) != wanted:
            table[name] = value
            self.say(f"{flag} {value} overrides {where} = {tomlkit.item(old).as_string()} "
                     f"in {self.path}")  # fmt: skip

    def _set_int(self, name: str, value: int, why: str) -> None:
        found = self._locate(name)
        if found is None:
            self.doc[name] = value
            self.say(f"{why} sets {name} = {value} in {self.path} (it was not set)")
            return
        table, where = found
        old = table[name].unwrap()
        if str(old) != str(value):
            table[name] = value
            self.say(f"{why} overrides {where} = {old} in {self.path}")

    def coordinator(self, flags: UpFlags, kept: _Kept, etcd: bool) -> None:
        if flags.coordinator is None or etcd == kept.etcd:
            return
        if etcd:
            self.say(
                f"--coordinator etcd overrides the embedded coordinator of {self.path}: its "
                "[[nodes]] list goes (the nodes register in etcd), [up] says where they run"
            )
        else:
            self.say(
                f"--coordinator embedded overrides the etcd coordinator of {self.path}: "
                "checkpoints committed on etcd are not listed without it"
            )

    def layout(self, flags: UpFlags, kept: _Kept, layout: Layout) -> None:
        if flags.nodes is not None and kept.nodes is not None and flags.nodes != kept.nodes:
            self.say(f"--nodes {flags.nodes} overrides the {kept.nodes} nodes of {self.path}")
        for flag, given, old in (
            ("--port", flags.port, kept.port),
            ("--peer-port", flags.peer_port, kept.peer_port),
        ):
            if given is not None and old is not None and given != old:
                what = "HTTP" if flag == "--port" else "peer"
                self.say(
                    f"{flag} {given} overrides the nodes' {what} ports "
                    f"{_span(old, _first(kept.nodes, layout.nodes))} in {self.path}"
                )
        if flags.etcd_port is not None and kept.etcd_port not in (None, flags.etcd_port):
            self.say(
                f"--etcd-port {flags.etcd_port} overrides [up] etcd_port = {kept.etcd_port} "
                f"in {self.path}"
            )

    def replication(self, flags: UpFlags, kept: _Kept, layout: Layout) -> None:
        if flags.replication is not None:
            self._set_int("replication", flags.replication, f"--replication {flags.replication}")
            return
        # up's own choice for the old number of nodes follows --nodes; the operator's stays
        old = self.before.get("replication")
        if kept.nodes is not None and old == min(DEFAULT_REPLICATION, kept.nodes):
            new = min(DEFAULT_REPLICATION, layout.nodes)
            if new != old and "replication" in self.doc:
                self.doc["replication"] = new
                self.say(
                    f"--nodes {layout.nodes} changes replication = {old} to {new} in "
                    f"{self.path} (up's choice for {layout.nodes} nodes)"
                )

    def erasure(self, flags: UpFlags, kept: _Kept, layout: Layout) -> None:
        table = self.doc.get("erasure")
        old = self.before.get("erasure")
        if kept.nodes is None or not isinstance(table, Table) or not isinstance(old, dict):
            return
        try:
            if (old.get("k"), old.get("n")) != default_erasure(kept.nodes):
                return  # the operator's choice: kept (a node refuses it if it does not fit)
            k, n = default_erasure(layout.nodes)
        except ClusterError:
            return
        if (k, n) != (old["k"], old["n"]):
            table["k"], table["n"] = k, n
            self.say(
                f"--nodes {layout.nodes} changes [erasure] k = {old['k']}, n = {old['n']} to "
                f"k = {k}, n = {n} in {self.path} (up's choice for {layout.nodes} nodes)"
            )

    def place(self, layout: Layout) -> Layout:
        """Write where the nodes run: ``[[nodes]]`` (embedded) or ``[up]`` (etcd), drawing
        the etcd port if there is none yet; the layout with it."""
        if layout.etcd_port is None:
            if "up" in self.doc:
                del self.doc["up"]
            self._nodes(layout)
            return layout
        if "nodes" in self.doc:
            del self.doc["nodes"]
        if not layout.etcd_port:
            port = choose_etcd_port(layout.node_ports)
            layout = Layout(layout.nodes, layout.port, layout.peer_port, layout.https, port)
            self.say(
                f"etcd gets port {port} (and {port + 1} for its peers), kept in {self.path} "
                "([up] etcd_port) for every later up"
            )
        up = self.doc.get("up")
        if not isinstance(up, Table):
            up = tomlkit.table()
            self.doc["up"] = up
        _sync(up, {"nodes": layout.nodes, "port": layout.port, "peer_port": layout.peer_port,
                   "etcd_port": layout.etcd_port})  # fmt: skip
        return layout

    def _nodes(self, layout: Layout) -> None:
        scheme = "https" if layout.https else "http"
        old = self.before.get("nodes") or []
        wanted = []
        for i in range(layout.nodes):
            entry = dict(old[i]) if i < len(old) else {}
            entry.update(id=f"n{i}", url=f"{scheme}://127.0.0.1:{layout.port + i}")
            entry["peer"] = f"127.0.0.1:{layout.peer_port + i}"
            entry.setdefault("data", str(self.path.parent / f"n{i}"))
            wanted.append(entry)
        nodes = self.doc.get("nodes")
        if not isinstance(nodes, AoT):
            self.doc["nodes"] = wanted
            return
        for i, entry in enumerate(wanted):
            if i < len(nodes):
                _sync(nodes[i], entry)
            else:
                table = tomlkit.table()
                table.update(entry)
                table.trivia.indent = "\n"  # a blank line before it, as between the others
                nodes.append(table)
        while len(nodes) > len(wanted):
            del nodes[len(nodes) - 1]


def _sync(table: Table | Container, wanted: Mapping[str, Any]) -> None:
    """Make ``table`` hold ``wanted``: keys it lacks are added, keys not wanted removed, and
    only values that differ replaced, so the rest keeps its comments and place."""
    for key in [k for k in table if k not in wanted]:
        del table[key]
    for key, value in wanted.items():
        if key not in table or table[key].unwrap() != value:
            table[key] = value
