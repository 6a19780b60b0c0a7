"""A real S3-compatible object store for the tests: OpenStack Swift with its ``s3api``
middleware on 127.0.0.1, data in a temp dir.

Debian's Swift (``swift-proxy``, ``swift-account``, ``swift-container``, ``swift-object``)
and ``memcached`` (tempauth keeps its state there and refuses to run without one);
``scripts/test`` installs them on a fresh machine when run as root. The cluster is the
smallest Swift there is: one device, one replica, rings built with swift-ring-builder's
``RingBuilder`` for the ports drawn at start, every server a single process (``workers = 0``), no
background daemons (replicators, auditors: one replica has nothing to reconcile). The
proxy's pipeline carries ``s3api`` and ``tempauth``: S3 requests signed with version 4 for
``REGION``, path-style (``http://127.0.0.1:PORT/BUCKET/KEY``), by the access key
``test:tester`` (the account ``AUTH_test``) and its secret ``testing``.

Swift stores object metadata in user xattrs: the objects go on a file system that has them
(ext4 and xfs do, tmpfs only on recent kernels): under ``root`` if it does, else in
``/var/tmp`` or the home directory; none: ``start_blocking`` says so rather than the first
PUT failing.

The servers are plain child processes, not tied to an event loop, like ``tests/etcd.py``:
``start_blocking`` waits until a bucket can be made through the S3 path's own account,
``stop``/``kill`` take the proxy down (the archive tier's "server gone" tests),
``close_blocking`` stops every process and waits for it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from storaged.tools.local_cluster import free_port_block

ACCESS_KEY = "test:tester"
SECRET_KEY = "testing"
REGION = "us-east-1"
#: the Swift servers the cluster runs, in start order (the proxy last: it is what waits)
SERVERS = ("account", "container", "object", "proxy")
#: partition power of the rings: 2^6 partitions on one device, the least that rebalances
#: quickly and still spreads directories
PART_POWER = 6

_SERVER_CONF = """\
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = {port}
workers = 0
swift_dir = {etc}
devices = {devices}
mount_check = false
disable_fallocate = true
log_level = WARNING
log_name = {server}

[pipeline:main]
pipeline = {server}-server

[app:{server}-server]
use = egg:swift#{server}
"""

#: s3api before tempauth (it turns an S3 signature into what tempauth checks), ``cache``
#: before both (tempauth keeps tokens in memcached), ``slo`` for multipart uploads,
#: ``container-quotas`` for a full bucket (``make_bucket(quota_bytes=...)``)
PIPELINE = (
    "catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth "
    "copy container-quotas slo dlo proxy-logging proxy-server"
)

_PROXY_CONF = """\
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = {port}
workers = 0
swift_dir = {etc}
log_level = WARNING
log_name = proxy

[pipeline:main]
pipeline = {pipeline}

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true

[filter:s3api]
use = egg:swift#s3api
location = {region}

[filter:tempauth]
use = egg:swift#tempauth
user_test_tester = {secret} .admin

[filter:cache]
use = egg:swift#memcache
memcache_servers = 127.0.0.1:{memcache_port}

[filter:catch_errors]
use = egg:swift#catch_errors

[filter:gatekeeper]
use = egg:swift#gatekeeper

[filter:healthcheck]
use = egg:swift#healthcheck

[filter:proxy-logging]
use = egg:swift#proxy_logging

[filter:listing_formats]
use = egg:swift#listing_formats

[filter:copy]
use = egg:swift#copy

[filter:slo]
use = egg:swift#slo

[filter:container-quotas]
use = egg:swift#container_quotas

[filter:dlo]
use = egg:swift#dlo
"""


def swift_missing() -> str | None:
    """Why a Swift cannot be started here, or None."""
    needed = ["swift-proxy-server", "swift-account-server", "swift-container-server"]
    needed += ["swift-object-server", "swift-ring-builder", "memcached"]
    absent = [name for name in needed if _binary(name) is None]
    if absent:
        return (
            f"needs OpenStack Swift and memcached ({', '.join(absent)} not found): apt-get "
            "install swift swift-proxy swift-account swift-container swift-object memcached "
            "(scripts/test does it as root)"
        )
    return None


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found is not None:
        return found
    path = f"/usr/bin/{name}"
    return path if os.access(path, os.X_OK) else None


def _interpreter_of(command: str) -> str:
    """The Python that runs Swift's ``command`` (its ``#!`` line): Debian's system one."""
    binary = _binary(command)
    assert binary is not None
    with open(binary, "rb") as f:
        first = f.readline().decode().removeprefix("#!").split()
    return first[0] if first else "/usr/bin/python3"


#: builds ``<server>.ring.gz`` (and its ``.builder``) in ``argv[1]`` for each
#: ``server=port`` of ``argv[3:]``: one device, one replica, 2^argv[2] partitions
_RING_SCRIPT = """
import sys
from swift.common.ring import RingBuilder

