"""The client commands of ``storaged``: ``ls``, ``status``, ``nodes``, ``rm``, ``save``,
``restore``, ``demo``.

Every command talks to the cluster named by ``--url`` (one node URL, or several
separated by commas; default ``$STORAGED_URL`` or ``http://127.0.0.1:7400``) with
the bearer token ``--token`` (default ``$STORAGED_TOKEN``). Commands that print
data take ``--json``.

Exit status, which scripts may rely on: 0 success; 1 the command failed (the
cluster is unreachable or refused the token, no such checkpoint, the name is
taken, the file cannot be read or written...); 2 the command line is wrong (bad
checkpoint name, unknown file extension, bad size); 3 ``nodes``: the cluster
answered and at least one node is down; 130 interrupted. Expected failures print
one ``storaged <command>: error: ...`` line on stderr, no traceback.

``save FILE NAME`` and ``restore NAME FILE`` understand ``.safetensors`` (a file,
or for ``save`` a directory of shards), ``.npz``, torch files (``.pt``, ``.pth``,
``.bin`` such as ``pytorch_model.bin``; loaded with ``weights_only=True``) and
``raw`` bytes; ``--format`` names the format when the extension does not, and
``-`` is stdin (raw) or stdout (safetensors, npz, raw). ``save`` reads and uploads
a few chunks at a time and ``restore`` writes as windows of items arrive, so
memory stays bounded whatever the file's size (torch output excepted: ``torch.save``
needs whole tensors). Progress bars (on stderr, when it is a terminal, or with
``--progress``) cover reading, uploading, fetching and writing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import io
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Final

import aiohttp
import numpy as np

from storaged.client.checkpoint import commit_checkpoint, restore_checkpoint
from storaged.client.client import STATES, CheckpointInfo, CheckpointStatus, Client
from storaged.client.command import (
    EXIT_NODE_DOWN,
    ByteProgress,
    CommandError,
    UsageError,
    human_bytes,
    run_async,
    run_command,
    urls_of,
    watch_durability,
)
from storaged.client.deadlines import Deadlines
from storaged.client.errors import (
    CheckpointNotFound,
    Exists,
)
from storaged.client.formats import (
    FILE_PREFIX,
    FORMATS,
    RESTORE_TO_STDOUT,
    SAVE_FROM_STDIN,
    STORAGE_DTYPES,
    SUFFIXES,
    VALUES_METADATA_KEY,
    DirectoryWriter,
    ItemWriter,
    NpzWriter,
    StreamWriter,
    UnknownFormat,
    check_writable,
    decode_value,
    format_of,
    open_source,
    safetensors_header,
    values_metadata,
    write_torch,
)
from storaged.client.layout import DEFAULT_CHUNK_SIZE, VALUE_DTYPES, LayoutError, Manifest
from storaged.client.streaming import (
    DEFAULT_RESTORE_WINDOW,
    DEFAULT_WINDOW,
    Counters,
    is_side_item,
    nbytes_of,
    output_items,
    restore_blocks,
    upload_sequential,
    upload_source,
)
from storaged.config import ConfigError, parse_size
from storaged.ids import is_checkpoint_name

__all__ = ["register"]


DEFAULT_URL: Final = "http://127.0.0.1:7400"


# --------------------------------------------------------------------------- arguments


def _connection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("STORAGED_URL") or DEFAULT_URL,
        help="node URL(s), comma-separated (default $STORAGED_URL or %(default)s)",
    )
    common.add_argument(
        "--token",
        default=os.environ.get("STORAGED_TOKEN") or None,
        help="client bearer token (default $STORAGED_TOKEN)",
    )
    return common


def _progress_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_mutually_exclusive_group()
    group.add_argument(
        "--progress",
        dest="progress",
        action="store_const",
        const=True,
        default=None,
        help="show progress bars even when stderr is not a terminal",
    )
    group.add_argument(
        "--no-progress", dest="progress", action="store_const", const=False, help="no bars"
    )
    return common


def _json_option() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    return common


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client commands to the ``storaged`` command's subparsers."""
    conn = _connection_options()
    progress = _progress_options()
    as_json = _json_option()

    p = sub.add_parser(
        "ls",
        parents=[conn, as_json],
        help="list committed checkpoints: size, bytes shared with others, where they are now",
    )
    p.add_argument("prefix", nargs="?", default="", help="only names starting with this")
    p.add_argument(
        "--no-costs",
        dest="costs",
        action="store_false",
        help="leave out the SHARED, RAM, NVME, COLD and STORED columns (no catalogue snapshot)",
    )
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "status",
        parents=[conn, as_json],
        help="durability of a checkpoint: levels reached, and where its copies are now",
    )
    p.add_argument("name")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "nodes",
        aliases=["cluster"],
        parents=[conn, as_json],
        help="the cluster's nodes: alive or down, space and chunks per tier, backlogs "
        "(exit status 3 when a node is down)",
    )
    p.set_defaults(func=cmd_nodes)

    p = sub.add_parser(
        "drain",
        parents=[conn, as_json],
        help="mark a node draining (no new placements; what it holds is copied elsewhere) "
        "and say when it can leave with nothing under-replicated",
    )
    p.add_argument("node", metavar="NODE", help="the node's id (as storaged nodes shows it)")
    p.add_argument("--wait", action="store_true", help="poll until the node can leave")
    p.add_argument("--cancel", action="store_true", help="mark the node active again")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait may take")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    p.add_argument(
        "--admin-token",
        default=os.environ.get("STORAGED_ADMIN_TOKEN") or None,
        help="admin bearer token (default $STORAGED_ADMIN_TOKEN)",
    )
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("rm", parents=[conn, as_json], help="delete checkpoints")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--prefix", help="delete every checkpoint whose name starts with this")
    p.set_defaults(func=cmd_rm)

    kinds = "safetensors (file or directory of shards), npz, torch (.pt, pytorch_model.bin) or raw"
    p = sub.add_parser(
        "save", parents=[conn, progress, as_json], help=f"save a {kinds} file as a checkpoint"
    )
    p.add_argument("file", help="the file; - reads raw bytes from stdin")
    p.add_argument("name")
    p.add_argument("--format", choices=FORMATS, help="when the extension does not say it")
    p.add_argument(
        "--wait",
        choices=STATES,
        default="memory",
        help="return once the checkpoint reached this level (memory: acknowledged)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait may take")
    p.add_argument("--chunk-size", default=str(DEFAULT_CHUNK_SIZE), help="e.g. 8MiB")
    p.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help="chunks in flight (memory used is about window x chunk size)",
    )
    p.set_defaults(func=cmd_save)

    p = sub.add_parser(
        "restore",
        parents=[conn, progress, as_json],
        help=f"restore a checkpoint into a {kinds} file",
    )
    p.add_argument("name")
    p.add_argument("file", help="the file; - writes to stdout (safetensors, npz, raw)")
    p.add_argument("--format", choices=FORMATS, help="when the extension does not say it")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    p.set_defaults(func=cmd_restore)

    from storaged.demo import add_demo_parser

    add_demo_parser(sub, [progress])


