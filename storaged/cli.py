"""The ``storaged`` command: ``serve`` one node, ``up`` a local cluster, and client commands."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from storaged import __version__
from storaged.config import Config, ConfigError, config_field_names, load_config

if TYPE_CHECKING:
    from storaged.tools.cluster_file import ClusterFile
    from storaged.tools.local_cluster import LocalCluster, LocalEtcd


def _state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "storaged" / "cluster"


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run one node of a cluster")
    p.add_argument(
        "--config", default=None, help="the cluster file (TOML); optional with --coordinator"
    )
    p.add_argument("--node", required=True, help="this node's id (in the cluster file)")
    for name in config_field_names():
        if name in ("node_id",):
            continue
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"set_{name}", default=None)
    p.set_defaults(func=cmd_serve)


#: exit statuses of ``serve`` that ``up`` and service managers may tell apart
EXIT_CONFIG = 2
EXIT_IN_USE = 3


class CannotListen(Exception):
    """An address of this node is taken, or not one this host can listen on."""


def cmd_serve(args: argparse.Namespace) -> int:
    """Run one node. A refusal to start is one line on stderr (``storaged serve: ...``)."""
    # Here, not at the top: ``storaged --version`` and ``ls`` start without them.
    import asyncio
    import logging

    from storaged.datalock import DataDirLocked, lock_data_dir

    overrides = {
        name: getattr(args, f"set_{name}")
        for name in config_field_names()
        if getattr(args, f"set_{name}", None) is not None
    }
    try:
        config = load_config(args.config, args.node, overrides=overrides)
    except ConfigError as exc:
        print(f"storaged serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from storaged.logs import setup_logging

    setup_logging(config.node_id, config.log_level, config.log_json)
    try:
        lock = lock_data_dir(config.data_dir)
    except DataDirLocked as exc:
        print(f"storaged serve: node {config.node_id}: {exc}", file=sys.stderr)
        return EXIT_IN_USE
    except OSError as exc:
        print(f"storaged serve: node {config.node_id}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    with lock:
        try:
            _check_listen(config)
        except CannotListen as exc:
            print(f"storaged serve: node {config.node_id}: {exc}", file=sys.stderr)
            return EXIT_IN_USE
        if not config.token:
            logging.getLogger("storaged.serve").warning(
                "node %s: INSECURE: no client token, every client is accepted "
                "(set [auth] token in the cluster file)",
                config.node_id,
            )
        try:
            import uvloop

            uvloop.install()
        except ImportError:  # pragma: no cover - uvloop is a dependency; stay usable without it
            pass
        try:
            return asyncio.run(_serve(config))
        except ConfigError as exc:  # found at start: an archive that cannot be opened, or a
            # policy that needs one (what only the node can check)
            print(f"storaged serve: node {config.node_id}: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        except OSError as exc:
            # _check_listen's probe and the bind race with other processes on the host.
            if exc.errno != errno.EADDRINUSE:
                raise
            print(f"storaged serve: node {config.node_id}: {exc}", file=sys.stderr)
            return EXIT_IN_USE


def _check_listen(config: Config) -> None:
    """Raise ``CannotListen`` if the HTTP or peer address cannot be listened on now.

    Before the node opens its tiers (which may take a while): a taken port is
    reported at once, in one line, rather than as a traceback after start-up.
    """
    import socket

    for what, (host, port) in (("HTTP", config.node.http_addr), ("peer", config.node.peer_addr)):
        try:
            # SO_REUSEADDR (create_server's default), as the node's own listeners use:
            # connections of a previous run in TIME_WAIT do not count as taken.
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            probe = socket.create_server((host, port), family=family)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CannotListen(
                    f"{what} port {port} ({host}:{port}) is taken by another process"
                ) from None
            raise CannotListen(
                f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}"
            ) from None
        probe.close()


async def _serve(config: Config) -> int:
    import asyncio
    import signal

    from storaged.front.http import serve
    from storaged.node import Node

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if config.coordinator:
        from storaged.coord.etcd_membership import open_etcd

        membership, catalogue = open_etcd(config)
        node = await Node.open(config, membership=membership, catalogue=catalogue)
    else:
        node = await Node.open(config)
    await serve(node, stop)
    return 0


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up",
        help="run a local cluster of N node processes on 127.0.0.1",
        description="Start N nodes on 127.0.0.1, report success once each of them serves, "
        "and supervise them until Ctrl-C: a node that exits is reported with the tail of its "
        "log and restarted. A new cluster gets a random client token unless --token or "
        "--insecure, and a random admin token (drain, evict) unless --insecure. An existing "
        "cluster file (DIR/cluster.toml) is the operator's: up keeps everything in it (its "
        "tokens and cluster secret, its nodes and ports, its settings, hand edits and "
        "comments; one without an admin token gets one), and a flag given overrides the "
        "file's value, saying so in one line; a flag not given changes nothing. With "
        "--coordinator etcd, a local etcd member (Debian's etcd-server) holds membership and "
        "the catalogue: it is started first and stopped last, on a port kept in the file.",
    )
    # No defaults here: a flag not given leaves the cluster file's value (the defaults
    # of a new file are in storaged/tools/cluster_file.py).
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (new file: 4)")
    p.add_argument("--data", default=None, help="data directory (default: user state dir)")
    p.add_argument(
        "--port", type=int, default=None, help="HTTP port of n0, n<i>: port+i (new file: 7400)"
    )
    p.add_argument(
        "--peer-port", type=int, default=None, help="peer port of n0 (new file: port+1000)"
    )
    p.add_argument(
        "--token",
        default=os.environ.get("STORAGED_TOKEN", ""),
        help="client token (default $STORAGED_TOKEN; a new cluster without one gets a random "
        "token; an existing cluster keeps its own)",
    )
    p.add_argument(
        "--insecure", action="store_true", help="no client token: every client is accepted"
    )
    p.add_argument(
        "--replace-token",
        action="store_true",
        help="replace the client token of an existing cluster file (with --token, or drop it "
        "with --insecure)",
    )
    p.add_argument(
        "--new-secret",
        action="store_true",
        help="a new cluster secret (peer authentication) instead of the cluster file's",
    )
    p.add_argument(
        "--no-restart", action="store_true", help="report a node that exits, do not restart it"
    )
    p.add_argument("--memory", default=None, help="RAM tier capacity per node (new file: 2GiB)")
    p.add_argument("--nvme", default=None, help="disk tier capacity per node (new file: 100GiB)")
    p.add_argument(
        "--cold", default=None, help="erasure-coded tier capacity per node (new file: 100GiB)"
    )
    p.add_argument(
        "--replication", type=int, default=None, help="RAM copies per chunk (new file: 3)"
    )
    p.add_argument(
        "--coordinator",
        choices=("embedded", "etcd"),
        default=None,
        help="where membership and the catalogue live: embedded (the cluster file and the "
        "nodes; the default for a new file) or etcd (one local etcd member, data under "
        "DATA/etcd); an existing file keeps its own",
    )
    p.add_argument(
        "--etcd-port",
        type=int,
        default=None,
        help="client port of the local etcd (its peer port: the next one); by default one "
        "is drawn free once and kept in the cluster file",
    )
    p.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> int:
    """Start the cluster; 0 once its own nodes serve and a signal stopped them, else 1 or 2."""
    from storaged.tools.cluster_file import ClusterFileError
    from storaged.tools.local_cluster import ClusterError, LocalCluster, supervise

    if args.insecure and args.token:
        print("storaged up: --insecure and --token exclude each other", file=sys.stderr)
        return EXIT_CONFIG
    data = (Path(args.data) if args.data else _state_dir()).absolute()
    try:
        file, etcd = _up_plan(args, data)
    except (ClusterFileError, ClusterError) as exc:
        print(f"storaged up: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    layout = file.layout
    cluster = LocalCluster(
        nodes=layout.nodes,
        data=data,
        port=layout.port,
        peer_port=layout.peer_port,
        token=args.token,
        https=layout.https,
        die_with_parent=True,
        replace_token=args.replace_token,
        new_secret=args.new_secret,
        etcd=etcd,
    )
    try:
        cluster.check_not_running()
        _up_auth(args, file, cluster)
        file.check(cluster.node_environ())
        if etcd is not None:
            _check_etcd_ports(etcd.client_port, file.path, given=args.etcd_port is not None)
    except ClusterFileError as exc:
        print(f"storaged up: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ClusterError as exc:
        print(f"storaged up: {exc}", file=sys.stderr)
        return 1
    for line in file.said:
        print(line, flush=True)
    try:
        file.write()
        cluster.config_written = True
        cluster.start()
    except ClusterError as exc:
        cluster.stop()
        print(f"storaged up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        cluster.stop()
        print("storaged up: interrupted", file=sys.stderr)
        return 130
    _print_up(cluster, layout.nodes, etcd, restart=not args.no_restart)
    return supervise(cluster, restart=not args.no_restart)


def _up_plan(args: argparse.Namespace, data: Path) -> tuple[ClusterFile, LocalEtcd | None]:
    """The cluster file ``up`` will run (the operator's, with the flags as overrides), and
    the local etcd member it names; ``ClusterFileError`` or ``ClusterError`` if neither."""
    from storaged.tools.cluster_file import UpFlags, plan

    # every field of UpFlags is the flag of ``up`` of the same name
    flags = UpFlags(**{f.name: getattr(args, f.name) for f in dataclasses.fields(UpFlags)})
    file = plan(data / "cluster.toml", flags)
    etcd = None
    if file.layout.etcd_port is not None:
        etcd = _local_etcd(data)
        etcd.client_port, etcd.peer_port = file.layout.etcd_port, file.layout.etcd_port + 1
    return file, etcd


def _up_auth(args: argparse.Namespace, file: ClusterFile, cluster: LocalCluster) -> None:
    """The client and admin tokens ``up`` starts the nodes with, kept in the cluster file:
    the file's unless a flag says otherwise; a new one where there is none and
    ``--insecure`` was not given. ``ClusterError`` when the flags contradict the file."""
    from storaged.tools.local_cluster import ClusterError, new_token

    auth = file.auth() if file.before is not None else None
    has_token = auth is not None and ("token" in auth or "token_env" in auth)
    if args.insecure and has_token and not args.replace_token:
        raise ClusterError(
            f"{file.path} has a client token; --insecure drops it only with --replace-token"
        )
    if not (args.insecure or args.token or has_token):
        if auth is not None:
            raise ClusterError(
                f"{file.path} has no client token: give one with --token, or run it "
                "without with --insecure"
            )
        cluster.token = new_token()
    if not args.insecure:
        # Draining a node, evicting a tier: the admin endpoints need their own token
        # (a file that has one keeps it; keep_auth says which).
        cluster.admin_token = new_token()
    file.set_auth(cluster.keep_auth(file.auth()))


def _print_up(cluster: LocalCluster, nodes: int, etcd: LocalEtcd | None, *, restart: bool) -> None:
    """What ``up`` says once its nodes serve: where they are and the exports to reach them."""
    import shlex

    print(f"storaged: {nodes} nodes up (cluster file {cluster.config_path})", flush=True)
    for i, url in enumerate(cluster.urls):
        print(f"  {cluster.node_id(i)}  {url}", flush=True)
    if etcd is not None:
        print(f"  etcd {etcd.url} (data {etcd.data}, log {etcd.log_path})", flush=True)
    exports = f"export STORAGED_URL={','.join(cluster.urls)}"
    if cluster.token:
        exports += f" STORAGED_TOKEN={shlex.quote(cluster.token)}"
    else:
        print("INSECURE: no client token, every client is accepted (--insecure)", flush=True)
    if cluster.admin_token:
        exports += f" STORAGED_ADMIN_TOKEN={shlex.quote(cluster.admin_token)}"
    print(exports, flush=True)
    restarts = "a node that exits is reported" + (" and restarted" if restart else "")
    print(f"Ctrl-C stops them; {restarts}.", flush=True)


def _check_etcd_ports(port: int, path: Path, *, given: bool) -> None:
    """``ClusterError`` if the local etcd's client or peer port is taken: ``up`` does not
    move etcd elsewhere on its own (nodes joined by hand know its address)."""
    import socket  # here, as in cmd_serve: ``storaged ls`` starts without it

    from storaged.tools.local_cluster import ClusterError

    for what, taken in (("port", port), ("peer port", port + 1)):
        try:
            # SO_REUSEADDR, as etcd's own listeners: a previous run's TIME_WAIT is no owner.
            probe = socket.create_server(("127.0.0.1", taken))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ClusterError(f"cannot listen on 127.0.0.1:{taken} for etcd: {exc}") from None
            source = f"--etcd-port {port}" if given else f"[up] etcd_port = {port} in {path}"
            raise ClusterError(
                f"etcd's {what} {taken} ({source}) is taken by another process: stop it, or "
                "move etcd with --etcd-port PORT (kept in the file from then on; nodes joined "
                "by hand must then be given the new etcd URL)"
            ) from None
        probe.close()


def _local_etcd(data: Path) -> LocalEtcd:
    """The local etcd member of ``up --coordinator etcd``; ``ClusterError`` saying how to
    get what is missing (the etcd server, or the client library of the etcd extra)."""
    import importlib.util

    from storaged.tools.local_cluster import ETCD_HINT, ClusterError, LocalEtcd, etcd_binary

    binary = etcd_binary()
    if binary is None:
        raise ClusterError(f"--coordinator etcd needs etcd, which is not installed: {ETCD_HINT}")
    if importlib.util.find_spec("etcd3aio") is None:
        raise ClusterError(
            "--coordinator etcd needs the etcd client library: pip install 'storaged[etcd]'"
        )
    return LocalEtcd(data / "etcd", binary, die_with_parent=True)


Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``storaged demo``: a tool of its own (``storaged/tools/demo.py``, imported when it
    runs), not a client command."""
    from storaged.client.cli import progress_options

    p = sub.add_parser(
        "demo",
        parents=[progress_options()],
        help="save a synthetic multi-rank checkpoint, watch it drain, kill a node, restore",
        description="Save a synthetic checkpoint from 4 ranks with AsyncSaver, follow it "
        "memory -> nvme -> cold, kill a node, restore onto 2 ranks and check every byte.",
    )
    p.add_argument(
        "--url",
        default=None,
        help="use this cluster (node URLs, comma-separated) instead of starting one",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("STORAGED_TOKEN") or None,
        help="client token for --url (default $STORAGED_TOKEN)",
    )
    p.add_argument("--size", default="2GiB", help="checkpoint size (default %(default)s)")
    p.add_argument("--ranks", type=int, default=4, help="ranks that save (default 4)")
    p.add_argument("--restore-ranks", type=int, default=2, help="ranks that restore (default 2)")
    p.add_argument("--nodes", type=int, default=4, help="nodes of the local cluster")
    p.add_argument("--kill", type=int, default=1, help="index of the node to kill (default 1)")
    p.add_argument(
        "--no-kill", action="store_true", help="restore with every node up (for comparison)"
    )
    p.add_argument("--data", default=None, help="parent of the temporary data dir")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to reach cold")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (with --url)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from storaged.tools.demo import cmd_demo as run

    return run(args)


def _client_commands() -> list[Registrar]:
    """Client-side commands live with the client; absent parts just aren't offered."""
    registrars: list[Registrar] = []
    try:
        from storaged.client.cli import register
    except ImportError:
        pass
    else:
        registrars.append(register)
        registrars.append(_add_demo)
    try:
        from storaged.tools.advise import (  # type: ignore[import-not-found,unused-ignore]
            register as register_advise,
        )
    except ImportError:
        pass
    else:
        registrars.append(register_advise)
    return registrars


def _parser() -> argparse.ArgumentParser:
    """Every command's arguments."""
    parser = argparse.ArgumentParser(
        prog="storaged", description="A tiered checkpoint store for distributed training."
    )
    parser.add_argument("--version", action="version", version=f"storaged {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_up(sub)
    for register in _client_commands():
        try:
            register(sub)
        except ImportError as exc:  # a half-installed optional part must not stop `serve`
            print(f"storaged: some commands are unavailable: {exc}", file=sys.stderr)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Figures a command prints count from here, what a user's clock sees of the command
    # (less only the interpreter's start).
    began = time.perf_counter()
    args = _parser().parse_args(argv)
    args.began = began
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
