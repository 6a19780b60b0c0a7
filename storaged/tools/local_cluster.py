"""A local cluster of node processes on 127.0.0.1: what ``storaged up`` and the tests run.

Node ``n<i>`` serves HTTP on ``port + i`` and the peer protocol on
``peer_port + i`` (default ``port + 1000 + i``); its data lives under
``data/n<i>/``. The generated cluster file is ``data/cluster.toml`` (mode 0600:
it holds the cluster secret); each node's pid is in ``data/n<i>/node.pid`` and its
log in ``data/n<i>/node.log``.

With ``etcd`` (``storaged up --coordinator etcd``) membership and the catalogue live in
one local etcd member instead: its data under ``data/etcd/``, its log in
``data/etcd.log``; the cluster file then lists no nodes (it carries the secrets and
cluster-wide settings), and each node is told where it is on its command line.

Node processes import the same ``storaged`` as this process, whatever the
working directory: a clone's top folder is often named ``storaged`` too, and
``python -m`` would otherwise import that folder instead of the package.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import tomlkit

from storaged.datalock import DataDirLocked, check_free


class ClusterError(RuntimeError):
    pass


def default_erasure(nodes: int, n: int = 6) -> tuple[int, int]:
    """(k, n) such that losing any one of ``nodes`` nodes loses at most n - k fragments."""
    n = max(n, min(nodes, 12))
    per_node = math.ceil(n / nodes)
    k = n - per_node
    if k < 1:
        raise ClusterError(f"{nodes} node(s) cannot hold erasure-coded data that survives a loss")
    return k, n


def new_token() -> str:
    """A new client or admin token: 192 random bits in hex, so it never starts with
    ``-`` (a URL-safe token does one time in 64, and ``storaged save --token -x...``
    is then a parse error) and needs no quoting in a shell."""
    return secrets.token_hex(24)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(count: int, start: int = 10000, end: int | None = None) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (best effort).

    Drawn below the kernel's ephemeral range, so that outgoing connections of other
    processes cannot take one of them between this check and the nodes' bind.
    """
    if end is None:
        end = _ephemeral_low()
    rng = secrets.SystemRandom()
    for _ in range(200):
        base = rng.randrange(start, end - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ClusterError("no free block of ports found")


#: how long a stop waits for nodes to drain and exit before killing them: a bit over the
#: nodes' own ``stop_timeout`` (Config), so a graceful stop is never cut short from here
STOP_TIMEOUT = 150.0


@dataclass
class LocalCluster:
    nodes: int
    data: Path
    port: int
    peer_port: int = 0
    token: str = ""
    #: the admin token (``/v1/admin/``, ``/v1/nodes/``): written to a cluster file that has
    #: none; after ``write_config``, the file's (its ``admin_token`` or ``admin_token_env``)
    admin_token: str = ""
    replication: int = 3
    settings: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    #: the local etcd member the nodes coordinate through; None: the embedded coordination
    etcd: LocalEtcd | None = None
    #: or an etcd this cluster neither starts nor stops (a coordinator URL, with a key
    #: prefix when several clusters share it: the tests' etcd rig)
    coordinator: str = ""
    log_to_files: bool = True
    #: nodes serve HTTPS (settings must carry tls_cert and tls_key)
    https: bool = False
    #: nodes get SIGTERM when the process that started them dies, even by SIGKILL (Linux);
    #: for ``storaged up`` and the demo, so no node outlives its supervisor
    die_with_parent: bool = False
    #: an existing cluster file's client token may be replaced by ``token`` (or dropped,
    #: when ``token`` is empty); without it a different ``token`` is refused
    replace_token: bool = False
    #: a new cluster secret even if the cluster file has one (every node must restart)
    new_secret: bool = False
    #: nodes inherit no STORAGED_* variable from this process: the cluster file (and
    #: ``env``) alone configure them, as for the demo's cluster made for the occasion
    clean_env: bool = False
    #: the module the node processes run (``python -m MODULE serve ...``): another module
    #: taking ``storaged serve``'s arguments runs a variant node (a benchmark's baseline)
    node_module: str = "storaged"
    #: the cluster file is written already and ``keep_auth`` was called for it: ``start``
    #: leaves it as it is (``storaged up`` keeps the operator's, storaged/tools/cluster_file.py)
    config_written: bool = False
    #: node index -> its failure domain (storaged/domains.py); a node not named has none
    domains: Mapping[int, str] = field(default_factory=dict)
    #: the archive every node points at: its URL, or the cluster file's ``[archive]`` table
    #: (``url``, ``endpoint``, ...); credentials go in ``env`` (``AWS_ACCESS_KEY_ID``, ...)
    archive: str | Mapping[str, Any] = ""
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: where each node's log stood when it was last started: its exit cause is after that
    _log_starts: dict[int, int] = field(default_factory=dict)
    #: environment variables the cluster file takes its secrets from (token_env, ...)
    _auth_env_names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.data = Path(self.data)
        if not self.peer_port:
            self.peer_port = self.port + 1000
        self.replication = min(self.replication, self.nodes)

    # ---- config -------------------------------------------------------------------------
    @property
    def coordinator_url(self) -> str:
        """The etcd the nodes coordinate through; empty: the embedded coordination."""
        return self.etcd.url if self.etcd is not None else self.coordinator

    @property
    def config_path(self) -> Path:
        return self.data / "cluster.toml"

    def node_id(self, i: int) -> str:
        return f"n{i}"

    def url(self, i: int) -> str:
        scheme = "https" if self.https else "http"
        return f"{scheme}://127.0.0.1:{self.port + i}"

    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(self.nodes)]

    def read_auth(self) -> dict[str, Any] | None:
        """The ``[auth]`` table of the existing cluster file; None when there is no file."""
        import tomllib

        try:
            text = self.config_path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ClusterError(f"cannot read {self.config_path}: {exc}") from None
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            # It may hold the only copy of the cluster's secret: never overwrite it blindly.
            raise ClusterError(
                f"{self.config_path} is not valid TOML ({exc}): fix or remove it"
            ) from None
        auth = doc.get("auth", {})
        return dict(auth) if isinstance(auth, dict) else {}

    def write_config(self) -> Path:
        """Write the cluster file (mode 0600, replaced atomically).

        The ``[auth]`` of an existing file is kept: its cluster secret unless
        ``new_secret``, its client token (or ``token_env``) unless ``replace_token``;
        ``self.token`` becomes the kept token. A ``token`` other than the file's is
        refused with ``ClusterError`` unless ``replace_token``. A file without a token
        gets ``token`` if one is given.
        """
        self.data.mkdir(parents=True, exist_ok=True)
        auth = self.keep_auth(self.read_auth() or {})
        k, n = default_erasure(self.nodes)
        doc: dict[str, Any] = {
            "replication": self.replication,
            "erasure": {"codec": "zfec", "k": k, "n": n},
            "auth": auth,
        }
        if not self.coordinator_url:
            # On etcd the members register themselves: a static list would contradict it.
            doc["nodes"] = [
                {
                    "id": self.node_id(i),
                    "url": self.url(i),
                    "peer": f"127.0.0.1:{self.peer_port + i}",
                    "data": str(self.data / self.node_id(i)),
                    **({"domain": self.domains[i]} if self.domains.get(i) else {}),
                }
                for i in range(self.nodes)
            ]
        if self.archive:
            table = {"url": self.archive} if isinstance(self.archive, str) else self.archive
            doc["archive"] = dict(table)
        for key, value in self.settings.items():
            if key in ("codec", "k", "n"):
                doc["erasure"][key] = value
            else:
                doc[key] = value
        _write_private(self.config_path, doc)
        return self.config_path

    def keep_auth(self, old: Mapping[str, Any]) -> dict[str, Any]:
        """The ``[auth]`` table to write in place of ``old`` (see ``write_config``); sets
        ``token`` and ``admin_token`` to the ones the nodes will check."""
        # The file's admin token is kept as it is; one is added only where there is none.
        auth: dict[str, Any] = {k: v for k, v in old.items() if k.startswith("admin_token")}
        if auth:
            env = {**os.environ, **self.env}
            self.admin_token = str(
                auth.get("admin_token") or env.get(str(auth.get("admin_token_env", "")), "")
            )
        elif self.admin_token:
            auth["admin_token"] = self.admin_token
        secret_keys = [key for key in ("cluster_secret", "cluster_secret_env") if key in old]
        if secret_keys and not self.new_secret:
            auth.update((key, old[key]) for key in secret_keys)
        else:
            auth["cluster_secret"] = secrets.token_hex(32)
        token_keys = [key for key in ("token", "token_env") if key in old]
        if token_keys and not self.replace_token:
            env = {**os.environ, **self.env}
            kept = str(old.get("token") or env.get(str(old.get("token_env", "")), ""))
            if self.token and self.token != kept:
                raise ClusterError(
                    f"{self.config_path} has another client token; --replace-token replaces "
                    "it (check $STORAGED_TOKEN, the default of --token)"
                )
            auth.update((key, old[key]) for key in token_keys)
            self.token = kept
        elif self.token:
            auth["token"] = self.token
        self._auth_env_names = {str(v) for k, v in auth.items() if k.endswith("_env")}
        return auth

    # ---- processes ----------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        """Start etcd (if any) and the nodes; return once they serve and see each other."""
        self.check_not_running()
        if not self.config_written:
            self.write_config()
        if self.etcd is not None:
            self.etcd.start(avoid=self._ports())
            self.etcd.wait_healthy(timeout=timeout)
        for i in range(self.nodes):
            self.start_node(i)
        self.wait_healthy(timeout=timeout)
        self.wait_converged(timeout=timeout)

    def wait_converged(self, timeout: float = 60.0) -> None:
        """Wait until every running node sees, of this cluster's nodes, exactly the running
        ones as alive (members joined by hand, on etcd, are not this cluster's to count).

        Right after start-up a node may still count a peer that was not listening yet as
        down; a write then would find too few replicas.
        """
        ours = {self.node_id(i) for i in range(self.nodes)}
        running = {self.node_id(i) for i in range(self.nodes) if self.alive(i)}
        deadline = time.monotonic() + timeout
        pending = set(running)
        while pending:
            for node in sorted(pending):
                request = urllib.request.Request(
                    self.url(int(node[1:])) + "/v1/cluster",
                    headers={
                        "Accept": "application/json",
                        **({"Authorization": f"Bearer {self.token}"} if self.token else {}),
                    },
                )
                try:
                    with urllib.request.urlopen(
                        request, timeout=2, context=self._health_ssl()
                    ) as resp:
                        doc = json.loads(resp.read())
                except (urllib.error.URLError, OSError, ValueError):
                    continue
                seen = {n["id"] for n in doc["nodes"] if n["alive"]} & ours
                if seen == running:
                    pending.discard(node)
            if pending and time.monotonic() > deadline:
                raise ClusterError(f"nodes {sorted(pending)} do not see {sorted(running)} alive")
            if pending:
                time.sleep(0.1)

    def _ports(self) -> set[int]:
        return {base + i for base in (self.port, self.peer_port) for i in range(self.nodes)}

    def _inherits(self, name: str) -> bool:
        """Whether node processes get this process's environment variable ``name``.

        STORAGED_TOKEN or STORAGED_CLUSTER_SECRET (left in a shell for the client
        commands, say) would override the cluster file's auth: the nodes would then
        refuse the token this cluster checks them with, and never look converged.
        They pass only where the cluster file names them (``token_env``).
        """
        if not name.startswith("STORAGED_"):
            return True
        if name in self._auth_env_names:
            return True
        return not self.clean_env and name not in ("STORAGED_TOKEN", "STORAGED_CLUSTER_SECRET")

    def node_environ(self) -> dict[str, str]:
        """The environment a node process gets (before its PYTHONPATH)."""
        env = {name: value for name, value in os.environ.items() if self._inherits(name)}
        env.update(self.env)
        return env

    def check_not_running(self) -> None:
        """``ClusterError`` if a node process runs on a node directory under ``data``."""
        for node_dir in sorted(self.data.glob("n*")):
            try:
                check_free(node_dir)
            except DataDirLocked as exc:
                raise ClusterError(f"a cluster is already running on {self.data}: {exc}") from None

    def start_node(self, i: int) -> subprocess.Popen[bytes]:
        node_dir = self.data / self.node_id(i)
        node_dir.mkdir(parents=True, exist_ok=True)
        # -P: the working directory is not put first on the node's sys.path (see above).
        cmd = [sys.executable, "-P", "-m", self.node_module, "serve"]
        cmd += ["--config", str(self.config_path), "--node", self.node_id(i)]
        if self.coordinator_url:
            cmd += ["--coordinator", self.coordinator_url, "--url", self.url(i)]
            cmd += ["--peer", f"127.0.0.1:{self.peer_port + i}", "--data", str(node_dir)]
            if self.domains.get(i):
                cmd += ["--domain", self.domains[i]]
        env = self.node_environ()
        root = _package_root()
        if root is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        out: Any = subprocess.DEVNULL
        if self.log_to_files:
            out = open(node_dir / "node.log", "ab")  # noqa: SIM115
            self._log_starts[i] = out.tell()
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_term_with_parent if self.die_with_parent else None,
        )
        if self.log_to_files:
            out.close()
        self.procs[i] = proc
        (node_dir / "node.pid").write_text(f"{proc.pid}\n")
        return proc

    def wait_healthy(self, indexes: list[int] | None = None, timeout: float = 60.0) -> None:
        """Wait until each node's own process serves its URL (see ``serves``).

        ``ClusterError`` at once when one exits, with the cause it gave.
        """
        pending = set(range(self.nodes) if indexes is None else indexes)
        deadline = time.monotonic() + timeout
        while pending:
            for i in sorted(pending):
                proc = self.procs.get(i)
                if proc is not None and proc.poll() is not None:
                    raise ClusterError(self.describe_exit(i))
                if self.serves(i):
                    pending.discard(i)
            if pending and time.monotonic() > deadline:
                names = ", ".join(self.node_id(i) for i in sorted(pending))
                raise ClusterError(f"node(s) {names} not healthy after {timeout:.0f}s")
            if pending:
                time.sleep(0.1)

    def serves(self, i: int) -> bool:
        """Whether node ``i``'s process runs and answers ``/healthz`` on its own socket.

        A process of another cluster on the same port answers too: on Linux, the
        listening socket must belong to our process.
        """
        proc = self.procs.get(i)
        if proc is None or proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(
                self.url(i) + "/healthz", timeout=1, context=self._health_ssl()
            ) as resp:
                if resp.status != 200:
                    return False
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            # (HTTPException: something else answers there, as another cluster's peer
            # server did, its error frame read as a bad status line: not ours)
            return False
        return _listens_on(proc.pid, self.port + i) is not False

    def log_path(self, i: int) -> Path:
        return self.data / self.node_id(i) / "node.log"

    def log_tail(self, i: int, lines: int = 10) -> list[str]:
        """The last ``lines`` lines node ``i`` logged since it was last started."""
        return _log_tail(self.log_path(i), self._log_starts.get(i, 0), lines)

    def describe_exit(self, i: int) -> str:
        """One line: how node ``i`` ended and the cause it gave (its refusal, or last line)."""
        proc = self.procs.get(i)
        code = proc.poll() if proc is not None else None
        how = _how_it_ended(code)
        tail = [line for line in self.log_tail(i, 200) if line.strip()]
        causes = [line for line in tail if line.startswith("storaged serve: ")]
        if causes:
            cause = causes[-1].removeprefix("storaged serve: ")
            cause = ": " + cause.removeprefix(f"node {self.node_id(i)}: ")
        elif tail and code is not None and code > 0:
            cause = ": " + tail[-1].strip()
        else:
            cause = ""
        return f"node {self.node_id(i)} {how}{cause} (log: {self.log_path(i)})"

    def _health_ssl(self) -> ssl.SSLContext | None:
        if not self.https:
            return None
        # Only asks our own loopback node whether it is up: no secret goes over it.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.get(i)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            # A SIGTERM drains the node's RAM-only chunks first (I5): give it that time.
            proc.wait(timeout=STOP_TIMEOUT if sig == signal.SIGTERM else 30)

    def restart(self, i: int, timeout: float = 60.0) -> None:
        self.kill(i, signal.SIGTERM)
        self.start_node(i)
        self.wait_healthy([i], timeout=timeout)
        self.wait_converged(timeout=timeout)

    def alive(self, i: int) -> bool:
        proc = self.procs.get(i)
        return proc is not None and proc.poll() is None

    def stop(self, timeout: float = 0.0) -> None:
        """SIGTERM every node and wait for them (``timeout``, default ``STOP_TIMEOUT``: a
        graceful stop drains RAM-only chunks to disk first); SIGKILL what is left. etcd
        goes last: a node's graceful stop still talks to it (its catalogue, its lease)."""
        timeout = timeout or STOP_TIMEOUT
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: where Debian's ``etcd-server`` installs the binary, for a PATH without /usr/bin
ETCD_PATHS = ("/usr/bin/etcd",)