def _check_name(name: str) -> None:
    if not is_checkpoint_name(name):
        raise UsageError(
            f"invalid checkpoint name {name!r}: up to four /-separated parts of letters, "
            "digits, '.', '_' and '-', each starting with a letter or digit"
        )


def _format_of(path: str, given: str | None) -> str:
    try:
        return format_of(path, given)
    except UnknownFormat as exc:
        raise UsageError(str(exc)) from None


# --------------------------------------------------------------------------- running


def _client(args: argparse.Namespace) -> Client:
    # A command fails at once where nothing listens (a typo, a stopped cluster), instead
    # of backing off as a job's client does across a node's restart.
    try:
        deadlines = Deadlines.from_env()
    except ValueError as exc:  # names the variable
        raise UsageError(str(exc)) from None
    return Client(urls_of(args.url), token=args.token, refused_fails_fast=True, deadlines=deadlines)


# --------------------------------------------------------------------------- output


def _since_start(args: argparse.Namespace) -> float:
    """Seconds since the command started (``storaged.cli.main``; now, if called otherwise):
    the wall time a user sees, connecting, asking for the plan and waiting out a hung node
    included."""
    began = getattr(args, "began", None)
    return time.perf_counter() - began if isinstance(began, float) else 0.0


def _times(wall: float, transfer: float, size: int) -> str:
    """``3.4 s (transfer 0.5 s, 2.40 GB/s)``: wall time, and the bytes' own time beside it."""
    wall = max(wall, transfer)
    return f"{wall:.1f} s (transfer {transfer:.1f} s, {size / max(transfer, 1e-9) / 1e9:.2f} GB/s)"


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


# --------------------------------------------------------------------------- ls / status


#: ``ls`` columns after NAME, in order (``docs/OPERATIONS.md`` says what each means)
LS_COLUMNS: Final = ("STATE", "SIZE", "SHARED", "RAM", "NVME", "COLD", "STORED", "CREATED")


def _ls_row(c: CheckpointInfo) -> list[str]:
    row = [c.state, human_bytes(c.bytes)]
    if c.costs is not None:
        cost = c.costs
        row += [human_bytes(n) for n in (cost.shared, cost.memory.bytes, cost.nvme.bytes)]
        row += [human_bytes(cost.cold.bytes), human_bytes(cost.stored)]
    return [*row, _clock(c.created)]


