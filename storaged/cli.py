"""The ``storaged`` command: ``serve`` one node, ``up`` a local cluster, and client commands."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from storaged.config import ConfigError, config_field_names, load_config


def _state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "storaged" / "cluster"


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run one node of a cluster")
    p.add_argument("--config", required=True, help="the cluster file (TOML)")
    p.add_argument("--node", required=True, help="this node's id in the cluster file")
    for name in config_field_names():
        if name in ("node_id",):
            continue
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"set_{name}", default=None)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = {
        name: getattr(args, f"set_{name}")
        for name in config_field_names()
        if getattr(args, f"set_{name}", None) is not None
    }
    try:
        config = load_config(args.config, args.node, overrides=overrides)
    except ConfigError as exc:
        print(f"storaged serve: {exc}", file=sys.stderr)
        return 2
    from storaged.logs import setup_logging

    setup_logging(config.node_id, config.log_level, config.log_json)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; stay usable without it
        pass
    return asyncio.run(_serve(config))


async def _serve(config: object) -> int:
    from storaged.config import Config
    from storaged.node import Node
    from storaged.server import serve

    assert isinstance(config, Config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    node = await Node.open(config)
    await serve(node, stop)
    return 0


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run a local cluster of N node processes on 127.0.0.1")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--data", default=None, help="data directory (default: user state dir)")
    p.add_argument("--port", type=int, default=7400, help="HTTP port of n0 (n<i>: port+i)")
    p.add_argument("--peer-port", type=int, default=0, help="peer port of n0 (default port+1000)")
    p.add_argument("--token", default=os.environ.get("STORAGED_TOKEN", ""))
    p.add_argument("--memory", default="2GiB", help="RAM tier capacity per node")
    p.add_argument("--replication", type=int, default=3)
    p.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> int:
    from storaged.cluster import ClusterError, LocalCluster, wait_forever_until_signal

    data = Path(args.data) if args.data else _state_dir()
    cluster = LocalCluster(
        nodes=args.nodes,
        data=data,
        port=args.port,
        peer_port=args.peer_port,
        token=args.token,
        replication=args.replication,
        settings={"tiers": {"memory_capacity": args.memory}},
        die_with_parent=True,
    )
    try:
        cluster.start()
    except ClusterError as exc:
        cluster.stop()
        print(f"storaged up: {exc}", file=sys.stderr)
        return 1
    print(f"storaged: {args.nodes} nodes up (cluster file {cluster.config_path})", flush=True)
    for i, url in enumerate(cluster.urls):
        print(f"  {cluster.node_id(i)}  {url}", flush=True)
    print("Ctrl-C stops them.", flush=True)
    return wait_forever_until_signal(cluster)


Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _client_commands() -> list[Registrar]:
    """Client-side commands live with the client; absent parts just aren't offered."""
    registrars: list[Registrar] = []
    try:
        from storaged.client.cli import register
    except ImportError:
        pass
    else:
        registrars.append(register)
    try:
        from storaged.advise import (  # type: ignore[import-not-found,unused-ignore]
            register as register_advise,
        )
    except ImportError:
        pass
    else:
        registrars.append(register_advise)
    return registrars


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="storaged", description="A tiered checkpoint store for distributed training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_up(sub)
    for register in _client_commands():
        try:
            register(sub)
        except ImportError as exc:  # a half-installed optional part must not stop `serve`
            print(f"storaged: some commands are unavailable: {exc}", file=sys.stderr)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
