"""What every client command of ``storaged`` runs on (the CLI's commands and ``storaged
demo`` alike): exit statuses, expected failures (``CommandError``, ``UsageError``) turned
into one line and a status by ``run_command``, ``run_async``, ``--url`` lists
(``urls_of``), checkpoint names (``check_name``), the client of a command's options
(``client_of``), byte sizes for people (``human_bytes``), progress bars (``ByteProgress``)
and following a checkpoint's durability (``watch_durability``).

Exit statuses a script may rely on: 0 success; 1 the command failed; 2 the command line is
wrong; 3 ``nodes``: a node is down or does not answer; 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any, Final, TypeVar

from storaged.client.client import BlockedWatch, CheckpointStatus, Client, WaitTimeout, base_url
from storaged.client.deadlines import Deadlines
from storaged.client.errors import (
    ConnectionFailed,
    Forbidden,
    StoragedError,
    StorageFull,
    Unauthorized,
    Unavailable,
)
from storaged.client.format_names import FormatError, UnknownFormat, clean_message
from storaged.ids import is_checkpoint_name
from storaged.wire import STATES

T = TypeVar("T")

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_NODE_DOWN: Final = 3
EXIT_INTERRUPTED: Final = 130


class CommandError(Exception):
    """An expected failure: its message is printed as is, ``status`` is the exit status."""

    def __init__(self, message: str, status: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.status = status


class UsageError(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


def check_name(name: str) -> None:
    """``UsageError`` unless ``name`` is a checkpoint name (API.md's form)."""
    if not is_checkpoint_name(name):
        raise UsageError(
            f"invalid checkpoint name {name!r}: up to four /-separated parts of letters, "
            "digits, '.', '_' and '-', each starting with a letter or digit"
        )


def client_of(args: argparse.Namespace) -> Client:
    """The client of a command's ``--url`` and ``--token``."""
    # A command fails at once where nothing listens (a typo, a stopped cluster), instead
    # of backing off as a job's client does across a node's restart.
    try:
        deadlines = Deadlines.from_env()
    except ValueError as exc:  # names the variable
        raise UsageError(str(exc)) from None
    return Client(urls_of(args.url), token=args.token, refused_fails_fast=True, deadlines=deadlines)


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def urls_of(value: str) -> list[str]:
    try:
        urls = [base_url(u) for u in value.split(",") if u.strip()]
    except ValueError as exc:
        raise UsageError(f"--url: {exc}") from None
    if not urls:
        raise UsageError("--url names no node")
    return urls


def explain(error: BaseException, url: str = "") -> str:
    """One line saying what went wrong, for errors a user can meet in normal use."""
    where = f" at {url}" if url else ""
    if isinstance(error, Unauthorized):
        return (
            f"the cluster{where} refused the token (HTTP 401): pass --token or set STORAGED_TOKEN"
        )
    if isinstance(error, Forbidden):
        hint = (
            "; pass --admin-token or set STORAGED_ADMIN_TOKEN (`storaged up` prints it)"
            if "admin token" in error.message
            else ""
        )
        return f"the cluster{where} refused the request (HTTP 403): {error.message}{hint}"
    if isinstance(error, StoragedError) and error.foreign:
        return f"not a storaged node{where}: {error.foreign} (--url or STORAGED_URL name one)"
    if isinstance(error, ConnectionFailed):
        return (
            f"cannot reach the cluster{where}: {error.message} "
            "(is it running? --url or STORAGED_URL name it)"
        )
    if isinstance(error, Unavailable):
        return f"the cluster{where} cannot serve now: {error}"
    return str(error)


def _is_layout_error(exc: BaseException) -> bool:
    """``exc`` is a ``storaged.client.layout.LayoutError``. Looked up, not imported: only a
    command that loaded the layout can have raised one, and ``ls`` starts without it."""
    layout = sys.modules.get("storaged.client.layout")
    return layout is not None and isinstance(exc, layout.LayoutError)


def run_command(args: argparse.Namespace, body: Callable[[], None]) -> int:
    """Run ``body`` and turn expected failures into a message and an exit status."""
    command = getattr(args, "command", None) or "storaged"

    def fail(message: str, status: int = EXIT_FAILURE) -> int:
        # One line, whatever a library put in its message (newlines, colour codes).
        print(f"storaged {command}: error: {clean_message(message)}", file=sys.stderr)
        return status

    try:
        body()
    except CommandError as exc:
        return fail(str(exc), exc.status)
    except UnknownFormat as exc:
        return fail(str(exc), EXIT_USAGE)
    except (StoragedError, WaitTimeout) as exc:
        return fail(explain(exc, getattr(args, "url", None) or ""))
    except ValueError as exc:  # a checkpoint or file this client cannot lay out
        if not (isinstance(exc, FormatError) or _is_layout_error(exc)):
            raise
        return fail(str(exc))
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
    ``total=None``: the size is not known (stdin); ``position`` stacks several bars.
    """

    def __init__(
        self,
        counter: Callable[[], int],
        total: int | None,
        desc: str,
        *,
        enabled: bool | None = None,
        interval: float = 0.1,
        file: IO[str] | None = None,
        position: int | None = None,
    ) -> None:
        self._counter = counter
        self._total = total
        self._desc = desc
        self._enabled = enabled
        self._interval = interval
        self._file = file or sys.stderr
        self._position = position
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
            position=self._position,
            leave=True,
        )
        self._task = asyncio.get_running_loop().create_task(self._follow())
        return self

    def _update(self) -> None:
        done = max(0, self._counter() - self._base)
        if self._total is not None:
            done = min(self._total, done)
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
        if exc_type is None and self._total is not None and self._bar.n < self._total:
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
    ``WaitTimeout`` after ``timeout`` seconds; ``NvmeFull``/``ColdFull`` within a second or
    two once a node's full disk tier keeps it from ``level``. Times are counted from ``began``
    (a ``time.perf_counter()`` value; default now).
    """
    start = time.perf_counter() if began is None else began
    deadline = time.perf_counter() + timeout
    seen: tuple[int, int, int, str] | None = None
    last_line = 0.0
    result: Durability | None = None
    stuck = BlockedWatch(name, level)
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
        try:
            stuck.check(status)
        except StorageFull as exc:
            exc.message += f" (it is committed; `storaged status {name}` follows it)"
            raise
        if now >= deadline:
            raise WaitTimeout(
                f"checkpoint {name} is {status.state} after {timeout:.0f} s, waiting for {level} "
                f"(it is committed; `storaged status {name}` follows it)",
                status,
            )
        await asyncio.sleep(interval)
