"""What the stages of a node are built from: small services, not the whole ``Node``.

A stage's constructor takes only these (and the sibling stages it hands work to, each
through the one method it calls), so that it can be built and tested alone and no module
of ``storaged.node`` names ``Node``:

- ``LocalStore``: what this node holds locally (its tiers, index, fragments, locks, state
  log, counters and background tasks); ``storaged.node.local.Local`` is the one there is.
- ``ClusterView``: the cluster as this node sees it (placement, members' addresses, who
  holds what and in which state) and the peer calls; ``storaged.node.cluster.Cluster``.
- ``DataPlane``: the node's chunks, as the etcd catalogue keeps large manifests in them.
- ``Rebalancing``: the rebalance as repair sees it (repair leads, rebalance follows; the
  other way round a stage goes by the shared ``pipeline.leadership.Leadership``).

Where a stage hands a chunk to one built after it (write -> drain -> encode), it takes
the ``offer`` as a callable, which the node binds once both exist.

The referenced set is ``storaged.node.referenced.ReferencedSet`` itself: it names nothing
of the node's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from erasure.base import Codec
    from storaged.config import Config, NodeSpec
    from storaged.coord.manifest_store import Catalog, CatalogRecord
    from storaged.coord.membership import Membership
    from storaged.metrics import NodeMetrics
    from storaged.node.index import ChunkLocks, Holding, IndexEntry, StateLog
    from storaged.node.space import DiskSpace
    from storaged.peer import PeerClient
    from storaged.placement import Placement
    from tiers import ByteRange
    from tiers.cold import ColdTier
    from tiers.memory import MemoryTier
    from tiers.nvme import NvmeTier

#: a peer call's reply: its header and its body, if any
Reply = tuple[dict[str, Any], bytes | memoryview | None]


class LocalStore(Protocol):
    """What this node holds: its tiers and the bookkeeping of them."""

    id: str
    config: Config
    memory: MemoryTier
    nvme: NvmeTier
    cold: ColdTier
    codec: Codec
    catalog: Catalog
    state_log: StateLog
    #: chunk id -> what this node knows of its copy here
    index: dict[str, IndexEntry]
    #: chunk id -> the fragment indexes this node stores of it
    fragments: dict[str, set[int]]
    space: DiskSpace
    locks: ChunkLocks
    #: chunks whose collection has been decided and is under way: held by no one
    collecting: set[str]
    metrics: NodeMetrics
    #: new PUTs (HTTP and peer) are refused from then on (a graceful stop began)
    stopping: bool
    #: a co-located client's lease taken before the stop is no longer sealed
    writes_closed: bool

    @property
    def url(self) -> str: ...

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None: ...

    def memory_has(self, chunk_id: str) -> bool: ...

    def nvme_has(self, chunk_id: str) -> bool: ...

    def holds_hot(self, chunk_id: str) -> bool: ...

    def is_cold(self, chunk_id: str) -> bool: ...

    def note_stored(self, chunk_id: str, size: int) -> None: ...

    async def record_state(self, ids: Iterable[str], state: int) -> None: ...

    def forget_fragment(self, key: str) -> None: ...

    def usage(self) -> dict[str, dict[str, Any]]: ...

    def update_gauges(self) -> None: ...


class ClusterView(Protocol):
    """The cluster as this node sees it, and the calls it makes on its peers."""

    membership: Membership
    #: the peer protocol's client (a PUT's replica streams open on it)
    peers: PeerClient

    def placement(self) -> Placement: ...

    def spec(self, node_id: str) -> NodeSpec: ...

    async def call(
        self,
        node_id: str,
        method: str,
        args: dict[str, Any],
        body: bytes | bytearray | memoryview | None = None,
        timeout: float = 30.0,
        *,
        until_down: bool = False,
    ) -> Reply: ...

    async def holdings(
        self,
        node_ids: Iterable[str],
        ids: list[str],
        *,
        touch: float | None = None,
        timeout: float = 30.0,
        answered: set[str] | None = None,
        draining: set[str] | None = None,
    ) -> dict[str, list[Holding]]: ...

    async def chunk_states(
        self, ids: list[str], *, touch: float | None = None, placement: Placement | None = None
    ) -> dict[str, tuple[int, int]]: ...

    def states_of(self, held: dict[str, list[Holding]]) -> dict[str, tuple[int, int]]: ...

    # the peer calls, one method each (``cluster.Cluster`` says what each does)
    async def get_chunk(
        self, node_id: str, chunk_id: str
    ) -> tuple[dict[str, Any], bytes | memoryview | None]: ...

    async def get_fragment(self, node_id: str, key: str) -> bytes | memoryview | None: ...

    async def put_fragment(
        self, node_id: str, key: str, size: int, blob: bytes | bytearray | memoryview
    ) -> None: ...

    async def drained(self, node_id: str, chunk_id: str) -> None: ...

    async def set_state(self, node_id: str, ids: list[str], state: int) -> None: ...

    async def drop_nvme(self, node_id: str, ids: list[str]) -> None: ...

    async def evict(self, node_id: str, ids: list[str], *, nvme: bool) -> dict[str, Any]: ...

    async def witness(
        self, node_id: str, chunk_id: str, slot: int, pin: float, *, timeout: float
    ) -> bool: ...

    async def drop_misplaced(
        self, node_id: str, chunk_id: str, slot: int, witnesses: list[str], *, timeout: float
    ) -> bool: ...

    async def drain_marks(
        self, node_id: str, marks: dict[str, Any], *, timeout: float
    ) -> dict[str, Any]: ...

    async def drain_progress(self, node_id: str, *, timeout: float) -> dict[str, Any]: ...

    async def catalog_put(self, node_id: str, record: CatalogRecord) -> dict[str, Any]: ...

    async def catalog_get(self, node_id: str, name: str) -> dict[str, Any]: ...

    async def catalog_dump(self, node_id: str, prefix: str, *, chunks: bool) -> dict[str, Any]: ...

    async def catalog_versions(self, node_id: str, names: list[str]) -> dict[str, Any]: ...


class DataPlane(Protocol):
    """The node's chunks as the catalogue on etcd stores a manifest too big for etcd in them
    (``coord/etcd_catalogue.py``): what it is handed when the node builds it."""

    config: Config

    async def put_chunk(
        self, chunk_id: str, size: int, body: AsyncIterator[bytes | bytearray | memoryview]
    ) -> tuple[int, dict[str, Any]]: ...

    async def read_chunk(
        self, chunk_id: str, rng: ByteRange | None = None
    ) -> tuple[bytes | memoryview, str]: ...


class Rebalancing(Protocol):
    """The rebalance, as repair hands it chunks (``pipeline/rebalance.py``)."""

    def misplaced(
        self, chunk_id: str, held: list[Holding], placement: Placement
    ) -> list[tuple[str, int]]: ...

    def offer(self, chunk_id: str) -> None: ...
