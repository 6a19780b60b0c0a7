"""``storaged save`` and ``storaged restore``: a file (or a directory of shards) to a
checkpoint and back, streamed a window at a time (``storaged.client.streaming``).

Apart from ``storaged.client.cli`` (the parser and the commands that only ask the
cluster), which imports this module only when one of these commands runs: they need
numpy and the formats' readers and writers, ``storaged ls`` does not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Final

import numpy as np

from storaged.client.checkpoint import commit_checkpoint, restore_checkpoint
from storaged.client.client import Client
from storaged.client.command import (
    ByteProgress,
    CommandError,
    UsageError,
    check_name,
    client_of,
    human_bytes,
    print_json,
    run_async,
    run_command,
    watch_durability,
)
from storaged.client.errors import CheckpointNotFound, Exists
from storaged.client.format_names import (
    RESTORE_TO_STDOUT,
    SAVE_FROM_STDIN,
    SUFFIXES,
    UnknownFormat,
    format_of,
)
from storaged.client.formats import (
    FILE_PREFIX,
    STORAGE_DTYPES,
    VALUES_METADATA_KEY,
    DirectoryWriter,
    ItemWriter,
    NpzWriter,
    OutputItem,
    StreamWriter,
    check_writable,
    decode_value,
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

__all__ = ["cmd_restore", "cmd_save"]


def _format_of(path: str, given: str | None) -> str:
    try:
        return format_of(path, given)
    except UnknownFormat as exc:
        raise UsageError(str(exc)) from None


# --------------------------------------------------------------------------- save


def _exists(name: str) -> str:
    return (
        f"a checkpoint named {name} already exists; checkpoints are immutable "
        f"(storaged rm {name} first, or choose another name)"
    )


def cmd_save(args: argparse.Namespace) -> int:
    def body() -> None:
        check_name(args.name)
        fmt = _format_of(args.file, args.format)
        if args.file == "-" and fmt not in SAVE_FROM_STDIN:
            raise UsageError(
                f"{fmt} cannot be read from stdin (its items are not in stream order); "
                "give a file, or --format raw"
            )
        try:
            chunk_size = (
                DEFAULT_CHUNK_SIZE if args.chunk_size is None else parse_size(args.chunk_size)
            )
        except ConfigError as exc:
            raise UsageError(f"--chunk-size: {exc}") from None
        if chunk_size <= 0:
            raise UsageError("--chunk-size must be positive")
        if args.window is None:
            args.window = DEFAULT_WINDOW
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


async def _save(args: argparse.Namespace, fmt: str, chunk_size: int) -> None:
    name: str = args.name
    async with client_of(args) as client:
        # Token, reachability and name first: a large file is read only when it can be saved.
        try:
            await client.status(name)
        except CheckpointNotFound:
            pass
        else:
            raise CommandError(_exists(name))
        chunk_size = min(chunk_size, client.max_chunk_size)
        counters = Counters()
        began = time.perf_counter()
        entry, meta, items = await _upload(args, client, fmt, chunk_size, counters)
        try:
            result = await commit_checkpoint(client, name, [entry], meta=meta)
        except Exists:
            raise CommandError(_exists(name)) from None
        took = time.perf_counter() - began
        wall = _since_start(args)
        stats = client.stats
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
                f"{stats.chunks_skipped} already held) in {_times(wall, took, counters.read)}",
                flush=True,
            )
        if args.wait != "memory":
            report.update(await _wait_durable(args, client, name))
        if args.json:
            print_json(report)


async def _upload(
    args: argparse.Namespace, client: Client, fmt: str, chunk_size: int, counters: Counters
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Upload ``args.file`` (``-``: stdin) as one rank's stream, with progress bars: its
    shard entry, the checkpoint's ``meta`` (where it came from) and its number of items."""
    stats = client.stats
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
            ByteProgress(lambda: counters.read, total, "read", enabled=args.progress, position=0),
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
    return entry, meta, items


async def _wait_durable(args: argparse.Namespace, client: Client, name: str) -> dict[str, Any]:
    """Wait until checkpoint ``name`` reaches ``args.wait`` (progress on stderr); the
    report's ``state`` and ``reached_after``."""
    seen = await watch_durability(
        client, name, args.wait, args.timeout, lambda line: print(line, file=sys.stderr)
    )
    if not args.json:
        print(
            f"{name} is {seen.status.state}: {args.wait} reached "
            f"{seen.reached[args.wait]:.1f} s after the commit"
        )
    return {
        "state": seen.status.state,
        "reached_after": {k: round(v, 3) for k, v in seen.reached.items()},
    }


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
        check_name(args.name)
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
    async with client_of(args) as client:
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
        began = time.perf_counter()
        await _write_restore(args, client, manifest, holders, fmt, items, need, tmp)
        took = time.perf_counter() - began
    wall = _since_start(args)
    _restore_notes(args, fmt, skipped, items)
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


async def _write_restore(
    args: argparse.Namespace,
    client: Client,
    manifest: Manifest,
    holders: Any,
    fmt: str,
    items: list[OutputItem],
    need: int,
    tmp: Path | None,
) -> None:
    """Fetch ``need`` bytes of the checkpoint and write ``items`` as ``fmt``: into ``tmp``
    (a directory of shards for ``DIRECTORY``), or to stdout when ``tmp`` is None; with
    progress bars."""
    whole = fmt == DIRECTORY
    stats = client.stats
    counters = Counters()
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
                layout = manifest.meta.get("safetensors_shards")
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


def _restore_notes(
    args: argparse.Namespace, fmt: str, skipped: list[str], items: list[OutputItem]
) -> None:
    """What a restore into a file left out or wrote differently, on stderr."""
    name = args.name
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
