"""The client commands of ``storaged``: ``ls``, ``status``, ``rm``, ``save``, ``restore``, ``demo``.

Every command talks to the cluster named by ``--url`` (one node URL, or several
separated by commas; default ``$STORAGED_URL`` or ``http://127.0.0.1:7400``) with
the bearer token ``--token`` (default ``$STORAGED_TOKEN``).

Exit status, which scripts may rely on: 0 success; 1 the command failed (the
cluster is unreachable or refused the token, no such checkpoint, the name is
taken, the file cannot be read or written...); 2 the command line is wrong (bad
checkpoint name, unknown file extension, bad size); 130 interrupted. Expected
failures print one ``storaged <command>: error: ...`` line on stderr, no traceback.

``save FILE NAME`` and ``restore NAME FILE`` understand ``.npz`` (numpy),
``.safetensors`` (needs the ``safetensors`` package) and ``.pt``/``.pth`` (torch,
loaded with ``weights_only=True``); ``restore`` writes the format its file
extension names. Progress bars (on stderr, when it is a terminal, or with
``--progress``) count the bytes that completed, chunk by chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import sys
import time
import zipfile
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Final, TypeVar

import numpy as np

from storaged.client.checkpoint import (
    Shard,
    commit_checkpoint,
    restore_checkpoint,
    stage_shard,
    upload_shard,
)
from storaged.client.client import STATES, CheckpointStatus, Client, WaitTimeout
from storaged.client.errors import (
    CheckpointNotFound,
    ConnectionFailed,
    Exists,
    Forbidden,
    StoragedError,
    Unauthorized,
    Unavailable,
)
from storaged.client.layout import DEFAULT_CHUNK_SIZE, MSGPACK_DTYPE, LayoutError, Manifest
from storaged.config import ConfigError, parse_size
from storaged.ids import is_checkpoint_name

T = TypeVar("T")

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130

DEFAULT_URL: Final = "http://127.0.0.1:7400"

#: Element types numpy lacks, and the same-width integer type their bytes are held in.
STORAGE_DTYPES: Final[Mapping[str, type[np.generic]]] = {
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
}

#: safetensors dtype codes -> the dtype names manifests use.
_SAFETENSORS_DTYPES: Final[Mapping[str, str]] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}

FORMATS: Final[Mapping[str, str]] = {
    ".npz": "npz",
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
}


class CommandError(Exception):
    """An expected failure: its message is printed as is, ``status`` is the exit status."""

    def __init__(self, message: str, status: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.status = status


class UsageError(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client commands to the ``storaged`` command's subparsers."""
    conn = _connection_options()
    progress = _progress_options()

    p = sub.add_parser("ls", parents=[conn], help="list committed checkpoints")
    p.add_argument("prefix", nargs="?", default="", help="only names starting with this")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("status", parents=[conn], help="durability of a checkpoint")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("rm", parents=[conn], help="delete a checkpoint")
    p.add_argument("name")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser(
        "save",
        parents=[conn, progress],
        help="save a .npz, .safetensors or torch (.pt) file as a checkpoint",
    )
    p.add_argument("file")
    p.add_argument("name")
    p.add_argument(
        "--wait",
        choices=STATES,
        default="memory",
        help="return once the checkpoint reached this level (memory: acknowledged)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait may take")
    p.add_argument("--chunk-size", default=str(DEFAULT_CHUNK_SIZE), help="e.g. 8MiB")
    p.set_defaults(func=cmd_save)

    p = sub.add_parser(
        "restore",
        parents=[conn, progress],
        help="restore a checkpoint into a .npz, .safetensors or torch (.pt) file",
    )
    p.add_argument("name")
    p.add_argument("file")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    p.set_defaults(func=cmd_restore)

    from storaged.demo import add_demo_parser

    add_demo_parser(sub, [progress])


def urls_of(value: str) -> list[str]:
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise UsageError("--url names no node")
    return urls


def _check_name(name: str) -> None:
    if not is_checkpoint_name(name):
        raise UsageError(
            f"invalid checkpoint name {name!r}: up to four /-separated parts of letters, "
            "digits, '.', '_' and '-', each starting with a letter or digit"
        )