def cmd_ls(args: argparse.Namespace) -> int:
    def body() -> None:
        async def main() -> None:
            async with _client(args) as client:
                listed = await client.list(args.prefix, costs=args.costs)
            if args.json:
                entries = []
                for c in listed:
                    entry: dict[str, Any] = {
                        "name": c.name,
                        "created": c.created,
                        "bytes": c.bytes,
                        "state": c.state,
                    }
                    if c.costs is not None:
                        entry["costs"] = dataclasses.asdict(c.costs)
                    entries.append(entry)
                _print_json({"checkpoints": entries})
                return
            if not listed:
                return
            columns = [c for c in LS_COLUMNS if args.costs or c in ("STATE", "SIZE", "CREATED")]
            rows = [["NAME", *columns]] + [[c.name, *_ls_row(c)] for c in listed]
            widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
            for row in rows:
                # NAME and STATE left-aligned, the sizes right-aligned, CREATED last as is
                cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
                cells += [cell.rjust(widths[i]) for i, cell in enumerate(row[2:-1], 2)]
                print("  ".join([*cells, row[-1]]))

        run_async(main)

    return run_command(args, body)


def _copies_now(chunks: list[str], plan: Mapping[str, list[Any]]) -> dict[str, int]:
    """Per tier, how many of ``chunks`` a live node holds there now (from ``?plan``, which
    names each live holder once, by its fastest tier), and how many no live node holds."""
    now = {"memory": 0, "hot": 0, "cold": 0, "unavailable": 0}
    for chunk in chunks:
        tiers = {holder.tier for holder in plan.get(chunk, [])}
        now["memory"] += "memory" in tiers
        now["hot"] += bool(tiers & {"memory", "nvme"})
        now["cold"] += "cold" in tiers
        now["unavailable"] += not tiers
    return now


def cmd_status(args: argparse.Namespace) -> int:
    def body() -> None:
        _check_name(args.name)

        async def main() -> tuple[CheckpointStatus, dict[str, int]]:
            async with _client(args) as client:
                try:
                    status, plan = await asyncio.gather(
                        client.status(args.name), client.plan(args.name)
                    )
                except CheckpointNotFound:
                    raise CommandError(f"no checkpoint named {args.name}") from None
            return status, _copies_now(list(plan), plan)

        status, now = run_async(main)
        doc: dict[str, Any] = {
            "name": args.name,
            "state": status.state,
            "chunks": status.chunks,
            # how many chunks reached at least each level (they never go back)
            "memory": status.memory,
            "nvme": status.nvme,
            "cold": status.cold,
            # where copies are now, on live nodes
            "now": now,
        }
        if status.lost is not None:
            doc["lost"] = status.lost
        if args.json:
            _print_json(doc)
            return
        n = status.chunks
        print(f"name    {args.name}")
        print(f"state   {status.state} (every chunk reached at least this level)")
        print(f"chunks  {n}")
        print(f"reached memory {status.memory}/{n}  nvme {status.nvme}/{n}  cold {status.cold}/{n}")
        print(
            f"now     in RAM {now['memory']}/{n}  in RAM or on nvme {now['hot']}/{n}  "
            f"fragments {now['cold']}/{n}  on no live node {now['unavailable']}/{n}"
        )
        if status.lost is not None:
            print(f"lost    {status.lost}")

    return run_command(args, body)


# --------------------------------------------------------------------------- nodes

_METRIC = re.compile(r'^(storaged_\w+)(?:\{tier="(\w+)"\})? ([0-9.eE+-]+|NaN)$')


def _parse_metrics(text: str) -> dict[str, float]:
    """The gauges ``nodes`` shows, as ``name`` or ``name:tier`` -> value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        found = _METRIC.match(line)
        if found:
            name, tier, value = found.groups()
            out[f"{name}:{tier}" if tier else name] = float(value)
    return out


async def _node_metrics(url: str, token: str | None, within: float) -> dict[str, float] | None:
    """A node's ``/metrics`` gauges; None when it does not answer within ``within`` s."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = aiohttp.ClientTimeout(total=within)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{url}/metrics", headers=headers) as resp,
        ):
            if resp.status != 200:
                return None
            return _parse_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


def _node_row(raw: Mapping[str, Any], metrics: Mapping[str, float] | None) -> dict[str, Any]:
    """A node's figures: ``/v1/cluster``'s, else its ``/metrics``'; None where neither has one."""
    alive = bool(raw.get("alive"))
    row: dict[str, Any] = {"id": raw.get("id"), "url": raw.get("url"), "alive": alive}
    # Alive to its peers' heartbeats for a while yet, a hung node answers nobody.
    row["answering"] = metrics is not None if alive else False
    row["state"] = str(raw.get("state") or "active")
    since = raw.get("down_since") if not alive else raw.get("up_since")
    row["since"] = since if isinstance(since, int | float) else None
    # A drain's own start, not the node's: how long the evacuation has been going on.
    drain = raw.get("draining_since")
    row["draining_since"] = drain if isinstance(drain, int | float) else None
    for tier in STATES:
        given = raw.get(tier)
        space: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        count = space.get("count")
        if count is None and metrics is not None:
            count = metrics.get(f"storaged_tier_chunks:{tier}")
        row[tier] = {
            "used": space.get("used"),
            "capacity": space.get("capacity"),
            "chunks": None if count is None else int(count),
        }
        if tier == "memory":
            row[tier]["dirty"] = space.get("dirty")
        else:
            # E16: "full" (writes to it fail for room), "nearly_full" (5 % or less left)
            row[tier]["state"] = str(space.get("state") or "ok")
            for key in ("free", "full_since", "cause"):
                row[tier][key] = space.get(key)
    for backlog in ("drain_backlog", "encode_backlog", "repair_backlog", "misplaced_backlog"):
        value = raw.get(backlog)
        if value is None and metrics is not None:
            value = metrics.get(f"storaged_{backlog}")
        row[backlog] = None if value is None else int(value)
    gc = raw.get("gc")
    row["gc"] = dict(gc) if isinstance(gc, Mapping) else None
    return row


