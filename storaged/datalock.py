"""One node per data directory: a node holds an exclusive ``flock`` on ``DIR/node.lock``.

Two nodes on one directory would rebuild, drain and collect the same chunks behind
each other's back. The kernel drops the lock when the holder dies (even by SIGKILL),
so a stale lock file never blocks a restart. The file holds the holder's pid, for
the message a second node or ``storaged up`` prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LOCK_NAME = "node.lock"


class DataDirLocked(Exception):
    """Another running process holds the data directory's lock."""

    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f" (pid {pid})" if pid is not None else ""
        super().__init__(f"data directory {path} is in use by a running node{holder}")
        self.path = path
        self.pid = pid


class DataDirLock:
    """The held lock of one data directory; ``release`` (or process exit) lets it go."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_data_dir(path: Path) -> DataDirLock:
    """Take ``path``'s lock (creating the directory), or raise ``DataDirLocked`` at once."""
    path.mkdir(parents=True, exist_ok=True)
    # O_CLOEXEC: a process this one starts must not inherit (and so prolong) the lock.
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLocked(path, _read_pid(path)) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return DataDirLock(path, fd)


def check_free(path: Path) -> None:
    """Raise ``DataDirLocked`` if a running process holds ``path``'s lock.

    Probing takes the lock for an instant: a node starting on ``path`` at that very
    moment may then refuse to start (and says why).
    """
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DataDirLocked(path, _read_pid(path)) from None
    finally:
        os.close(fd)


def _read_pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int((path / LOCK_NAME).read_text().strip())
    return None
