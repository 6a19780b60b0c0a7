"""``storaged up`` through the real CLI: it reports success only when its own nodes serve.

Each test runs ``python -m storaged up`` as a subprocess on a temporary data
directory and free ports, and stops it (and so its nodes) at the end: a second
``up`` on a running data directory, a taken port, a node killed with SIGKILL
(reported and restarted, or not with ``--no-restart``), the client token kept
across restarts and never dropped silently, ``--insecure`` announced, the
cluster file's mode, and a working directory that holds a folder named
``storaged`` (the layout right after ``git clone``). With ``--coordinator etcd``: a
checkpoint saved and restored through the client, peers' figures in ``/v1/cluster``,
etcd killed and brought back, everything stopped by Ctrl-C; a clear refusal without etcd.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from storaged.cli import EXIT_CONFIG, main
from storaged.tools import local_cluster as cluster_module
from storaged.tools.local_cluster import LocalCluster, etcd_binary, free_port_block

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
#: generous: the machine is shared; every wait below ends as soon as its condition holds
START_TIMEOUT = 120.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STORAGED_")}
    # Small, quick nodes: no pre-faulted RAM, and never asyncio debug mode.
    env.update(PYTHONPATH=str(REPO), PYTHONASYNCIODEBUG="", STORAGED_PREFAULT_FRACTION="0")
    env.update(extra)
    return env


class Up:
    """A running ``storaged up``; its output lines are collected by a thread as they come."""

    def __init__(
        self, data: Path, port: int, *args: str, cwd: Path | None = None, flags: bool = True
    ) -> None:
        """``flags=False``: no --port, --peer-port, --memory (the cluster file's are kept)."""
        self.data = data
        self.port = port
        argv = [sys.executable, "-P", "-m", "storaged", "up", "--data", str(data)]
        if flags:
            argv += ["--port", str(port), "--peer-port", str(port + 4), "--memory", "128MiB"]
        self.proc = subprocess.Popen(
            [*argv, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            cwd=cwd or data.parent,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = START_TIMEOUT, after: int = 0) -> int:
        """Index of the first line from ``after`` on that contains ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index in range(after, len(self.lines)):
                if text in self.lines[index]:
                    return index
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r} from storaged up:\n{self.output}")

    def started(self) -> Up:
        self.wait_for("nodes up")
        return self

    def token(self) -> str:
        line = self.lines[self.wait_for("export STORAGED_URL=")]
        for word in line.split():
            if word.startswith("STORAGED_TOKEN="):
                return word.removeprefix("STORAGED_TOKEN=")
        return ""

    def exported(self) -> dict[str, str]:
        """The variables of the ``export`` line ``up`` printed."""
        line = self.lines[self.wait_for("export STORAGED_URL=")]
        words = line.removeprefix("export ").split()
        return dict(word.split("=", 1) for word in words)

    def pid(self, i: int) -> int:
        return int((self.data / f"n{i}" / "node.pid").read_text())

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + i}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self._reader.join(timeout=10)


@pytest.fixture
def ups() -> Iterator[list[Up]]:
    """Every ``Up`` a test appends is stopped after it, and any node left over is killed."""
    started: list[Up] = []
    yield started
    for up in started:
        up.stop()
    for up in started:
        for pid_file in [*up.data.glob("n*/node.pid"), *up.data.glob("etcd.pid")]:
            _kill_if_alive(int(pid_file.read_text()))


def _kill_if_alive(pid: int) -> None:
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _get(url: str, token: str | None = None) -> tuple[int, dict[str, object]]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _run_up(
    data: Path, port: int, *args: str, cwd: Path | None = None, flags: bool = True
) -> subprocess.CompletedProcess[str]:
    """An ``up`` expected to refuse: it must end by itself."""
    argv = [sys.executable, "-P", "-m", "storaged", "up", "--data", str(data)]
    if flags:
        argv += ["--port", str(port), "--peer-port", str(port + 4), "--memory", "128MiB"]
    argv += args
    return subprocess.run(
        argv, capture_output=True, text=True, env=_env(), cwd=cwd or data.parent, timeout=150
    )


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    assert "Traceback" not in text
    return lines[0]


# --------------------------------------------------------------------------- refusing to start


def test_second_up_on_a_running_data_dir_is_refused(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "cluster"
    first = Up(data, free_port_block(9))
    ups.append(first)
    first.started()
    before = (data / "cluster.toml").read_bytes()
    pids = [first.pid(i) for i in range(4)]

    second = _run_up(data, free_port_block(9))
    assert second.returncode != 0
    line = _one_line(second.stderr)
    assert "already running" in line and f"pid {pids[0]}" in line, line
    assert "nodes up" not in second.stdout
    # The running cluster is untouched: same nodes, same cluster file.
    assert (data / "cluster.toml").read_bytes() == before
    assert all(_alive(pid) for pid in pids)
    assert _get(first.url(0) + "/healthz")[0] == 200

    # A node started by hand on a data directory in use refuses at once, in one line.
    serve = subprocess.run(
        [sys.executable, "-m", "storaged", "serve", "--config", str(data / "cluster.toml"),
         "--node", "n2"],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert serve.returncode == 3
    line = _one_line(serve.stderr.splitlines()[-1])
    assert "in use by a running node" in line and f"pid {pids[2]}" in line, serve.stderr


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Another service on our port that answers 200 to everything, /healthz included."""

    def do_GET(self) -> None:
        body = b'{"ok": true, "node": "n2"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_taken_port_is_reported_at_once(tmp_path: Path) -> None:
    port = free_port_block(9)
    impostor = http.server.ThreadingHTTPServer(("127.0.0.1", port + 2), _Impostor)
    thread = threading.Thread(target=impostor.serve_forever, daemon=True)
    thread.start()
    try:
        result = _run_up(tmp_path / "cluster", port)
    finally:
        impostor.shutdown()
        impostor.server_close()
    assert result.returncode != 0
    line = _one_line(result.stderr)
    # The node's own refusal, relayed, not a health-check timeout.
    assert f"node n2 exited with status 3: HTTP port {port + 2}" in line, line
    assert "taken by another process" in line
    assert "nodes up" not in result.stdout
    for pid_file in (tmp_path / "cluster").glob("n*/node.pid"):
        _kill_if_alive(int(pid_file.read_text()))  # up stopped the others; make sure


def test_port_taken_by_a_non_http_listener(tmp_path: Path) -> None:
    port = free_port_block(9)
    with socket.create_server(("127.0.0.1", port + 4 + 1)):  # n1's peer port
        result = _run_up(tmp_path / "cluster", port)
    assert result.returncode != 0
    line = _one_line(result.stderr)
    assert f"node n1 exited with status 3: peer port {port + 5}" in line, line


def test_http_port_answered_in_another_protocol(tmp_path: Path) -> None:
    """Something that answers the health check in another protocol (another cluster's peer
    server, whose error frame reads as a bad HTTP status line) is not our node: the node's
    own refusal is reported, not a BadStatusLine from the health check."""
    port = free_port_block(9)
    listener = socket.create_server(("127.0.0.1", port + 2))
    stop = threading.Event()

    def answer() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"\x00\x00\x00\x44\xa2ok\xc2\xa5error not http\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        result = _run_up(tmp_path / "cluster", port)
    finally:
        stop.set()
        thread.join(5)
        listener.close()
    assert result.returncode != 0
    line = _one_line(result.stderr)
    assert f"node n2 exited with status 3: HTTP port {port + 2}" in line, line
    assert "BadStatusLine" not in result.stderr
    for pid_file in (tmp_path / "cluster").glob("n*/node.pid"):
        _kill_if_alive(int(pid_file.read_text()))


# --------------------------------------------------------------------------- supervision


def test_killed_node_is_reported_and_restarted(tmp_path: Path, ups: list[Up]) -> None:
    up = Up(tmp_path / "cluster", free_port_block(9))
    ups.append(up)
    up.started()
    token = up.token()
    victim = up.pid(1)
    mark = len(up.lines)
    os.kill(victim, signal.SIGKILL)

    at = up.wait_for("node n1 was killed by SIGKILL", after=mark)
    assert f"log: {up.data / 'n1' / 'node.log'}" in up.lines[at]
    assert "serving http://127.0.0.1" in up.lines[at + 1] + up.lines[at + 2], up.output  # tail
    up.wait_for("restarting n1 in 1 s", after=at)
    up.wait_for("node n1 is back", after=at)
    assert up.pid(1) != victim and _alive(up.pid(1))
    assert _get(up.url(1) + "/v1/cluster", token)[0] == 200


def test_no_restart_leaves_a_dead_node_down(tmp_path: Path, ups: list[Up]) -> None:
    up = Up(tmp_path / "cluster", free_port_block(9), "--no-restart")
    ups.append(up)
    up.started()
    victim = up.pid(1)
    os.kill(victim, signal.SIGKILL)
    up.wait_for("node n1 was killed by SIGKILL")
    up.wait_for("n1 stays down")
    # Once every node is gone, up ends by itself with a failure: n1 was never restarted.
    for i in (0, 2, 3):
        os.kill(up.pid(i), signal.SIGKILL)
    assert up.proc.wait(timeout=60) == 1
    up.wait_for("every node has exited")
    assert up.pid(1) == victim
    assert "is back" not in up.output


# --------------------------------------------------------------------------- tokens and secrets


def test_restart_keeps_the_token_and_secret(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "cluster"
    port = free_port_block(9)
    first = Up(data, port, "--token", "first-token")
    ups.append(first)
    first.started()
    assert first.token() == "first-token"
    assert first.stop() == 0
    config = data / "cluster.toml"
    before = tomllib.loads(config.read_text())["auth"]
    config.chmod(0o644)  # as an editor or a copy might leave it

    again = Up(data, port)  # no --token, no $STORAGED_TOKEN
    ups.append(again)
    again.started()
    assert again.token() == "first-token"
    assert tomllib.loads(config.read_text())["auth"] == before
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert _get(again.url(0) + "/v1/cluster")[0] == 401
    status, doc = _get(again.url(0) + "/v1/cluster", "first-token")
    assert status == 200 and doc["insecure"] is False
    assert again.stop() == 0

    other = _run_up(data, port, "--token", "second-token")
    assert other.returncode != 0
    assert "--replace-token" in _one_line(other.stderr)
    dropped = _run_up(data, port, "--insecure")
    assert dropped.returncode != 0
    assert "--replace-token" in _one_line(dropped.stderr)
    assert tomllib.loads(config.read_text())["auth"] == before


def test_new_cluster_gets_a_random_token(tmp_path: Path, ups: list[Up]) -> None:
    up = Up(tmp_path / "cluster", free_port_block(9))
    ups.append(up)
    up.started()
    token = up.token()
    assert len(token) >= 16
    assert tomllib.loads((up.data / "cluster.toml").read_text())["auth"]["token"] == token
    assert _get(up.url(2) + "/v1/cluster")[0] == 401
    assert _get(up.url(2) + "/v1/cluster", token)[0] == 200


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """A client command of the real ``storaged``, configured by ``env`` alone."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "storaged", *args],
        capture_output=True, text=True, env=_env(**env), timeout=150,
    )  # fmt: skip


def test_up_makes_an_admin_token_and_drain_works_with_its_export_line(
    tmp_path: Path, ups: list[Up]
) -> None:
    data = tmp_path / "cluster"
    port = free_port_block(9)
    up = Up(data, port)
    ups.append(up)
    up.started()
    env = up.exported()
    admin = env["STORAGED_ADMIN_TOKEN"]
    assert len(admin) >= 16 and admin != env["STORAGED_TOKEN"]
    assert tomllib.loads((data / "cluster.toml").read_text())["auth"]["admin_token"] == admin

    # the client token alone: refused, saying what to give
    client_only = {k: v for k, v in env.items() if k != "STORAGED_ADMIN_TOKEN"}
    refused = _cli(client_only, "drain", "n3")
    assert refused.returncode == 1, refused.stderr
    assert "STORAGED_ADMIN_TOKEN" in _one_line(refused.stderr), refused.stderr

    # as the export line has it: a drain to the end, then its cancel
    drained = _cli(env, "drain", "n3", "--wait", "--timeout", "120", "--interval", "0.5")
    assert drained.returncode == 0, drained.stderr
    assert "n3 can leave" in drained.stdout
    cancelled = _cli(env, "drain", "n3", "--cancel")
    assert cancelled.returncode == 0, cancelled.stderr
    assert "not draining" not in cancelled.stderr
    twice = _cli(env, "drain", "n3", "--cancel")
    assert twice.returncode == 0 and "n3 was not draining: nothing to cancel" in twice.stderr
    assert up.stop() == 0

    # a restart keeps it
    again = Up(data, port)
    ups.append(again)
    again.started()
    assert again.exported()["STORAGED_ADMIN_TOKEN"] == admin


def test_ctrl_c_says_what_the_stop_waits_for_and_a_second_one_forces_it(
    tmp_path: Path, ups: list[Up]
) -> None:
    up = Up(tmp_path / "cluster", free_port_block(9))
    ups.append(up)
    up.started()
    assert up.stop() == 0  # one Ctrl-C: every node stops gracefully, and it says so
    stopping = up.wait_for("storaged up: stopping 4 nodes")
    assert "Ctrl-C again" in up.lines[stopping]
    assert up.wait_for("storaged up: stopped", after=stopping) > stopping
    assert "killed" not in up.output

    again = Up(up.data, up.port)
    ups.append(again)
    again.started()
    hung = again.pid(1)
    os.kill(hung, signal.SIGSTOP)  # a node that cannot finish its stop
    try:
        again.proc.send_signal(signal.SIGINT)
        again.wait_for("storaged up: stopping 4 nodes")
        others = [again.pid(i) for i in (0, 2, 3)]
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.1)  # the others stop (one may still be at it on a loaded machine)
        assert _alive(hung)
        again.proc.send_signal(signal.SIGINT)  # the second Ctrl-C
        line = again.lines[again.wait_for("(a second Ctrl-C)")]
        killed = re.search(r"storaged up: killed (.+) \(a second Ctrl-C\)", line)
        assert killed is not None, line
        assert "n1" in killed.group(1).split(", "), line  # the hung one, at least
        assert "lost unless another node has it on disk" in line
        again.wait_for("storaged up: stopped")
        assert again.proc.wait(timeout=60) == 0
        assert not _alive(hung)
    finally:
        if _alive(hung):
            os.kill(hung, signal.SIGKILL)


def test_a_stop_held_by_a_full_disk_says_so_and_a_second_ctrl_c_ends_it(
    tmp_path: Path, ups: list[Up]
) -> None:
    """nvme too small for what RAM holds: the save is acknowledged (three RAM copies), the
    drain cannot write it, and Ctrl-C's stop says what it waits for and why, node by node,
    instead of hanging silently; a second Ctrl-C ends it and says what may be lost."""
    up = Up(tmp_path / "cluster", free_port_block(9), "--nvme", "1MiB")
    ups.append(up)
    up.started()
    env = up.exported()
    data = tmp_path / "in.bin"
    data.write_bytes(os.urandom(6 << 20))
    saved = _cli(env, "save", str(data), "full/one", "--format", "raw", "--chunk-size", "1MiB")
    assert saved.returncode == 0, saved.stderr  # acknowledged in RAM, by design
    waited = _cli(
        env,
        "save",
        str(data),
        "full/two",
        "--format",
        "raw",
        "--chunk-size",
        "1MiB",
        "--wait",
        "nvme",
    )
    assert waited.returncode == 1 and "nvme_full" in waited.stderr, waited.stderr
    up.proc.send_signal(signal.SIGINT)
    stopping = up.wait_for("storaged up: stopping 4 nodes")
    waiting = up.wait_for("storaged up: still waiting for", timeout=60, after=stopping)
    why = up.lines[up.wait_for("RAM-only chunk(s) cannot drain: nvme tier", 30, waiting)]
    assert re.search(r"storaged up: n\d: \d+ RAM-only chunk\(s\) cannot drain", why), why
    assert "full" in why, why
    up.proc.send_signal(signal.SIGINT)  # the second Ctrl-C
    killed = up.lines[up.wait_for("(a second Ctrl-C)", timeout=60, after=waiting)]
    assert "lost unless another node has it on disk" in killed
    up.wait_for("storaged up: stopped", after=stopping)
    assert up.proc.wait(timeout=60) == 0


def test_a_cluster_without_token_must_be_asked_for(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "cluster"
    port = free_port_block(9)
    # A cluster file without a client token, as older versions of `up` wrote one.
    LocalCluster(nodes=4, data=data, port=port, peer_port=port + 4).write_config()
    before = (data / "cluster.toml").read_bytes()

    refused = _run_up(data, port)
    assert refused.returncode != 0
    assert "no client token" in _one_line(refused.stderr) and "--insecure" in refused.stderr
    assert (data / "cluster.toml").read_bytes() == before

    up = Up(data, port, "--insecure")
    ups.append(up)
    up.started()
    up.wait_for("INSECURE: no client token")
    assert up.token() == ""
    status, doc = _get(up.url(0) + "/v1/cluster")  # no token needed
    assert status == 200 and doc["insecure"] is True
    for i in range(4):
        assert "INSECURE" in (data / f"n{i}" / "node.log").read_text()


def test_cluster_file_is_private_after_a_rewrite(tmp_path: Path) -> None:
    cluster = LocalCluster(nodes=4, data=tmp_path, port=1, token="t")
    path = cluster.write_config()
    secret = tomllib.loads(path.read_text())["auth"]["cluster_secret"]
    # An admin token added by hand stays too.
    path.write_text(path.read_text().replace("[auth]", '[auth]\nadmin_token = "a"'))
    path.chmod(0o644)
    LocalCluster(nodes=4, data=tmp_path, port=1).write_config()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    auth = tomllib.loads(path.read_text())["auth"]
    assert auth == {"admin_token": "a", "cluster_secret": secret, "token": "t"}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# --------------------------------------------------------------------------- the caller's folder


def test_up_from_a_folder_holding_a_storaged_directory(tmp_path: Path, ups: list[Up]) -> None:
    # Right after `git clone`: the clone (a folder named storaged) is in the working
    # directory, and `python -m storaged` there would import it instead of the package.
    shadow = tmp_path / "storaged"
    shadow.mkdir()
    (shadow / "__init__.py").write_text('"""Not the package: no __version__ here."""\n')
    up = Up(tmp_path / "data", free_port_block(9), cwd=tmp_path)
    ups.append(up)
    up.started()
    assert "ImportError" not in up.output
    status, doc = _get(up.url(3) + "/healthz")
    assert status == 200 and doc["node"] == "n3"


# --------------------------------------------------------------------------- on etcd

needs_etcd = pytest.mark.skipif(
    etcd_binary() is None or importlib.util.find_spec("etcd3aio") is None,
    reason="needs etcd (apt-get install etcd-server) and the etcd extra (pip install -e .[etcd])",
)


def _client(up: Up, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A client command of the real CLI against ``up``'s four nodes."""
    urls = ",".join(up.url(i) for i in range(4))
    return subprocess.run(
        [sys.executable, "-P", "-m", "storaged", *args, "--url", urls, "--token", token],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )


def _wait(what: str, check: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.2)


def _figures(up: Up, token: str, i: int) -> dict[str, dict[str, Any]]:
    """Node ``i``'s /v1/cluster entries by node id."""
    status, doc = _get(up.url(i) + "/v1/cluster", token)
    assert status == 200, doc
    nodes = doc["nodes"]
    assert isinstance(nodes, list)
    return {str(n["id"]): n for n in nodes}


@needs_etcd
def test_up_on_etcd_saves_restores_shows_peers_and_stops_all(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "cluster"
    up = Up(data, free_port_block(9), "--coordinator", "etcd")
    ups.append(up)
    up.started()
    token = up.token()
    assert token
    assert "etcd etcd://127.0.0.1:" in up.output
    # No static member list: the nodes register in etcd; etcd compacts its history.
    assert "nodes" not in tomllib.loads((data / "cluster.toml").read_text())
    etcd_pid = int((data / "etcd.pid").read_text())
    cmdline = Path(f"/proc/{etcd_pid}/cmdline").read_bytes().split(b"\0")
    assert b"--auto-compaction-mode" in cmdline and b"periodic" in cmdline
    node_pids = [up.pid(i) for i in range(4)]

    # Save and restore through the client.
    blob = os.urandom(3 * 2**20 + 12345)
    (tmp_path / "in.bin").write_bytes(blob)
    saved = _client(up, token, "save", str(tmp_path / "in.bin"), "on-etcd/one",
                    "--format", "raw", "--chunk-size", "512KiB", "--no-progress")  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    restored = _client(up, token, "restore", "on-etcd/one", str(tmp_path / "out.bin"),
                       "--format", "raw", "--no-progress")  # fmt: skip
    assert restored.returncode == 0, restored.stderr
    assert (tmp_path / "out.bin").read_bytes() == blob

    listed = _client(up, token, "nodes", "--json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = json.loads(listed.stdout)["nodes"]
    assert sorted(r["id"] for r in rows if r["alive"]) == ["n0", "n1", "n2", "n3"]

    # Peers' figures: what n0 shows for each peer is what that peer says of itself (RAM
    # chunk counts do not move here: 128 MiB holds every copy), and peers hold chunks.
    def n0_shows_peers() -> bool:
        seen = _figures(up, token, 0)
        own = {f"n{i}": _figures(up, token, i)[f"n{i}"] for i in range(1, 4)}
        return all(seen[n]["memory"]["count"] == own[n]["memory"]["count"] for n in own)

    _wait("n0 shows its peers' figures", n0_shows_peers)
    peers = [entry for node, entry in _figures(up, token, 0).items() if node != "n0"]
    # 7 chunks, each in RAM on 3 of the 4 nodes: at least two of n0's peers hold some.
    holding = [p for p in peers if p["memory"]["count"] > 0 and p["memory"]["used"] > 0]
    assert len(holding) >= 2, peers
    assert all(p["memory"]["capacity"] == 128 * 2**20 for p in peers), peers

    # etcd killed: reported with its log, restarted on its port and data; the catalogue is
    # there again (the checkpoint saved before), and new commits go in once nodes re-register.
    start = len(up.lines)
    os.kill(etcd_pid, signal.SIGKILL)
    up.wait_for("storaged up: etcd was killed by SIGKILL", after=start)
    up.wait_for("restarting etcd in", after=start)
    up.wait_for("storaged up: etcd is back", after=start)
    etcd_pid = int((data / "etcd.pid").read_text())
    again = None
    for _ in range(30):
        again = _client(up, token, "save", str(tmp_path / "in.bin"), "on-etcd/two",
                        "--format", "raw", "--chunk-size", "512KiB", "--no-progress")  # fmt: skip
        if again.returncode == 0:
            break
        time.sleep(2)
    assert again is not None and again.returncode == 0, again and again.stderr
    listing = _client(up, token, "ls", "on-etcd/", "--json")
    assert listing.returncode == 0, listing.stderr
    names = [c["name"] for c in json.loads(listing.stdout)["checkpoints"]]
    assert names == ["on-etcd/one", "on-etcd/two"]

    # Ctrl-C: the nodes stop, then etcd; nothing is left running.
    assert up.stop() == 0, up.output
    assert not any(_alive(pid) for pid in [*node_pids, etcd_pid])
    assert "Traceback" not in up.output


def test_up_on_etcd_without_etcd_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no etcd on it
    monkeypatch.setattr(cluster_module, "ETCD_PATHS", (str(tmp_path / "etcd"),))
    data = tmp_path / "cluster"
    status = main(["up", "--data", str(data), "--port", str(free_port_block(9)),
                   "--coordinator", "etcd"])  # fmt: skip
    assert status == EXIT_CONFIG
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("storaged up: --coordinator etcd needs etcd"), line
    assert "apt-get install etcd-server" in line, line
    assert not data.exists()  # refused before anything was made or started