#: how ``nodes`` marks a disk tier's state (E16)
_MARKS = {"full": " FULL", "nearly_full": " NEARLY-FULL"}


def _space(tier: Mapping[str, Any]) -> str:
    if tier["used"] is None:
        return "-"
    mark = _MARKS.get(tier.get("state") or "ok", "")
    return f"{human_bytes(tier['used'])}/{human_bytes(tier['capacity'] or 0)}{mark}"


def _room_lines(row: Mapping[str, Any], now: float) -> list[str]:
    """A line for each full or nearly full disk tier of ``row``'s node, saying why."""
    lines = []
    for tier in ("nvme", "cold"):
        space = row[tier]
        free = space.get("free")
        left = "" if free is None else f" ({human_bytes(free)} free)"
        if space.get("state") == "full":
            since = space.get("full_since")
            when = (
                f" since {_clock(since)[11:]} ({now - since:.0f} s)"
                if isinstance(since, int | float)
                else ""
            )
            what = (
                "its RAM fills with chunks that cannot drain; saves it would hold are "
                "refused with nvme_full"
                if tier == "nvme"
                else "chunks whose fragments go there cannot become cold (cold_full)"
            )
            lines.append(
                f"{row['id']}: {tier} FULL{when}{left}: {what}; free space there "
                f"({space.get('cause') or 'no room'})"
            )
        elif space.get("state") == "nearly_full":
            lines.append(f"{row['id']}: {tier} nearly full{left}")
    return lines


def cmd_nodes(args: argparse.Namespace) -> int:
    def body() -> None:
        async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
            async with _client(args) as client:
                doc = await client.cluster_document()
                # A node that missed the deadline of a request of this command is hung
                # or overloaded: not asked again (its /metrics would only wait as long).
                slow = set(client.slow_nodes())
                within = 2 * client.deadlines.metadata
            raw_nodes = [n for n in doc.get("nodes", []) if isinstance(n, Mapping)]
            # Only alive nodes are asked: a dead one would cost a timeout and say nothing.
            metrics = await asyncio.gather(
                *(
                    _node_metrics(str(n.get("url")), args.token, within)
                    if n.get("alive") and n.get("id") not in slow
                    else asyncio.sleep(0, None)
                    for n in raw_nodes
                )
            )
            return doc, [_node_row(n, m) for n, m in zip(raw_nodes, metrics, strict=True)]

        doc, rows = run_async(main)
        down = [row["id"] for row in rows if not row["alive"]]
        silent = [row["id"] for row in rows if row["alive"] and not row["answering"]]
        if args.json:
            _print_json(
                {
                    "nodes": rows,
                    "down": down,
                    "not_answering": silent,
                    "replication": doc.get("replication"),
                    "erasure": doc.get("erasure"),
                    "max_chunk_size": doc.get("max_chunk_size"),
                }
            )
        else:
            _print_nodes(rows)
        problems = []
        if down:
            problems.append(f"{len(down)} of {len(rows)} nodes down: {', '.join(map(str, down))}")
        if silent:
            problems.append(
                f"{len(silent)} of {len(rows)} nodes alive to their peers but not answering: "
                f"{', '.join(map(str, silent))}"
            )
        if problems:
            raise CommandError("; ".join(problems), EXIT_NODE_DOWN)

    return run_command(args, body)


