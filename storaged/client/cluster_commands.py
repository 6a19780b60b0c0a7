"""``storaged ls``, ``status``, ``nodes``, ``drain`` and ``rm``: the commands that ask or
tell the cluster and move no checkpoint data.

They import the HTTP client, not numpy nor the formats (``storaged.client.cli`` imports
this module only when one of them runs; tests/client/test_cli_start.py holds that).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, Final

import aiohttp

from storaged.client.client import CheckpointInfo, CheckpointStatus, Client
from storaged.client.command import (
    EXIT_NODE_DOWN,
    CommandError,
    UsageError,
    check_name,
    client_of,
    human_bytes,
    print_json,
    run_async,
    run_command,
)
from storaged.client.documents import Survives, WaitTimeout
from storaged.client.errors import CheckpointNotFound
from storaged.wire import STATES

__all__ = ["cmd_drain", "cmd_ls", "cmd_nodes", "cmd_retention", "cmd_rm", "cmd_status"]


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


def _ls_entry(c: CheckpointInfo, *, retention: bool) -> dict[str, Any]:
    """A checkpoint as ``ls --json`` prints it: its fields in order, ``costs`` only when
    asked for (``--costs``), ``retention`` only when some listed checkpoint is under a
    retention rule."""
    entry = dataclasses.asdict(c)
    if c.costs is None:
        del entry["costs"]
    if not retention:
        del entry["retention"]
    return entry


def _archive_cell(c: CheckpointInfo) -> str:
    """Whether the archive holds ``c``: yes, no, or - (no archive, or it did not say)."""
    if c.state == "archived":
        return "yes"  # only the archive holds it (E19)
    archived = c.retention.archived if c.retention is not None else None
    return "-" if archived is None else ("yes" if archived else "no")


def cmd_ls(args: argparse.Namespace) -> int:
    def body() -> None:
        async def main() -> None:
            async with client_of(args) as client:
                listed = await client.list(args.prefix, costs=args.costs, retention=True)
            # KEPT BY (extension E20) only where a rule covers something listed, ARCHIVE where
            # the cluster has an archive (E19): a cluster with neither lists as before.
            policy = any(c.retention is not None and c.retention.rule for c in listed)
            archive = policy or any(_archive_cell(c) != "-" for c in listed)
            if args.json:
                print_json({"checkpoints": [_ls_entry(c, retention=archive) for c in listed]})
                return
            if not listed:
                return
            columns = [c for c in LS_COLUMNS if args.costs or c in ("STATE", "SIZE", "CREATED")]
            rows = [["NAME", *columns]] + [[c.name, *_ls_row(c)] for c in listed]
            if archive:
                rows[0][-1:-1] = ["ARCHIVE"]
                for row, c in zip(rows[1:], listed, strict=True):
                    row[-1:-1] = [_archive_cell(c)]
            if policy:
                rows[0].append("KEPT BY")
                for row, c in zip(rows[1:], listed, strict=True):
                    row.append(c.retention.kept_by if c.retention is not None else "no policy")
            widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
            last = len(rows[0]) - (2 if policy else 1)  # CREATED: the first as-is column
            for row in rows:
                # NAME and STATE left-aligned, the sizes right-aligned, CREATED (and KEPT BY)
                # last as is
                cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
                cells += [cell.rjust(widths[i]) for i, cell in enumerate(row[2:last], 2)]
                tail = row[last:]
                if policy:
                    tail = [tail[0].ljust(widths[last]), tail[1]]
                print("  ".join([*cells, *tail]))

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
        check_name(args.name)

        async def main() -> tuple[CheckpointStatus, dict[str, int]]:
            async with client_of(args) as client:
                try:
                    if args.wait is not None:
                        await _wait(client, args.name, args.wait, args.timeout)
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
        if status.survives is not None:
            doc["survives"] = {"nodes": status.survives.nodes, "domain": status.survives.domain}
        if status.archived is not None:
            doc["archived"] = status.archived
        if args.json:
            print_json(doc)
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
        if status.survives is not None:
            print(f"survives the loss of {status.survives} (as its copies are held now)")
        if status.archived is not None:
            print(f"archive {'archived' if status.archived else 'not archived'}")

    return run_command(args, body)


async def _wait(client: Client, name: str, level: str, timeout: float) -> None:
    """``Client.wait``, its timeout said as a command error."""
    try:
        await client.wait(name, level, timeout=timeout)
    except WaitTimeout as exc:
        raise CommandError(str(exc)) from None


def cmd_archive(args: argparse.Namespace) -> int:
    """Archive a committed checkpoint (E19); ``--wait``: until its manifest is there."""

    def body() -> None:
        check_name(args.name)

        async def main() -> bool:
            async with client_of(args) as client:
                try:
                    done = await client.archive(args.name)
                    if args.wait and not done:
                        await _wait(client, args.name, "archived", args.timeout)
                        return True
                except CheckpointNotFound:
                    raise CommandError(f"no checkpoint named {args.name}") from None
                return done

        done = run_async(main)
        if args.json:
            print_json({"name": args.name, "archived": done})
        elif done:
            print(f"{args.name}: archived")
        else:
            print(f"{args.name}: archiving (storaged status {args.name} --wait archived)")

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
    row["domain"] = raw.get("domain")
    # Alive to its peers' heartbeats for a while yet, a hung node answers nobody.
    row["answering"] = metrics is not None if alive else False
    row["state"] = str(raw.get("state") or "active")
    since = raw.get("down_since") if not alive else raw.get("up_since")
    row["since"] = since if isinstance(since, int | float) else None
    # A drain's own start, not the node's: how long the evacuation has been going on.
    drain = raw.get("draining_since")
    row["draining_since"] = drain if isinstance(drain, int | float) else None
    # A peer not heard from yet by the node asked: its zeros mean "not known", shown as such.
    reported = raw.get("usage_reported") is not False
    for tier in STATES:
        given = raw.get(tier) if reported else None
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
            async with client_of(args) as client:
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
            print_json(
                {
                    "nodes": rows,
                    "down": down,
                    "not_answering": silent,
                    "replication": doc.get("replication"),
                    "erasure": doc.get("erasure"),
                    "max_chunk_size": doc.get("max_chunk_size"),
                    "survives": doc.get("survives"),
                }
            )
        else:
            _print_nodes(rows)
            print(_survives_line(doc, rows))
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


def _survives_line(doc: Mapping[str, Any], rows: list[dict[str, Any]]) -> str:
    """What placement survives, with the failure domains where any is declared."""
    survives = Survives.of(doc.get("survives"))
    line = f"placement survives the loss of {survives}" if survives else "placement: -"
    domains: dict[str, list[str]] = {}
    for row in rows:
        if row["domain"]:
            domains.setdefault(str(row["domain"]), []).append(str(row["id"]))
    if domains:
        alone = [str(row["id"]) for row in rows if not row["domain"]]
        listed = [f"{d}: {' '.join(ids)}" for d, ids in sorted(domains.items())]
        listed += [f"{node} alone" for node in alone]
        line += f" (failure domains: {'; '.join(listed)})"
    return line


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
            async with client_of(args) as client:
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
            print_json({**doc, "unreached": marked.get("unreached", [])})
        elif args.wait:
            print(f"{args.node} can leave: nothing it holds is under-replicated without it")

    return run_command(args, body)


# --------------------------------------------------------------------------- retention


def _policy_toml(rules: list[Mapping[str, Any]]) -> str:
    """``rules`` as the [[retention]] tables ``retention set`` reads back."""
    out = []
    for rule in rules:
        out.append("[[retention]]")
        for key, value in rule.items():
            text = ("true" if value else "false") if isinstance(value, bool) else value
            out.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {text}")
        out.append("")
    return "\n".join(out)


def cmd_retention(args: argparse.Namespace) -> int:
    def body() -> None:
        rules: list[dict[str, Any]] | None = None
        if args.action == "set":
            if not args.file:
                raise UsageError("retention set FILE: name a TOML file of [[retention]] tables")
            from storaged.retention import PolicyError, parse_policy_toml

            try:
                with open(args.file) as f:
                    text = f.read()
                rules = parse_policy_toml(text, source=args.file).to_doc()
            except OSError as exc:
                raise CommandError(f"cannot read {args.file}: {exc.strerror or exc}") from None
            except PolicyError as exc:
                raise CommandError(str(exc)) from None
        elif args.file:
            raise UsageError("retention show takes no FILE")

        async def main() -> dict[str, Any]:
            from storaged.client.policies import retention_policy, set_retention_policy

            async with client_of(args) as client:
                if rules is None:
                    return await retention_policy(client)
                return await set_retention_policy(client, rules, admin_token=args.admin_token)

        doc = run_async(main)
        if args.json:
            print_json(doc)
            return
        if args.action == "set":
            print(f"retention policy stored in {doc['source']}: {len(doc['rules'])} rule(s)")
            return
        print(f"# retention policy from {doc['source']}")
        if doc.get("error"):
            print(f"# not applied: {doc['error']}")
        print(_policy_toml(list(doc["rules"])), end="")

    return run_command(args, body)


# --------------------------------------------------------------------------- rm


def cmd_rm(args: argparse.Namespace) -> int:
    def body() -> None:
        if not args.names and args.prefix is None:
            raise UsageError("name the checkpoints to delete, or give --prefix")
        if args.prefix is not None and not args.prefix:
            raise UsageError("--prefix must not be empty (it would delete every checkpoint)")
        for name in args.names:
            check_name(name)

        async def main() -> tuple[list[str], list[str]]:
            deleted: list[str] = []
            missing: list[str] = []
            async with client_of(args) as client:
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
            print_json({"deleted": deleted, "missing": missing})
        if missing:
            raise CommandError(
                f"no checkpoint named {', '.join(missing)}"
                + (f" ({len(deleted)} others deleted)" if deleted else "")
            )

    return run_command(args, body)