def _format_of(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        known = ", ".join(FORMATS)
        raise UsageError(f"{path}: unknown file type {path.suffix or '(none)'}; expected {known}")
    return fmt


# --------------------------------------------------------------------------- running


def _client(args: argparse.Namespace) -> Client:
    return Client(urls_of(args.url), token=args.token)


def explain(error: BaseException, url: str = "") -> str:
    """One line saying what went wrong, for errors a user can meet in normal use."""
    where = f" at {url}" if url else ""
    if isinstance(error, Unauthorized):
        return (
            f"the cluster{where} refused the token (HTTP 401): pass --token or set STORAGED_TOKEN"
        )
    if isinstance(error, Forbidden):
        return f"the cluster{where} refused the request (HTTP 403): {error.message}"
    if isinstance(error, ConnectionFailed):
        return (
            f"cannot reach the cluster{where}: {error.message} "
            "(is it running? --url or STORAGED_URL name it)"
        )
    if isinstance(error, Unavailable):
        return f"the cluster{where} cannot serve now: {error}"
    return str(error)


def run_command(args: argparse.Namespace, body: Callable[[], None]) -> int:
    """Run ``body`` and turn expected failures into a message and an exit status."""
    command = getattr(args, "command", None) or "storaged"
    try:
        body()
    except CommandError as exc:
        print(f"storaged {command}: error: {exc}", file=sys.stderr)
        return exc.status
    except LayoutError as exc:  # a checkpoint this client cannot lay out
        print(f"storaged {command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except (StoragedError, WaitTimeout) as exc:
        url = getattr(args, "url", None) or ""
        print(f"storaged {command}: error: {explain(exc, url)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"storaged {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def run_async(main: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run`` with uvloop when it is there."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency; still usable without it
        return asyncio.run(_as_coroutine(main))
    return uvloop.run(_as_coroutine(main))


async def _as_coroutine(main: Callable[[], Awaitable[T]]) -> T:
    return await main()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class ByteProgress:
    """A progress bar of bytes, fed from a counter (e.g. ``ClientStats``) while a transfer runs.

    The counter is read every ``interval`` seconds, so the bar moves as chunks
    complete. ``enabled=None`` shows it only when stderr is a terminal. On a clean
    exit the bar is completed (dedup or coalescing may make the counter end short).
    """

    def __init__(
        self,
        counter: Callable[[], int],
        total: int,
        desc: str,
        *,
        enabled: bool | None = None,
        interval: float = 0.1,
        file: IO[str] | None = None,
    ) -> None:
        self._counter = counter
        self._total = total
        self._desc = desc
        self._enabled = enabled
        self._interval = interval
        self._file = file or sys.stderr
        self._base = 0
        self._bar: Any = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ByteProgress:
        from tqdm import tqdm

        self._base = self._counter()
        self._bar = tqdm(
            total=self._total,
            desc=self._desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=self._file,
            disable=None if self._enabled is None else not self._enabled,
            dynamic_ncols=True,
            mininterval=self._interval,
        )
        self._task = asyncio.get_running_loop().create_task(self._follow())
        return self

    def _update(self) -> None:
        done = min(self._total, max(0, self._counter() - self._base))
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)

    async def _follow(self) -> None:
        while True:
            self._update()
            await asyncio.sleep(self._interval)

    async def __aexit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._update()
        if exc_type is None and self._bar.n < self._total:
            self._bar.update(self._total - self._bar.n)
        self._bar.close()


@dataclass
class Durability:
    """What ``watch_durability`` saw: the last status and when each level was first reached."""

    status: CheckpointStatus
    #: level -> seconds since watching began
    reached: dict[str, float] = field(default_factory=dict)


async def watch_durability(
    client: Client,
    name: str,
    level: str,
    timeout: float,
    emit: Callable[[str], None],
    *,
    interval: float = 0.25,
    quiet_for: float = 1.0,
    began: float | None = None,
) -> Durability:
    """Poll ``status`` until ``name`` reaches ``level``, emitting a line when the counts change.

    Lines come at most every ``quiet_for`` seconds, except when a level is completed.
    ``WaitTimeout`` after ``timeout`` seconds. Times are counted from ``began``
    (a ``time.perf_counter()`` value; default now).
    """
    start = time.perf_counter() if began is None else began
    deadline = time.perf_counter() + timeout
    seen: tuple[int, int, int, str] | None = None
    last_line = 0.0
    result: Durability | None = None
    while True:
        status = await client.status(name)
        now = time.perf_counter()
        if result is None:
            result = Durability(status)
        result.status = status
        completed = False
        for state in STATES:
            if status.reached(state) and state not in result.reached:
                result.reached[state] = now - start
                completed = True
        counts = (status.memory, status.nvme, status.cold, status.state)
        if counts != seen and (completed or now - last_line >= quiet_for or seen is None):
            emit(
                f"  {now - start:7.1f} s  {status.state:<6}  memory {status.memory}/{status.chunks}"
                f"  nvme {status.nvme}/{status.chunks}  cold {status.cold}/{status.chunks}"
            )
            seen, last_line = counts, now
        if status.reached(level):
            return result
        if now >= deadline:
            raise WaitTimeout(
                f"checkpoint {name} is {status.state} after {timeout:.0f} s, waiting for {level} "
                f"(it is committed; `storaged status {name}` follows it)",
                status,
            )
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------- ls / status / rm


def cmd_ls(args: argparse.Namespace) -> int:
    def body() -> None:
        async def main() -> None:
            async with _client(args) as client:
                listed = await client.list(args.prefix)
            if args.json:
                doc = {
                    "checkpoints": [
                        {"name": c.name, "created": c.created, "bytes": c.bytes, "state": c.state}
                        for c in listed
                    ]
                }
                print(json.dumps(doc, indent=2))
                return
            if not listed:
                return
            width = max(len("NAME"), *(len(c.name) for c in listed))
            print(f"{'NAME':<{width}}  {'STATE':<6}  {'SIZE':>11}  CREATED")
            for c in listed:
                created = datetime.datetime.fromtimestamp(c.created).strftime("%Y-%m-%d %H:%M:%S")
                print(f"{c.name:<{width}}  {c.state:<6}  {human_bytes(c.bytes):>11}  {created}")

        run_async(main)

    return run_command(args, body)


def cmd_status(args: argparse.Namespace) -> int:
    def body() -> None:
        _check_name(args.name)

        async def main() -> None:
            async with _client(args) as client:
                try:
                    status = await client.status(args.name)
                except CheckpointNotFound:
                    raise CommandError(f"no checkpoint named {args.name}") from None
            doc = {
                "name": args.name,
                "state": status.state,
                "chunks": status.chunks,
                "memory": status.memory,
                "nvme": status.nvme,
                "cold": status.cold,
            }
            if args.json:
                print(json.dumps(doc, indent=2))
                return
            for key, value in doc.items():
                print(f"{key:<7} {value}")

        run_async(main)

    return run_command(args, body)


def cmd_rm(args: argparse.Namespace) -> int:
    def body() -> None:
        _check_name(args.name)

        async def main() -> None:
            async with _client(args) as client:
                try:
                    await client.delete(args.name)
                except CheckpointNotFound:
                    raise CommandError(f"no checkpoint named {args.name}") from None
            print(f"deleted {args.name}")

        run_async(main)

    return run_command(args, body)


# --------------------------------------------------------------------------- files


@dataclass
class LoadedFile:
    """A file read into a state dict (``Shard`` for dtypes numpy lacks) and manifest meta."""

    state: dict[str, Any]
    meta: dict[str, Any]


def _import_safetensors() -> ModuleType:
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise CommandError(
            ".safetensors files need the safetensors package: pip install safetensors"
        ) from None
    return safetensors


def _import_torch(why: str) -> ModuleType:
    try:
        import torch
    except ImportError:
        raise CommandError(f"{why}: that needs PyTorch (pip install torch)") from None
    return torch


def _whole(array: np.ndarray[Any, Any], dtype: str | None) -> Any:
    """A state-dict value for a whole array, naming its dtype when numpy's name is wrong."""
    if dtype is None:
        return array
    return Shard(array, tuple(array.shape), (0,) * array.ndim, dtype)


def _torch_dtypes(torch: Any) -> dict[Any, tuple[str, Any, type[np.generic]]]:
    """torch dtypes numpy lacks -> (manifest name, same-width torch int, numpy storage)."""
    return {
        torch.bfloat16: ("bfloat16", torch.int16, np.int16),
        torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8, np.uint8),
        torch.float8_e5m2: ("float8_e5m2", torch.uint8, np.uint8),
    }


def _from_torch(torch: Any, tensor: Any, key: str) -> Any:
    """A CPU tensor as a state-dict value (its memory is shared, not copied)."""
    tensor = tensor.detach().cpu().resolve_conj().resolve_neg()
    special = _torch_dtypes(torch).get(tensor.dtype)
    if special is not None:
        name, as_int, _ = special
        stored = STORAGE_DTYPES[name]
        return _whole(tensor.contiguous().view(as_int).numpy().view(stored), name)
    try:
        array: np.ndarray[Any, Any] = tensor.numpy()
    except (TypeError, RuntimeError) as exc:
        raise CommandError(f"{key}: cannot save a tensor of {tensor.dtype}: {exc}") from None
    return array


def _to_torch(torch: Any, array: np.ndarray[Any, Any], dtype: str) -> Any:
    for torch_dtype, (name, _, as_int) in _torch_dtypes(torch).items():
        if name == dtype:
            return torch.from_numpy(array.view(as_int)).view(torch_dtype)
    return torch.from_numpy(array)


def load_npz(path: Path) -> LoadedFile:
    state: dict[str, Any] = {}
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):  # e.g. a .npy file renamed
            raise CommandError(f"{path}: not an .npz archive")
        with archive:
            for key in archive.files:
                state[key] = archive[key]
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise CommandError(f"{path}: not a readable .npz archive: {_first_line(exc)}") from None
    return LoadedFile(state, {})


def load_safetensors(path: Path) -> LoadedFile:
    st = _import_safetensors()
    state: dict[str, Any] = {}
    special: list[str] = []
    try:
        with st.safe_open(str(path), framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            for key in f.keys():  # noqa: SIM118
                code = f.get_slice(key).get_dtype()
                name = _SAFETENSORS_DTYPES.get(code)
                if name is None:
                    raise CommandError(f"{path}: {key} is of dtype {code}, which cannot be saved")
                state[key] = None  # keeps the file's order
                if name in STORAGE_DTYPES:
                    special.append(key)
                else:
                    state[key] = f.get_tensor(key)
        if special:
            torch = _import_torch(f"{path}: {special[0]} is of a dtype numpy lacks")
            with st.safe_open(str(path), framework="pt") as f:
                for key in special:
                    state[key] = _from_torch(torch, f.get_tensor(key), key)
    except st.SafetensorError as exc:
        raise CommandError(
            f"{path}: not a readable .safetensors file: {_first_line(exc)}"
        ) from None
    return LoadedFile(state, {"safetensors_metadata": metadata} if metadata else {})


def _flatten(
    value: Any, path: tuple[str | int, ...], out: dict[str, Any], keys: dict[str, list[Any]]
) -> None:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise CommandError(f"key {key!r} under {list(path)}: only str and int keys")
            _flatten(item, (*path, key), out, keys)
        return
    flat = ".".join(str(p) for p in path)
    if flat in out:
        raise CommandError(f"two entries flatten to the same key {flat!r}")
    out[flat] = value
    keys[flat] = list(path)


def load_torch(path: Path) -> LoadedFile:
    torch = _import_torch(f"{path} is a torch file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # torch.load raises many unrelated types on a bad file
        raise CommandError(f"{path}: not a readable torch file: {_first_line(exc)}") from None
    if not isinstance(obj, Mapping) or not obj:
        raise CommandError(f"{path}: expected a (state) dict, found {type(obj).__name__}")
    flat: dict[str, Any] = {}
    keys: dict[str, list[Any]] = {}
    _flatten(obj, (), flat, keys)
    state: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            state[key] = _from_torch(torch, value, key)
        elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            raise CommandError(f"{path}: {key} is a list holding tensors; only dicts nest tensors")
        else:
            state[key] = value  # a number, string, list...: saved as a msgpack value
    return LoadedFile(state, {"torch_keys": keys})


def load_file(path: Path) -> LoadedFile:
    """Read ``path`` by its extension; ``CommandError`` when it cannot be read."""
    fmt = _format_of(path)
    try:
        loaded = {"npz": load_npz, "safetensors": load_safetensors, "torch": load_torch}[fmt](path)
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None
    loaded.meta["source"] = {"format": fmt, "file": path.name}
    return loaded


@contextlib.contextmanager
def _replacing(path: Path, force: bool) -> Iterator[Path]:
    """A temporary path next to ``path``, renamed over it when the block succeeds."""
    if path.exists() and not force:
        raise CommandError(f"{path} exists (--force overwrites it)")
    if path.is_dir():
        raise CommandError(f"{path} is a directory")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        try:
            tmp.touch()  # fail before any download when the file cannot be written
        except OSError as exc:
            raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _value_array(key: str, value: Any) -> np.ndarray[Any, Any]:
    array = np.asarray(value)
    if array.dtype.kind not in "biufcUS":
        raise CommandError(f"{key} is a {type(value).__name__}, which an .npz cannot hold")
    return array


def write_npz(path: Path, values: Mapping[str, Any], dtypes: Mapping[str, str]) -> None:
    # Written member by member (what np.savez does) so that any key works, even "file".
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, value in values.items():
            array = value if dtypes[key] != MSGPACK_DTYPE else _value_array(key, value)
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def write_safetensors(
    path: Path, values: Mapping[str, Any], dtypes: Mapping[str, str], meta: Mapping[str, Any]
) -> None:
    st = _import_safetensors()
    raw = meta.get("safetensors_metadata")
    metadata = (
        {str(k): str(v) for k, v in raw.items()} if isinstance(raw, Mapping) and raw else None
    )
    special = [key for key in values if dtypes[key] in STORAGE_DTYPES]
    if not special:
        st.numpy.save_file(dict(values), str(path), metadata=metadata)
        return
    torch = _import_torch(f"{special[0]} is {dtypes[special[0]]}")
    import safetensors.torch

    tensors = {key: _to_torch(torch, value, dtypes[key]) for key, value in values.items()}
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def write_torch(
    path: Path, values: Mapping[str, Any], dtypes: Mapping[str, str], meta: Mapping[str, Any]
) -> None:
    torch = _import_torch(f"{path} is a torch file")
    leaves = {
        key: value if dtypes[key] == MSGPACK_DTYPE else _to_torch(torch, value, dtypes[key])
        for key, value in values.items()
    }
    paths = meta.get("torch_keys")
    if not isinstance(paths, Mapping) or set(paths) != set(leaves):
        obj: dict[Any, Any] = leaves  # not saved from a torch file: a flat dict
    else:
        obj = {}
        for key, value in leaves.items():
            node = obj
            *parents, last = paths[key]
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
    torch.save(obj, path)


def _writable_check(fmt: str, manifest: Manifest) -> None:
    """Refuse, before any download, what the format cannot hold."""
    values = [
        k
        for k in manifest.keys()  # noqa: SIM118
        if manifest.items_of(k)[0][1].dtype == MSGPACK_DTYPE
    ]
    if fmt == "safetensors" and values:
        shown = ", ".join(values[:5]) + (" ..." if len(values) > 5 else "")
        raise CommandError(
            f"the checkpoint holds non-tensor values ({shown}) which .safetensors cannot hold; "
            "restore into .pt instead"
        )
    if fmt == "safetensors":
        _import_safetensors()
    if fmt == "torch":
        _import_torch("writing a torch file")


# --------------------------------------------------------------------------- save / restore


def cmd_save(args: argparse.Namespace) -> int:
    def body() -> None:
        _check_name(args.name)
        path = Path(args.file)
        _format_of(path)
        try:
            chunk_size = parse_size(args.chunk_size)
        except ConfigError as exc:
            raise UsageError(f"--chunk-size: {exc}") from None
        if chunk_size <= 0:
            raise UsageError("--chunk-size must be positive")
        try:
            path.open("rb").close()  # the usual mistake, reported before contacting anyone
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None
        run_async(lambda: _save(args, path, chunk_size))

    return run_command(args, body)


async def _save(args: argparse.Namespace, path: Path, chunk_size: int) -> None:
    name: str = args.name
    async with _client(args) as client:
        # Token, reachability and name first: a large file is read only when it can be saved.
        try:
            await client.status(name)
        except CheckpointNotFound:
            pass
        else:
            raise CommandError(_exists(name))
        loaded = await asyncio.to_thread(load_file, path)
        began = time.perf_counter()
        try:
            # No staging buffer: large arrays are uploaded from the loaded file's memory.
            staged = await asyncio.to_thread(
                stage_shard, 0, loaded.state, min(chunk_size, client.max_chunk_size), None
            )
        except (TypeError, ValueError) as exc:
            raise CommandError(f"{args.file}: {exc}") from None
        stats = client.stats
        async with ByteProgress(
            lambda: stats.bytes_uploaded + stats.bytes_skipped,
            staged.nbytes,
            "upload",
            enabled=args.progress,
        ):
            entry = await upload_shard(client, staged)
        try:
            result = await commit_checkpoint(client, name, [entry], meta=loaded.meta)
        except Exists:
            raise CommandError(_exists(name)) from None
        took = time.perf_counter() - began
        print(
            f"saved {name}: {len(staged.items)} items, {human_bytes(result.bytes)} in "
            f"{result.chunks} chunks ({stats.chunks_uploaded} uploaded, "
            f"{stats.chunks_skipped} already held) in {took:.1f} s "
            f"({staged.nbytes / max(took, 1e-9) / 1e9:.2f} GB/s)",
            flush=True,
        )
        if args.wait != "memory":
            seen = await watch_durability(
                client, name, args.wait, args.timeout, lambda line: print(line, file=sys.stderr)
            )
            print(
                f"{name} is {seen.status.state}: {args.wait} reached "
                f"{seen.reached[args.wait]:.1f} s after the commit"
            )


def _exists(name: str) -> str:
    return (
        f"a checkpoint named {name} already exists; checkpoints are immutable "
        f"(storaged rm {name} first, or choose another name)"
    )


def cmd_restore(args: argparse.Namespace) -> int:
    def body() -> None:
        _check_name(args.name)
        path = Path(args.file)
        fmt = _format_of(path)
        with _replacing(path, args.force) as tmp:
            values, dtypes, meta = run_async(lambda: _restore(args, fmt))
            began = time.perf_counter()
            try:
                if fmt == "npz":
                    write_npz(tmp, values, dtypes)
                elif fmt == "safetensors":
                    write_safetensors(tmp, values, dtypes, meta)
                else:
                    write_torch(tmp, values, dtypes, meta)
            except OSError as exc:
                raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None
            special = sorted({dtypes[k] for k in values if dtypes[k] in STORAGE_DTYPES})
            if fmt == "npz" and special:
                print(
                    f"storaged restore: note: {', '.join(special)} items are written as their "
                    "same-width unsigned integers (.npz has no such dtype)",
                    file=sys.stderr,
                )
        size = sum(v.nbytes for v in values.values() if isinstance(v, np.ndarray))
        print(
            f"restored {args.name} into {path}: {len(values)} items, {human_bytes(size)} "
            f"(written in {time.perf_counter() - began:.1f} s)"
        )

    return run_command(args, body)


async def _restore(
    args: argparse.Namespace, fmt: str
) -> tuple[dict[str, Any], dict[str, str], Mapping[str, Any]]:
    name: str = args.name
    async with _client(args) as client:
        try:
            doc = await client.get_manifest(name)
            holders = await client.plan(name)
        except CheckpointNotFound:
            raise CommandError(f"no checkpoint named {name}") from None
        try:
            manifest = Manifest.from_wire(doc)
        except LayoutError as exc:
            raise CommandError(f"checkpoint {name}: unreadable manifest: {exc}") from None
        _writable_check(fmt, manifest)
        dtypes = {key: manifest.items_of(key)[0][1].dtype for key in manifest.keys()}  # noqa: SIM118
        total = sum(item.length for shard in manifest.shards for item in shard.items)
        stats = client.stats
        began = time.perf_counter()
        async with ByteProgress(
            lambda: stats.bytes_downloaded, total, "restore", enabled=args.progress
        ):
            values = await restore_checkpoint(
                client, manifest, None, dtype_map=STORAGE_DTYPES, holders=holders
            )
        took = time.perf_counter() - began
        print(
            f"fetched {human_bytes(total)} in {took:.1f} s "
            f"({total / max(took, 1e-9) / 1e9:.2f} GB/s)",
            file=sys.stderr,
        )
    return values, dtypes, manifest.meta