def _print_nodes(rows: list[dict[str, Any]]) -> None:
    now = time.time()
    header = "NODE STATE MEMORY NVME COLD CHUNKS_m/n/c DRAIN ENCODE LACKING MISPLACED GC URL"
    table = [[name.replace("_", " ") for name in header.split()]]
    for row in rows:
        state = "alive" if row["alive"] else "DOWN"
        if row["since"] is not None and not (row["alive"] and row["draining_since"]):
            state += f" since {_clock(row['since'])[11:]} ({now - row['since']:.0f} s)"
        if row["alive"] and not row["answering"]:
            state += ", NOT ANSWERING"
        if row["state"] != "active":
            state += f", {row['state']}"
            if row["draining_since"] is not None:
                since = row["draining_since"]
                state += f" since {_clock(since)[11:]} ({now - since:.0f} s)"
        counts = [row[t]["chunks"] for t in STATES]
        table.append(
            [
                str(row["id"]),
                state,
                *(_space(row[t]) for t in STATES),
                "/".join("-" if c is None else str(c) for c in counts),
                *(
                    "-" if row[b] is None else str(row[b])
                    for b in (
                        "drain_backlog",
                        "encode_backlog",
                        "repair_backlog",
                        "misplaced_backlog",
                    )
                ),
                _gc_cell(row["gc"]),
                str(row["url"]),
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    for row in rows:
        for room in _room_lines(row, now):
            print(room)
        gc = row["gc"] or {}
        since = gc.get("stalled_since")
        if isinstance(since, int | float):
            print(
                f"{row['id']}: GC stalled since {_clock(since)[11:]} ({now - since:.0f} s), "
                f"nothing is freed meanwhile: {gc.get('cause')}"
            )


def _gc_cell(gc: Mapping[str, Any] | None) -> str:
    """``ok``, ``STALLED`` (no complete pass for longer than the grace), or ``-``."""
    if not gc:
        return "-"
    return "STALLED" if gc.get("stalled_since") is not None else "ok"


# --------------------------------------------------------------------------- drain


def _drain_line(doc: Mapping[str, Any]) -> str:
    verdict = (
        "can leave: everything it holds is safely elsewhere"
        if doc.get("can_leave")
        else "cannot leave yet"
    )
    return (
        f"{doc.get('node')}: {doc.get('state')}, {doc.get('chunks')} chunks "
        f"({doc.get('chunks_pending')} not yet elsewhere), {doc.get('fragments')} fragments "
        f"({doc.get('fragments_pending')} not yet elsewhere): {verdict}"
    )


def cmd_drain(args: argparse.Namespace) -> int:
    def body() -> None:
        if args.cancel and args.wait:
            raise UsageError("--wait waits for a drain: it does not go with --cancel")
        if args.timeout <= 0 or args.interval <= 0:
            raise UsageError("--timeout and --interval must be positive")

        async def main() -> tuple[dict[str, Any], dict[str, Any]]:
            async with _client(args) as client:
                marked = await client.drain(
                    args.node, cancel=args.cancel, admin_token=args.admin_token
                )
                if marked.get("was") == marked.get("state") and not args.json:
                    print(
                        f"{args.node} was not draining: nothing to cancel"
                        if args.cancel
                        else f"{args.node} was already draining",
                        file=sys.stderr,
                    )
                if marked.get("unreached") and not args.json:
                    print(
                        f"not told now (they learn it from their peers once back): "
                        f"{', '.join(map(str, marked['unreached']))}",
                        file=sys.stderr,
                    )
                deadline = time.monotonic() + args.timeout
                while True:
                    doc = await client.drain_progress(args.node, admin_token=args.admin_token)
                    if not args.json:
                        print(_drain_line(doc), file=sys.stderr if args.wait else sys.stdout)
                    if not args.wait or doc.get("can_leave"):
                        return marked, doc
                    if time.monotonic() + args.interval > deadline:
                        raise CommandError(
                            f"{args.node} cannot leave yet after {args.timeout:.0f} s: "
                            f"{doc.get('chunks_pending')} chunks and "
                            f"{doc.get('fragments_pending')} fragments not yet safely elsewhere"
                        )
                    await asyncio.sleep(args.interval)

        marked, doc = run_async(main)
        if args.json:
            _print_json({**doc, "unreached": marked.get("unreached", [])})
        elif args.wait:
            print(f"{args.node} can leave: nothing it holds is under-replicated without it")

    return run_command(args, body)


# --------------------------------------------------------------------------- rm


def cmd_rm(args: argparse.Namespace) -> int:
    def body() -> None:
        if not args.names and args.prefix is None:
            raise UsageError("name the checkpoints to delete, or give --prefix")
        if args.prefix is not None and not args.prefix:
            raise UsageError("--prefix must not be empty (it would delete every checkpoint)")
        for name in args.names:
            _check_name(name)

        async def main() -> tuple[list[str], list[str]]:
            deleted: list[str] = []
            missing: list[str] = []
            async with _client(args) as client:
                names = list(dict.fromkeys(args.names))
                if args.prefix is not None:
                    listed = [c.name for c in await client.list(args.prefix)]
                    if not listed:
                        raise CommandError(f"no checkpoint name starts with {args.prefix!r}")
                    names += [name for name in listed if name not in names]
                for name in names:
                    try:
                        await client.delete(name)
                    except CheckpointNotFound:
                        missing.append(name)
                    else:
                        deleted.append(name)
                        if not args.json:
                            print(f"deleted {name}", flush=True)
            return deleted, missing

        deleted, missing = run_async(main)
        if args.json:
            _print_json({"deleted": deleted, "missing": missing})
        if missing:
            raise CommandError(
                f"no checkpoint named {', '.join(missing)}"
                + (f" ({len(deleted)} others deleted)" if deleted else "")
            )

    return run_command(args, body)


# --------------------------------------------------------------------------- save


def _exists(name: str) -> str:
    return (
        f"a checkpoint named {name} already exists; checkpoints are immutable "
        f"(storaged rm {name} first, or choose another name)"
    )


def cmd_save(args: argparse.Namespace) -> int:
    def body() -> None:
        _check_name(args.name)
        fmt = _format_of(args.file, args.format)
        if args.file == "-" and fmt not in SAVE_FROM_STDIN:
            raise UsageError(
                f"{fmt} cannot be read from stdin (its items are not in stream order); "
                "give a file, or --format raw"
            )
        try:
            chunk_size = parse_size(args.chunk_size)
        except ConfigError as exc:
            raise UsageError(f"--chunk-size: {exc}") from None
        if chunk_size <= 0:
            raise UsageError("--chunk-size must be positive")
        if args.window < 1:
            raise UsageError("--window must be at least 1")
        if args.file != "-":
            path = Path(args.file)
            try:
                if not (fmt == "safetensors" and path.is_dir()):
                    path.open("rb").close()  # the usual mistake, before contacting anyone
            except OSError as exc:
                raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None
        run_async(lambda: _save(args, fmt, chunk_size))

    return run_command(args, body)


async def _save(args: argparse.Namespace, fmt: str, chunk_size: int) -> None:
    name: str = args.name
    async with _client(args) as client:
        # Token, reachability and name first: a large file is read only when it can be saved.
        try:
            await client.status(name)
        except CheckpointNotFound:
            pass
        else:
            raise CommandError(_exists(name))
        chunk_size = min(chunk_size, client.max_chunk_size)
        counters = Counters()
        stats = client.stats
        began = time.perf_counter()
        if args.file == "-":
            meta: dict[str, Any] = {"source": {"format": "raw", "file": "-"}}
            total: int | None = None
            items = 1
        else:
            try:
                source = await asyncio.to_thread(open_source, args.file, fmt)
            except OSError as exc:
                where = exc.filename or args.file  # a shard of a directory, say
                raise CommandError(f"cannot read {where}: {exc.strerror or exc}") from None
            meta, total, items = source.meta, source.nbytes, len(source.items)
        try:
            async with (
                ByteProgress(
                    lambda: counters.read, total, "read", enabled=args.progress, position=0
                ),
                ByteProgress(
                    lambda: stats.bytes_uploaded + stats.bytes_skipped,
                    total,
                    "upload",
                    enabled=args.progress,
                    position=1,
                ),
            ):
                if args.file == "-":
                    entry = await upload_sequential(
                        client,
                        sys.stdin.buffer.readinto,  # type: ignore[union-attr]
                        chunk_size,
                        window=args.window,
                        counters=counters,
                    )
                else:
                    entry = await upload_source(
                        client, source, chunk_size, window=args.window, counters=counters
                    )
        finally:
            if args.file != "-":
                await asyncio.to_thread(source.close)
        try:
            result = await commit_checkpoint(client, name, [entry], meta=meta)
        except Exists:
            raise CommandError(_exists(name)) from None
        took = time.perf_counter() - began
        wall = _since_start(args)
        size = counters.read
        report: dict[str, Any] = {
            "name": name,
            "items": items,
            "bytes": result.bytes,
            "chunks": result.chunks,
            "uploaded": stats.chunks_uploaded,
            "already_held": stats.chunks_skipped,
            "seconds": round(wall, 3),
            "transfer_seconds": round(took, 3),
        }
        if not args.json:
            print(
                f"saved {name}: {items} items, {human_bytes(result.bytes)} in "
                f"{result.chunks} chunks ({stats.chunks_uploaded} uploaded, "
                f"{stats.chunks_skipped} already held) in {_times(wall, took, size)}",
                flush=True,
            )
        if args.wait != "memory":
            seen = await watch_durability(
                client, name, args.wait, args.timeout, lambda line: print(line, file=sys.stderr)
            )
            report["state"] = seen.status.state
            report["reached_after"] = {k: round(v, 3) for k, v in seen.reached.items()}
            if not args.json:
                print(
                    f"{name} is {seen.status.state}: {args.wait} reached "
                    f"{seen.reached[args.wait]:.1f} s after the commit"
                )
        if args.json:
            _print_json(report)


# --------------------------------------------------------------------------- restore


def _make_early(path: Path, make: Callable[[], None]) -> None:
    """Make the temporary file or directory of a restore into ``path`` before any download:
    one that cannot be made fails the command now, saying why."""
    try:
        make()
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def _replacing(path: Path, force: bool) -> Iterator[Path]:
    """A temporary path next to ``path``, renamed over it when the block succeeds."""
    if path.exists() and not force:
        raise CommandError(f"{path} exists (--force overwrites it)")
    if path.is_dir():
        raise CommandError(f"{path} is a directory")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        _make_early(path, tmp.touch)
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


#: Room left for headers beyond the items' bytes when checking free space.
_HEADER_SLACK = 1 << 20


def _check_room(path: Path, tmp: Path, need: int) -> None:
    """Refuse, before any fetch, a restore the target's file system cannot hold."""
    # An existing file is replaced only at the end: until then both are on disk.
    free = shutil.disk_usage(tmp.parent).free
    if need + _HEADER_SLACK > free:
        raise CommandError(
            f"cannot restore into {path}: the checkpoint holds {human_bytes(need)} and "
            f"{tmp.parent} has {human_bytes(free)} free (nothing was fetched)"
        )


def cmd_restore(args: argparse.Namespace) -> int:
    def body() -> None:
        _check_name(args.name)
        if args.file == "-":
            # Without --format, the format the checkpoint was saved from (its manifest says).
            if args.format is not None and args.format not in RESTORE_TO_STDOUT:
                raise UsageError(
                    f"{args.format} cannot be written to stdout; allowed: "
                    f"{', '.join(RESTORE_TO_STDOUT)}"
                )
            run_async(lambda: _restore(args, args.format, None, None))
            return
        path = Path(args.file)
        args.dir_named = args.file.endswith("/") or path.is_dir()
        if _directory_target(args.file, args.format):
            with _replacing_dir(path, args.force) as tmp:
                run_async(lambda: _restore(args, DIRECTORY, path, tmp))
            return
        fmt = _format_of(args.file, args.format)
        with _replacing(path, args.force) as tmp:
            run_async(lambda: _restore(args, fmt, path, tmp))

    return run_command(args, body)


#: ``_restore``'s format for a shard directory written as it was saved
DIRECTORY: Final = "directory"


def _directory_target(file: str, given: str | None) -> bool:
    """Whether ``restore`` writes a directory: one named so (a trailing ``/``), one that
    exists, or a name without a known suffix (then the checkpoint must be a directory's)."""
    path = Path(file)
    wanted = file.endswith("/") or path.is_dir()
    if wanted and given not in (None, "safetensors"):
        raise UsageError(f"{file} is a directory: it takes safetensors shards, not {given}")
    return wanted or (given is None and path.suffix.lower() not in SUFFIXES)


@contextlib.contextmanager
def _replacing_dir(path: Path, force: bool) -> Iterator[Path]:
    """A temporary directory next to ``path``, put in its place when the block succeeds (an
    empty directory there is replaced; anything else only with ``force``)."""
    if path.exists() and not force:
        if not path.is_dir():
            raise CommandError(f"{path} is a file (--force replaces it with the directory)")
        if any(path.iterdir()):
            raise CommandError(f"{path} is a directory that is not empty (--force replaces it)")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    try:
        _make_early(path, tmp.mkdir)
        yield tmp
        if path.exists() or path.is_symlink():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, old):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()


def _stdout_format(name: str, manifest: Manifest) -> str:
    """The format ``restore NAME -`` writes without ``--format``: the one the checkpoint
    was saved from, or safetensors for one a library wrote (the DCP writer, the client)."""
    source = manifest.meta.get("source")
    saved = source.get("format") if isinstance(source, Mapping) else None
    if saved is None:
        return "safetensors"
    if saved not in RESTORE_TO_STDOUT:
        raise UsageError(
            f"{name} was saved from a {saved} file, which cannot be written to "
            f"stdout: give --format ({', '.join(RESTORE_TO_STDOUT)}) or a file name"
        )
    return str(saved)


async def _restore(
    args: argparse.Namespace, fmt: str | None, path: Path | None, tmp: Path | None
) -> None:
    name: str = args.name
    async with _client(args) as client:
        try:
            doc, holders = await asyncio.gather(client.get_manifest(name), client.plan(name))
        except CheckpointNotFound:
            raise CommandError(f"no checkpoint named {name}") from None
        try:
            manifest = Manifest.from_wire(doc)
        except LayoutError as exc:
            raise CommandError(f"checkpoint {name}: unreadable manifest: {exc}") from None
        if fmt is None:
            fmt = _stdout_format(name, manifest)
        layout = manifest.meta.get("safetensors_shards")
        whole = fmt == DIRECTORY
        if whole and not isinstance(layout, Mapping):
            if getattr(args, "dir_named", False):
                raise CommandError(
                    f"{name} was saved from a file, not a directory of shards: restore it "
                    "into a file (.safetensors, .npz, .pt)"
                )
            _format_of(args.file, None)  # the usage error naming the known suffixes
        items = output_items(manifest, side_files=whole)
        check_writable("safetensors" if whole else fmt, items)
        need = nbytes_of(manifest, side_files=whole)
        if path is not None and tmp is not None:
            _check_room(path, tmp, need)
        skipped = [] if whole else [k for k in manifest.keys() if is_side_item(manifest, k)]  # noqa: SIM118
        stats = client.stats
        counters = Counters()
        began = time.perf_counter()
        out: IO[bytes] = (
            sys.stdout.buffer
            if tmp is None
            else io.BytesIO()
            if whole
            else await asyncio.to_thread(open, tmp, "wb")
        )
        try:
            async with (
                ByteProgress(
                    lambda: stats.bytes_downloaded, need, "fetch", enabled=args.progress, position=0
                ),
                ByteProgress(
                    lambda: counters.written, need, "write", enabled=args.progress, position=1
                ),
            ):
                if fmt == "torch":
                    await _restore_torch(client, manifest, holders, out, counters)
                elif whole:
                    assert tmp is not None and isinstance(layout, Mapping)
                    saved = manifest.meta.get("safetensors_metadata")
                    writer = DirectoryWriter(tmp, layout, items).with_metadata(
                        saved if isinstance(saved, Mapping) else None
                    )
                    await _write_blocks(client, manifest, holders, writer, counters, True)
                else:
                    await _restore_streamed(client, manifest, holders, fmt, out, counters)
            out.flush()
        except OSError as exc:
            raise CommandError(f"cannot write {args.file}: {exc.strerror or exc}") from None
        finally:
            if tmp is not None:
                out.close()
        took = time.perf_counter() - began
    wall = _since_start(args)
    files = [k.removeprefix(FILE_PREFIX) for k in skipped if k.startswith(FILE_PREFIX)]
    if files:
        shown = ", ".join(files[:4]) + (" ..." if len(files) > 4 else "")
        print(
            f"storaged restore: note: {name} was saved from a directory: its tensors are in "
            f"{args.file}, its {len(files)} other files ({shown}) only in a directory "
            "restore (a name ending in /)",
            file=sys.stderr,
        )
    special = sorted({i.dtype for i in items if i.dtype in STORAGE_DTYPES})
    if fmt == "npz" and special:
        print(
            f"storaged restore: note: {', '.join(special)} items are written as their "
            "same-width unsigned integers (.npz has no such dtype)",
            file=sys.stderr,
        )
    report = {
        "name": name,
        "file": args.file,
        "items": len(items),
        "bytes": need,
        "seconds": round(wall, 3),
        "transfer_seconds": round(took, 3),
    }
    where = sys.stderr if tmp is None else sys.stdout  # stdout carries the data
    if args.json:
        print(json.dumps(report, indent=2), file=where)
    else:
        print(
            f"restored {name} into {args.file}: {len(items)} items, {human_bytes(need)} in "
            f"{_times(wall, took, need)}",
            file=where,
        )


async def _restore_streamed(
    client: Client,
    manifest: Manifest,
    holders: Any,
    fmt: str,
    out: IO[bytes],
    counters: Counters,
) -> None:
    items = output_items(manifest)
    if fmt == "safetensors":
        saved = manifest.meta.get("safetensors_metadata")
        metadata = dict(saved) if isinstance(saved, Mapping) else {}
        value_items = [item for item in items if item.dtype in VALUE_DTYPES]
        if value_items:
            # Non-tensor values (a DCP step, an optimizer's settings) go in the metadata,
            # as one JSON object; they are small, and the header comes first.
            got = await restore_checkpoint(
                client, manifest, {item.key: None for item in value_items}, holders=holders
            )
            decoded = await asyncio.to_thread(
                lambda: {item.key: decode_value(item, got[item.key]) for item in value_items}
            )
            metadata[VALUES_METADATA_KEY] = values_metadata(decoded)
        header = safetensors_header(items, metadata or None)
        writer: StreamWriter | NpzWriter = StreamWriter(out, header)
    elif fmt == "raw":
        writer = StreamWriter(out)
    else:
        writer = NpzWriter(out)
    await _write_blocks(client, manifest, holders, writer, counters, False)


async def _write_blocks(
    client: Client,
    manifest: Manifest,
    holders: Any,
    writer: ItemWriter,
    counters: Counters,
    side_files: bool,
) -> None:
    # A safetensors file has its values in its header already: they are not fetched again.
    values = not (isinstance(writer, StreamWriter) and writer.has_header)
    blocks = restore_blocks(
        client,
        manifest,
        holders,
        budget=DEFAULT_RESTORE_WINDOW,
        side_files=side_files,
        values=values,
    )
    try:
        async for block in blocks:
            if block.array is None:
                # decoding a DCP value unpickles it, and an npz member is a file write
                await asyncio.to_thread(writer.value, block.item, block.value)
                continue
            if block.first:
                await asyncio.to_thread(writer.begin, block.item)
            data = block.array.reshape(-1).view(np.uint8).data
            # Off the loop: the next window is being fetched meanwhile.
            await asyncio.to_thread(writer.write, data)
            counters.written += len(data)
    except BaseException:
        await asyncio.to_thread(writer.abandon)
        raise
    await asyncio.to_thread(writer.finish)


async def _restore_torch(
    client: Client, manifest: Manifest, holders: Any, out: IO[bytes], counters: Counters
) -> None:
    # torch.save needs every tensor whole: this output holds the checkpoint in memory.
    values = await restore_checkpoint(
        client, manifest, None, dtype_map=STORAGE_DTYPES, holders=holders
    )
    dtypes = {i.key: i.dtype for i in output_items(manifest)}
    await asyncio.to_thread(write_torch, out, values, dtypes, manifest.meta)
    counters.written = sum(v.nbytes for v in values.values() if isinstance(v, np.ndarray))
