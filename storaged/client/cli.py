"""The client commands of ``storaged``: ``ls``, ``status``, ``nodes``, ``rm``, ``save``,
``restore`` (``demo`` is the tools', ``storaged/cli.py``).

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
import functools
import importlib
import os
from collections.abc import Callable
from typing import Final

from storaged.client.format_names import FORMATS
from storaged.wire import STATES

#: the levels ``status --wait`` takes: the cluster's, and the archive's (E19)
WAIT_LEVELS: Final = (*STATES, "archived")

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


def progress_options() -> argparse.ArgumentParser:
    """``--progress``/``--no-progress``, for every command that shows bars."""
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


#: ``sub.add_parser`` with the options every command of a group takes (``parents``)
AddCommand = Callable[..., argparse.ArgumentParser]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client commands to the ``storaged`` command's subparsers."""
    conn = _connection_options()
    progress = progress_options()
    as_json = _json_option()

    _add_cluster_commands(functools.partial(sub.add_parser, parents=[conn, as_json]))
    _add_change_commands(functools.partial(sub.add_parser, parents=[conn, as_json]))
    _add_file_commands(functools.partial(sub.add_parser, parents=[conn, progress, as_json]))


def _admin_token_option(p: argparse.ArgumentParser, use: str = "") -> None:
    p.add_argument(
        "--admin-token",
        default=os.environ.get("STORAGED_ADMIN_TOKEN") or None,
        help=f"admin bearer token{use} (default $STORAGED_ADMIN_TOKEN)",
    )


def _add_cluster_commands(add: AddCommand) -> None:
    """ls, status, archive and nodes: what the cluster holds, and its nodes."""
    p = add(
        "ls",
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

    p = add(
        "status",
        help="durability of a checkpoint: levels reached, and where its copies are now",
    )
    p.add_argument("name")
    p.add_argument(
        "--wait",
        choices=WAIT_LEVELS,
        default=None,
        help="first wait until the checkpoint reached this level (archived: in the archive)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait may take")
    p.set_defaults(func=cmd_status)

    p = add(
        "archive",
        help="copy a committed checkpoint to the cluster's archive (its chunks, then its "
        "manifest); a fresh cluster pointed at the archive lists and restores it",
    )
    p.add_argument("name")
    p.add_argument("--wait", action="store_true", help="return once it is archived")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait may take")
    p.set_defaults(func=cmd_archive)

    p = add(
        "nodes",
        aliases=["cluster"],
        help="the cluster's nodes: alive or down, space and chunks per tier, backlogs "
        "(exit status 3 when a node is down)",
    )
    p.set_defaults(func=cmd_nodes)


def _add_change_commands(add: AddCommand) -> None:
    """drain, rm and retention: what changes what the cluster holds."""
    p = add(
        "drain",
        help="mark a node draining (no new placements; what it holds is copied elsewhere) "
        "and say when it can leave with nothing under-replicated",
    )
    p.add_argument("node", metavar="NODE", help="the node's id (as storaged nodes shows it)")
    p.add_argument("--wait", action="store_true", help="poll until the node can leave")
    p.add_argument("--cancel", action="store_true", help="mark the node active again")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait may take")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    _admin_token_option(p)
    p.set_defaults(func=cmd_drain)

    p = add("rm", help="delete checkpoints")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--prefix", help="delete every checkpoint whose name starts with this")
    p.set_defaults(func=cmd_rm)

    p = add(
        "retention",
        help="show the retention policy in force, or store one (etcd coordination)",
    )
    p.add_argument("action", choices=("show", "set"))
    p.add_argument(
        "file", nargs="?", metavar="FILE", help="for set: a TOML file of [[retention]] tables"
    )
    _admin_token_option(p, ", for set")
    p.set_defaults(func=cmd_retention)


def _add_file_commands(add: AddCommand) -> None:
    """save and restore: a checkpoint from a file, and back."""
    kinds = "safetensors (file or directory of shards), npz, torch (.pt, pytorch_model.bin) or raw"
    p = add("save", help=f"save a {kinds} file as a checkpoint")
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
    p.add_argument(
        "--chunk-size", default=None, help="e.g. 4MiB (default 8MiB, or the cluster's maximum)"
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="chunks in flight (default 6; memory used is about window x chunk size)",
    )
    p.set_defaults(func=cmd_save)

    p = add(
        "restore",
        help=f"restore a checkpoint into a {kinds} file",
    )
    p.add_argument("name")
    p.add_argument("file", help="the file; - writes to stdout (safetensors, npz, raw)")
    p.add_argument("--format", choices=FORMATS, help="when the extension does not say it")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    p.set_defaults(func=cmd_restore)


# --------------------------------------------------------------------------- the commands

# Each command's module is imported when it runs, not when the command line is parsed:
# ``storaged --version`` imports no HTTP client, ``storaged ls`` no numpy, no formats and
# no checkpoint machinery (tests/client/test_cli_start.py holds that).


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``name`` of ``storaged.client.<module>``, imported when it runs."""

    def run(args: argparse.Namespace) -> int:
        command: Callable[[argparse.Namespace], int]
        command = getattr(importlib.import_module(f"storaged.client.{module}"), name)
        return command(args)

    run.__name__ = run.__qualname__ = name
    return run


cmd_ls = _lazy("cluster_commands", "cmd_ls")
cmd_status = _lazy("cluster_commands", "cmd_status")
cmd_archive = _lazy("cluster_commands", "cmd_archive")
cmd_nodes = _lazy("cluster_commands", "cmd_nodes")
cmd_drain = _lazy("cluster_commands", "cmd_drain")
cmd_rm = _lazy("cluster_commands", "cmd_rm")
cmd_retention = _lazy("cluster_commands", "cmd_retention")
cmd_save = _lazy("file_commands", "cmd_save")
cmd_restore = _lazy("file_commands", "cmd_restore")