etc, part_power = sys.argv[1], int(sys.argv[2])
for spec in sys.argv[3:]:
    server, port = spec.split("=")
    builder = RingBuilder(part_power, 1, 0)
    builder.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1", "port": int(port),
                     "device": "d1", "weight": 100, "meta": ""})
    builder.rebalance()
    builder.get_ring().save(f"{etc}/{server}.ring.gz")
    builder.save(f"{etc}/{server}.builder")
"""


def has_user_xattrs(directory: Path) -> bool:
    """Whether files under ``directory`` take user xattrs (Swift keeps metadata there)."""
    probe = directory / f".xattr-probe-{secrets.token_hex(4)}"
    probe.touch()
    try:
        os.setxattr(probe, "user.storaged.probe", b"1")
        return os.getxattr(probe, "user.storaged.probe") == b"1"
    except OSError:
        return False
    finally:
        probe.unlink()


def _child_env() -> dict[str, str]:
    """The environment of Swift's processes: Debian's system Python runs them, which must
    not import the test run's packages (``PYTHONPATH``) nor its interpreter settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


@dataclass
class SwiftS3Server:
    """One Swift under ``root`` serving S3 on ``endpoint``. ``start_blocking`` returns once
    the bucket ``bucket`` exists (made through the proxy, so every server answers)."""

    root: Path
    bucket: str = "storaged-test"
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: seconds ``start_blocking`` took (rings, processes, until the bucket was made)
    start_seconds: float = 0.0

    #: the objects' directory when the file system of ``root`` has no user xattrs
    _outside: Path | None = None

    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['proxy']}"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    def start_blocking(self, timeout: float = 60.0) -> None:
        why = swift_missing()
        if why is not None:
            raise RuntimeError(why)
        began = time.monotonic()
        self.etc.mkdir(parents=True, exist_ok=True)
        devices = self._devices_dir()
        (devices / "d1").mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            base = free_port_block(len(SERVERS) + 1)
            self.ports = {name: base + i for i, name in enumerate(SERVERS)}
            self.ports["memcached"] = base + len(SERVERS)
            self._write_config(devices)
            self._build_rings()
            for name in ("memcached", *SERVERS):
                self.launch(name)
            try:
                self.wait_serving(timeout)
                self.start_seconds = time.monotonic() - began
                return
            except BaseException:
                # A port taken between the check and the bind kills a server at once: try
                # other ports; anything else is a failure.
                died = not all(self.running(name) for name in self.processes)
                self.close_blocking()
                if attempt == 2 or not died:
                    raise
        raise AssertionError("unreachable")

    def _devices_dir(self) -> Path:
        """Where the objects go: ``root/srv`` if its file system has user xattrs, else a
        new directory in the first of ``/var/tmp`` and the home directory that has them
        (removed by ``close_blocking``)."""
        if has_user_xattrs(self.root):
            return self.root / "srv"
        for parent in (Path("/var/tmp"), Path.home()):
            if parent.is_dir() and has_user_xattrs(parent):
                self._outside = Path(tempfile.mkdtemp(prefix="storaged-swift-srv-", dir=parent))
                return self._outside
        raise RuntimeError(
            f"no user xattrs on the file systems of {self.root}, /var/tmp or ~: Swift needs them"
        )

    def _write_config(self, devices: Path) -> None:
        (self.etc / "swift.conf").write_text(
            "[swift-hash]\n"
            f"swift_hash_path_suffix = {secrets.token_hex(8)}\n"
            f"swift_hash_path_prefix = {secrets.token_hex(8)}\n"
            "[storage-policy:0]\nname = Policy-0\ndefault = yes\n"
        )
        for server in SERVERS[:-1]:
            (self.etc / f"{server}-server.conf").write_text(
                _SERVER_CONF.format(
                    port=self.ports[server], etc=self.etc, devices=devices, server=server
                )
            )
        (self.etc / "proxy-server.conf").write_text(
            _PROXY_CONF.format(
                port=self.ports["proxy"],
                etc=self.etc,
                pipeline=PIPELINE,
                region=self.region,
                secret=self.secret_key,
                memcache_port=self.ports["memcached"],
            )
        )

    def _build_rings(self) -> None:
        """One ring per server kind, each its one device on its server's port: what
        ``swift-ring-builder FILE create``, ``add`` and ``rebalance`` do, through the same
        ``RingBuilder`` in one process of Swift's Python (nine runs of the command took
        26 s on the loaded test machine, most of it importing Swift nine times)."""
        python = _interpreter_of("swift-ring-builder")
        specs = [f"{server}={self.ports[server]}" for server in SERVERS[:-1]]
        proc = subprocess.run(
            [python, "-c", _RING_SCRIPT, str(self.etc), str(PART_POWER), *specs],
            env=_child_env(),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"building the rings failed: {proc.stdout}{proc.stderr}")

    def _command(self, name: str) -> list[str]:
        if name == "memcached":
            binary = _binary("memcached")
            assert binary is not None
            # -u root: memcached refuses to run as root without it (CI runs as root)
            return [binary, "-l", "127.0.0.1", "-p", str(self.ports[name]), "-U", "0", "-m", "64"]
        binary = _binary(f"swift-{name}-server")
        assert binary is not None
        return [binary, str(self.etc / f"{name}-server.conf"), "--verbose"]

    def launch(self, name: str) -> None:
        """Start server ``name`` (again: its data and configuration stay); does not wait."""
        if self.running(name):
            raise RuntimeError(f"swift {name} is already running")
        cmd = self._command(name)
        if name == "memcached" and os.geteuid() == 0:
            cmd += ["-u", "root"]
        # A small local file: the children write their logs there
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115
        try:
            self.processes[name] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=_child_env()
            )
        finally:
            log.close()

    def running(self, name: str) -> bool:
        p = self.processes.get(name)
        return p is not None and p.poll() is None

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until the bucket exists, made through the proxy with the S3 user's account (so
        memcached, tempauth and every server answer). A server that exits fails it."""
        deadline = time.monotonic() + timeout
        while True:
            dead = [name for name in self.processes if not self.running(name)]
            if dead:
                raise AssertionError(f"swift {', '.join(dead)} exited: see {self.root}/*.log")
            try:
                self.make_bucket(self.bucket)
                return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"swift not serving within {timeout}s: see {self.root}")
            time.sleep(0.1)

    def make_bucket(self, bucket: str, quota_bytes: int | None = None) -> None:
        """Create ``bucket`` (a container of the S3 user's account), through Swift's own
        API: S3's CreateBucket would need a signed request, and the library under test
        does not make buckets. A PUT that would take it past ``quota_bytes`` is refused
        (S3's ``EntityTooLarge``)."""
        account, user = self.access_key.split(":", 1)
        auth = urllib.request.Request(
            f"{self.endpoint}/auth/v1.0",
            headers={"X-Auth-User": self.access_key, "X-Auth-Key": self.secret_key},
        )
        with urllib.request.urlopen(auth, timeout=5) as resp:
            token, storage_url = resp.headers["X-Auth-Token"], resp.headers["X-Storage-Url"]
        assert storage_url.endswith(f"/AUTH_{account}"), (storage_url, user)
        headers = {"X-Auth-Token": token}
        if quota_bytes is not None:
            headers["X-Container-Meta-Quota-Bytes"] = str(quota_bytes)
        put = urllib.request.Request(
            f"{self.endpoint}/v1/AUTH_{account}/{bucket}", method="PUT", headers=headers
        )
        with urllib.request.urlopen(put, timeout=5) as resp:
            if resp.status not in (201, 202):
                raise OSError(f"PUT container {bucket}: {resp.status}")

    def stop(self, name: str = "proxy") -> None:
        """SIGSTOP server ``name``: it neither answers nor closes its connections."""
        p = self.processes.get(name)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGSTOP)

    def resume(self, name: str = "proxy") -> None:
        p = self.processes.get(name)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGCONT)

    def kill(self, name: str = "proxy") -> None:
        """SIGKILL server ``name`` (a crash) and reap it."""
        p = self.processes.get(name)
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)  # a stopped process would not die before it
                p.kill()
            p.wait(timeout=30)

    def close_blocking(self) -> None:
        for name in reversed(list(self.processes)):
            self.kill(name)
        if self._outside is not None:
            shutil.rmtree(self._outside, ignore_errors=True)
            self._outside = None


def swift_for_tests() -> Iterator[SwiftS3Server]:
    """A Swift for a test module's fixture (it takes 10-45 s to start on the test machine):
    the module is skipped, saying why, where Swift cannot run; stopped and removed after."""
    import pytest

    why = swift_missing()
    if why is not None:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="storaged-swift-"))
    server = SwiftS3Server(root)
    try:
        server.start_blocking(timeout=120)
        yield server
    finally:
        server.close_blocking()
        shutil.rmtree(root, ignore_errors=True)
