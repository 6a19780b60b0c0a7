"""One connection to an etcd v3 cluster, the key layout, and etcd's errors as ours.

Client: ``etcd3aio`` (asyncio over grpc.aio, typed, maintained; round-robin over every
endpoint, so one dead member costs nothing). Every call here has a deadline: when etcd
cannot be reached the caller gets ``CoordinatorUnavailable`` within ``request_timeout``,
never a hang.

Keys, under the URL's path (default ``/storaged``)::

    <root>/membership/nodes/<id>     a member: id, url, peer, state (no lease)
    <root>/membership/alive/<id>     under the node's lease: present while it is alive
    <root>/ckpt/<name>               a checkpoint record or tombstone (small)
    <root>/manifest/<name>#<tag>     its manifest when stored inline
    <root>/refs/<name>#<tag>#<n>     its chunk ids, part n (32 bytes per id)
    <root>/retention                 the retention policy, JSON (coord/policy_store.py)

``<tag>`` is a 128-bit hash of the manifest's digest: parts of two racing commits of one
name never mix. ``#`` cannot occur in a checkpoint name, so ``<name>#`` ranges never
reach into ``<name>/child``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc
import grpc.aio
from etcd3aio import Etcd3Client, EtcdError
from etcd3aio._protobuf import Compare
from etcd3aio.kv import KVService, prefix_range_end
from etcd3aio.lease import LeaseService
from etcd3aio.watch import WatchService

from storaged.coord.catalogue import CoordinatorUnavailable
from storaged.coord.target import parse_etcd_url

T = TypeVar("T")

#: a reply larger than gRPC's default 4 MiB is normal here: a page of chunk-id parts
_MAX_REPLY = 64 * 2**20


class RevisionCompacted(CoordinatorUnavailable):
    """A read at a revision etcd has already compacted: read again at a newer one."""


class EtcdSession:
    """A lazily connected etcd client with deadlines and error mapping.

    Shared by a node's membership and catalogue; the membership closes it."""

    def __init__(self, url: str, *, request_timeout: float = 5.0) -> None:
        target = parse_etcd_url(url)
        self.url = url
        self.endpoints = target.endpoints
        self.root = target.root
        self.request_timeout = request_timeout
        self._client: Etcd3Client | None = None

    # ---- keys --------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    @staticmethod
    def range_end(prefix: str) -> bytes:
        return prefix_range_end(prefix)

    # ---- the client --------------------------------------------------------------------
    def _connected(self) -> Etcd3Client:
        if self._client is None:
            # Retries inside the client would stretch a dead cluster's answer past our
            # deadline; one attempt, and the caller (or its client) retries.
            client = Etcd3Client(list(self.endpoints), rpc_max_attempts=1)
            # No public option for this: grow the channel's receive limit before connect.
            client._manager.grpc_options.append(("grpc.max_receive_message_length", _MAX_REPLY))
            self._client = client
        return self._client

    async def _ready(self) -> Etcd3Client:
        client = self._connected()
        if client.kv is None:
            await client.connect()
        return client

    async def kv(self) -> KVService:
        client = await self._ready()
        assert client.kv is not None
        return client.kv

    async def lease(self) -> LeaseService:
        client = await self._ready()
        assert client.lease is not None
        return client.lease

    async def watch(self) -> WatchService:
        client = await self._ready()
        assert client.watch is not None
        return client.watch

    async def call(self, what: str, op: Awaitable[T]) -> T:
        """Run one etcd request within ``request_timeout``; etcd's failures become
        ``CoordinatorUnavailable`` (``RevisionCompacted`` for a compacted revision)."""
        try:
            async with asyncio.timeout(self.request_timeout):
                return await op
        except TimeoutError:
            raise CoordinatorUnavailable(
                f"etcd did not answer {what} within {self.request_timeout:.1f}s"
            ) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                raise RevisionCompacted(f"{what}: {exc.details()}") from exc
            raise CoordinatorUnavailable(f"etcd failed {what}: {exc.details()}") from exc
        except EtcdError as exc:
            raise CoordinatorUnavailable(f"etcd failed {what}: {exc}") from exc

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def compare_mod_revision(key: str | bytes, revision: int) -> Any:
    """A txn compare: ``key`` was last changed at ``revision`` (etcd3aio builds compares on
    value, version and create revision only)."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    return Compare(result=Compare.EQUAL, target=Compare.MOD, key=raw, mod_revision=revision)


def kv_response(response: Any, index: int = 0) -> list[Any]:
    """The key-values of the ``index``-th range answer in a txn response."""
    return list(response.responses[index].response_range.kvs)