#: how to get etcd, in the refusal when it is missing
ETCD_HINT = (
    "install it (Debian/Ubuntu: apt-get install etcd-server; elsewhere: a release from "
    "https://github.com/etcd-io/etcd/releases, with etcd on PATH)"
)


def etcd_binary() -> str | None:
    """The etcd server binary: ``etcd`` on PATH, else at ``ETCD_PATHS``; None if absent."""
    found = shutil.which("etcd")
    if found is not None:
        return found
    return next((path for path in ETCD_PATHS if os.access(path, os.X_OK)), None)


@dataclass
class LocalEtcd:
    """One etcd member on 127.0.0.1 for a local cluster (``storaged up --coordinator etcd``).

    Its data lives in ``data`` (kept across runs: the catalogue is in it), its log and pid
    beside it (``<data>.log``, ``<data>.pid``). Ports are drawn free at the first start
    and kept for restarts: the nodes were told this address.
    """

    data: Path
    binary: str
    #: etcd keeps every revision until compacted; periodic compaction keeps this much
    #: history (docs/OPERATIONS.md), so the database does not grow to its quota
    compaction_retention: str = "1h"
    die_with_parent: bool = False
    client_port: int = 0
    peer_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    _log_start: int = 0

    @property
    def url(self) -> str:
        """The coordinator URL the nodes get (``serve --coordinator``)."""
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.data.with_name(self.data.name + ".log")

    @property
    def pid_path(self) -> Path:
        return self.data.with_name(self.data.name + ".pid")

    def start(self, avoid: set[int] | None = None) -> None:
        """Start the member (from its data directory if it ran before); ports not in
        ``avoid`` (the nodes' ports) are drawn at the first start."""
        if not self.client_port:
            self.client_port = choose_etcd_port(avoid or set())
            self.peer_port = self.client_port + 1
        self.data.mkdir(parents=True, exist_ok=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.client_port}"
        cmd = [
            self.binary,
            "--name", "storaged",
            "--data-dir", str(self.data),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"storaged={peer}",
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", self.compaction_retention,
            "--logger", "zap",
            "--log-level", "warn",
        ]  # fmt: skip
        with open(self.log_path, "ab") as out:
            self._log_start = out.tell()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_term_with_parent if self.die_with_parent else None,
            )
        self.pid_path.write_text(f"{self.proc.pid}\n")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def serves(self) -> bool:
        """Whether our etcd process runs and says it is healthy (it has a leader)."""
        if not self.alive():
            return False
        url = f"http://127.0.0.1:{self.client_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                healthy = b'"true"' in resp.read()
        except (urllib.error.URLError, OSError):
            return False
        assert self.proc is not None
        return healthy and _listens_on(self.proc.pid, self.client_port) is not False

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until etcd serves; ``ClusterError`` at once if it exits, with its cause."""
        deadline = time.monotonic() + timeout
        while not self.serves():
            if not self.alive():
                raise ClusterError(self.describe_exit())
            if time.monotonic() > deadline:
                raise ClusterError(f"etcd not healthy after {timeout:.0f}s (log: {self.log_path})")
            time.sleep(0.1)

    def log_tail(self, lines: int = 10) -> list[str]:
        """The last ``lines`` lines etcd logged since it was last started."""
        return _log_tail(self.log_path, self._log_start, lines)

    def describe_exit(self) -> str:
        """One line: how etcd ended and its last error (etcd logs JSON lines: their msg)."""
        code = self.proc.poll() if self.proc is not None else None
        cause = ""
        for line in reversed(self.log_tail(50)):
            try:
                entry = json.loads(line)
            except ValueError:
                if line.strip():
                    cause = ": " + line.strip()
                    break
                continue
            if isinstance(entry, dict) and entry.get("level") in ("error", "fatal", "panic"):
                cause = f": {entry.get('msg', '')}"
                if entry.get("error"):
                    cause += f" ({entry['error']})"
                break
        return f"etcd {_how_it_ended(code)}{cause} (log: {self.log_path})"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM etcd and wait for it; SIGKILL it after ``timeout``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def choose_etcd_port(avoid: set[int]) -> int:
    """A free client port for a local etcd member whose peer port is the next one, neither
    in ``avoid`` (the nodes' ports)."""
    for _ in range(50):
        base = free_port_block(2)
        if not {base, base + 1} & avoid:
            return base
    raise ClusterError("no free ports for etcd apart from the nodes' ports")


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "is not running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _log_tail(path: Path, start: int, lines: int) -> list[str]:
    """The last ``lines`` lines of ``path`` written after offset ``start``."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(start, size - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def _term_with_parent() -> None:
    """In the child before exec: ask the kernel for SIGTERM when the parent thread dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: nodes then outlive a killed parent
        pass


def _write_private(path: Path, doc: Mapping[str, Any]) -> None:
    write_private(path, tomlkit.dumps(dict(doc)).encode())


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600, replacing any old file at once.

    A new file with its own mode, renamed over the old one: opening an existing
    0644 file with mode 0600 would keep 0644.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # a leftover temp file keeps its mode otherwise
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _package_root() -> str | None:
    """The folder this ``storaged`` was imported from, if it is a source tree.

    An installed package is found by the node's interpreter anyway; a source tree
    (a checkout on the caller's path) is handed on explicitly.
    """
    import storaged

    root = Path(storaged.__file__).resolve().parent.parent
    if root.name in ("site-packages", "dist-packages"):
        return None
    return str(root)


def _listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port``; None: cannot tell."""
    listening: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()
            # sl local_address rem_address st ... inode; st 0A is LISTEN
            listens = len(fields) > 9 and fields[3] == "0A"
            if listens and int(fields[1].rpartition(":")[2], 16) == port:
                listening.add(f"socket:[{fields[9]}]")
    if not readable:
        return None
    if not listening:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in listening:
                return True
        except OSError:
            continue
    return False


def supervise(
    cluster: LocalCluster,
    *,
    restart: bool = True,
    say: Callable[[str], None] | None = None,
    backoff: tuple[float, float] = (1.0, 30.0),
    settle: float = 30.0,
) -> int:
    """Watch the nodes (and the cluster's etcd) until SIGINT or SIGTERM, then stop them;
    returns the exit status.

    A node that exits is reported in one line, with the tail of its log. With
    ``restart`` it is started again after a delay that doubles (from ``backoff[0]``
    up to ``backoff[1]``) each time it exits before it has served for ``settle``
    seconds, and is reported back once it serves. Without ``restart`` it stays
    down, and once every node is down this returns 1. etcd is watched the same way
    (restarted on its ports and data; the nodes wait for it meanwhile).
    """
    stop = False
    signals = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop, signals
        stop = True
        signals += 1

    if say is None:
        say = functools.partial(print, flush=True)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    etcd = cluster.etcd
    slots: list[_Watched] = [_NodeSlot(cluster, i) for i in range(cluster.nodes)]
    if etcd is not None:
        slots.append(_EtcdSlot(etcd))
    delay = dict.fromkeys(range(len(slots)), backoff[0])
    due: dict[int, float] = {}  # slot -> when to start it again
    starting: set[int] = set()  # restarted, not serving yet
    serving_since = dict.fromkeys(range(len(slots)), time.monotonic())
    down: set[int] = set()  # exited, left down (no restart)
    try:
        while not stop:
            now = time.monotonic()
            for i, slot in enumerate(slots):
                if slot.alive():
                    if i in starting and slot.serves():
                        starting.discard(i)
                        serving_since[i] = now
                        say(f"storaged up: {slot.what} is back ({slot.where})")
                    elif i not in starting and now - serving_since[i] > settle:
                        delay[i] = backoff[0]
                    continue
                if i in due:
                    if now >= due[i]:
                        del due[i]
                        slot.start()
                        starting.add(i)
                    continue
                if i in down:
                    continue
                starting.discard(i)
                say(f"storaged up: {slot.describe_exit()}; its last lines:")
                for line in slot.log_tail():
                    say(f"    {line}")
                if restart:
                    due[i] = now + delay[i]
                    say(f"storaged up: restarting {slot.name} in {delay[i]:.0f} s")
                    delay[i] = min(2 * delay[i], backoff[1])
                else:
                    down.add(i)
                    say(f"storaged up: {slot.name} stays down (--no-restart)")
            if len(down & set(range(cluster.nodes))) == cluster.nodes:
                say("storaged up: every node has exited")
                return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_saying(cluster, say, forced=lambda: signals >= 2)


#: what a node's log says when its stop waits for a full disk (node/pipeline/drain.py)
_DRAIN_STUCK = re.compile(r"stop: (\d+ RAM-only chunk\(s\) cannot drain: .*)")


def _stop_saying(
    cluster: LocalCluster,
    say: Callable[[str], None],
    forced: Callable[[], bool],
    every: float = 10.0,
) -> None:
    """``cluster.stop()``, saying what it waits for: each node's graceful stop (its
    RAM-only chunks written to disk), until ``forced()`` (a second Ctrl-C) kills the rest."""
    running = {i: p for i, p in cluster.procs.items() if p.poll() is None}
    if running:
        say(
            f"storaged up: stopping {len(running)} nodes: each writes its RAM-only chunks to "
            "disk first (Ctrl-C again to kill them at once)"
        )
    for proc in running.values():
        proc.send_signal(signal.SIGTERM)
    began = time.monotonic()
    deadline = began + STOP_TIMEOUT
    last_said = began
    while True:
        left = [i for i, p in running.items() if p.poll() is None]
        if not left:
            break
        now = time.monotonic()
        names = ", ".join(cluster.node_id(i) for i in left)
        if forced() or now > deadline:
            for i in left:
                running[i].kill()
            for i in left:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    running[i].wait(timeout=10)
            why = "a second Ctrl-C" if forced() else f"still running after {STOP_TIMEOUT:.0f} s"
            say(
                f"storaged up: killed {names} ({why}): a chunk still only in their RAM is "
                "lost unless another node has it on disk"
            )
            break
        if now - last_said >= every:
            last_said = now
            say(f"storaged up: still waiting for {names} ({now - began:.0f} s): RAM to disk")
            for i in left:
                # A stop that waits for a full disk says so in its log (node/pipeline/drain.py)
                stuck = [m for line in cluster.log_tail(i, 50) if (m := _DRAIN_STUCK.search(line))]
                if stuck:
                    say(f"storaged up: {cluster.node_id(i)}: {stuck[-1].group(1)}")
        time.sleep(0.1)
    if cluster.etcd is not None:
        if cluster.etcd.proc is not None and cluster.etcd.proc.poll() is None:
            say("storaged up: stopping etcd")
        cluster.etcd.stop()
    say("storaged up: stopped")


class _Watched(Protocol):
    """A process ``supervise`` watches: a node or etcd."""

    name: str  # in "restarting NAME"
    what: str  # in "WHAT is back"
    where: str

    def alive(self) -> bool: ...
    def serves(self) -> bool: ...
    def start(self) -> None: ...
    def describe_exit(self) -> str: ...
    def log_tail(self) -> list[str]: ...


class _NodeSlot:
    def __init__(self, cluster: LocalCluster, i: int) -> None:
        self.cluster, self.i = cluster, i
        self.name = cluster.node_id(i)
        self.what = f"node {self.name}"
        self.where = cluster.url(i)

    def alive(self) -> bool:
        return self.cluster.alive(self.i)

    def serves(self) -> bool:
        return self.cluster.serves(self.i)

    def start(self) -> None:
        self.cluster.start_node(self.i)

    def describe_exit(self) -> str:
        return self.cluster.describe_exit(self.i)

    def log_tail(self) -> list[str]:
        return self.cluster.log_tail(self.i)


class _EtcdSlot:
    def __init__(self, etcd: LocalEtcd) -> None:
        self.etcd = etcd
        self.name = self.what = "etcd"
        self.where = etcd.url

    def alive(self) -> bool:
        return self.etcd.alive()

    def serves(self) -> bool:
        return self.etcd.serves()

    def start(self) -> None:
        self.etcd.start()

    def describe_exit(self) -> str:
        return self.etcd.describe_exit()

    def log_tail(self) -> list[str]:
        return self.etcd.log_tail()
