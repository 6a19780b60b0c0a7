"""``WorkerPool``: real separate processes (spawn), each running one ``Job`` at a time.

All jobs of a run are prepared first (allocation, imports, connections), then released at
once; each reports its own start and end on ``time.monotonic`` (CLOCK_MONOTONIC, the same
clock in every process of the machine) and its CPU seconds (all its threads). Workers
ignore SIGINT: the parent decides when they stop, and stops them in ``close`` on errors and
on Ctrl-C alike.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol


class Prepared(Protocol):
    """A job ready to go: ``run`` is timed, ``check`` and ``close`` are not."""

    def run(self) -> dict[str, Any]: ...

    def check(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class Job(Protocol):
    """Picklable description of one process' share of a run (its class importable by path)."""

    def prepare(self) -> Prepared: ...


class WorkerError(RuntimeError):
    """A worker failed or went away; the message holds its traceback when it sent one."""


def _worker_main(conn: Connection) -> None:
    # The parent stops us (Ctrl-C reaches the whole process group; one decision is enough).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message == "stop":
            return
        try:
            reply = _work(conn, message)
        except (EOFError, OSError):
            return
        except BaseException:
            reply = ("error", traceback.format_exc())
        if reply is None:
            return
        # Nothing of the job is referenced any more: its buffers are freed before the next.
        try:
            conn.send(reply)
        except OSError:
            return


def _work(conn: Connection, job: Job) -> tuple[str, Any] | None:
    """Prepare, wait for "go", run, check, close; the reply (None: told to stop)."""
    prepared = job.prepare()
    try:
        conn.send(("ready", None))
        if conn.recv() != "go":
            return None
        times0, t0 = os.times(), time.monotonic()
        result = prepared.run()
        t1, times1 = time.monotonic(), os.times()
        # All threads of this process; system time shows page faults and reclaim.
        user, system = times1.user - times0.user, times1.system - times0.system
        result.update(t0=t0, t1=t1, cpu=user + system, cpu_sys=system)
        result.update(prepared.check())
        return ("done", result)
    finally:
        prepared.close()


class WorkerPool:
    """``size`` worker processes kept for a whole benchmark (imports and pools paid once)."""

    def __init__(self, size: int, ready_timeout: float = 600.0, run_timeout: float = 900.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready_timeout = ready_timeout
        self.run_timeout = run_timeout
        self._workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
        try:
            for i in range(size):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, args=(theirs,), daemon=True, name=f"loadtest-w{i}"
                )
                proc.start()
                theirs.close()
                self._workers.append((proc, mine))
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid or 0 for proc, _ in self._workers]

    def _gather(self, count: int, deadline: float, stage: str) -> list[Any]:
        """One message from each of the first ``count`` workers, in worker order.

        Fails as soon as any of them sends an error or dies, not when its turn comes.
        """
        pending = {conn: i for i, (_, conn) in enumerate(self._workers[:count])}
        out: list[Any] = [None] * count
        while pending:
            for conn in wait(list(pending), timeout=0.2):
                assert isinstance(conn, Connection)
                index = pending.pop(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError) as exc:
                    proc = self._workers[index][0]
                    proc.join(2)  # its pipe closes as it exits: say how it ended
                    raise WorkerError(
                        f"worker {index} exited with {proc.exitcode} while {stage}"
                    ) from exc
                if kind == "error":
                    raise WorkerError(f"worker {index} failed while {stage}:\n{payload}")
                out[index] = payload
            for conn, index in pending.items():
                proc = self._workers[index][0]
                if not proc.is_alive() and not conn.poll():
                    raise WorkerError(f"worker {index} exited with {proc.exitcode} while {stage}")
            if pending and time.monotonic() > deadline:
                raise WorkerError(f"{len(pending)} worker(s) not done {stage} in time")
        return out

    def run(self, jobs: Sequence[Job], before_go: Callable[[], None] | None = None) -> list[Any]:
        """Prepare every job (one per worker), start them together, return their results.

        ``before_go`` runs once all are ready, right before the start (e.g. to read the
        nodes' CPU counters). A failure anywhere stops every worker of this pool.
        """
        if len(jobs) > len(self._workers):
            raise ValueError(f"{len(jobs)} jobs for {len(self._workers)} workers")
        try:
            for (_, conn), job in zip(self._workers, jobs, strict=False):
                conn.send(job)
            self._gather(len(jobs), time.monotonic() + self.ready_timeout, "preparing")
            if before_go is not None:
                before_go()
            for _, conn in self._workers[: len(jobs)]:
                conn.send("go")
            return self._gather(len(jobs), time.monotonic() + self.run_timeout, "running")
        except BaseException:
            self.close(graceful=False)
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop every worker: ask, then (or at once, without ``graceful``) terminate, kill."""
        for _, conn in self._workers:
            with contextlib.suppress(OSError):
                conn.send("stop")
        deadline = time.monotonic() + (5 if graceful else 0)
        for proc, conn in self._workers:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()
        self._workers = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wall_seconds(results: Sequence[Mapping[str, Any]]) -> float:
    """From the first worker's start to the last one's end."""
    return max(float(r["t1"]) for r in results) - min(float(r["t0"]) for r in results)
