"""The storaged client: the HTTP API (``Client``) and sharded numpy checkpoints on top of it.

The names below are imported on first use (PEP 562): a command that only asks the cluster
(``storaged ls``) does not pay for numpy and the checkpoint machinery it never touches.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storaged.client.checkpoint import (
        AsyncSaver,
        CheckpointStore,
        SaveHandle,
        SaveResult,
        Shard,
        StagedShard,
        StagingBuffer,
        StateDict,
        commit_checkpoint,
        restore_checkpoint,
        save_checkpoint,
        save_shard,
        stage_shard,
        upload_shard,
    )
    from storaged.client.client import (
        CheckpointCosts,
        CheckpointInfo,
        CheckpointStatus,
        Client,
        ClientStats,
        ClusterInfo,
        CommitResult,
        Holder,
        NodeInfo,
        PutResult,
        TierCost,
        WaitTimeout,
    )
    from storaged.client.errors import (
        BadManifest,
        BadName,
        BadRange,
        BadRequest,
        BodyTooSlow,
        CheckpointNotFound,
        ChecksumMismatch,
        ChunkNotFound,
        ColdFull,
        ConnectionFailed,
        Exists,
        MissingChunks,
        NotEnoughFragments,
        NotStoraged,
        NvmeFull,
        ProtocolError,
        StoragedError,
        StorageFull,
        TooLarge,
        Unavailable,
    )
    from storaged.client.layout import (
        DEFAULT_CHUNK_SIZE,
        MSGPACK_DTYPE,
        DtypeMismatch,
        InvalidManifest,
        KeyNotSaved,
        LayoutError,
        Manifest,
        RegionNotCovered,
        ShapeMismatch,
        ShardGap,
        ShardingError,
        ShardOverlap,
        build_manifest,
        check_layout,
    )
    from storaged.client.retry import RetryPolicy
    from storaged.wire import STATES, ByteRange, state_at_least

#: where each public name lives, by module
_EXPORTS: dict[str, tuple[str, ...]] = {
    "storaged.client.checkpoint": (
        "AsyncSaver",
        "CheckpointStore",
        "SaveHandle",
        "SaveResult",
        "Shard",
        "StagedShard",
        "StagingBuffer",
        "StateDict",
        "commit_checkpoint",
        "restore_checkpoint",
        "save_checkpoint",
        "save_shard",
        "stage_shard",
        "upload_shard",
    ),
    "storaged.client.client": (
        "CheckpointCosts",
        "CheckpointInfo",
        "CheckpointStatus",
        "Client",
        "ClientStats",
        "ClusterInfo",
        "CommitResult",
        "Holder",
        "NodeInfo",
        "PutResult",
        "TierCost",
        "WaitTimeout",
    ),
    "storaged.client.errors": (
        "BadManifest",
        "BadName",
        "BadRange",
        "BadRequest",
        "BodyTooSlow",
        "CheckpointNotFound",
        "ChecksumMismatch",
        "ChunkNotFound",
        "ColdFull",
        "ConnectionFailed",
        "Exists",
        "MissingChunks",
        "NotEnoughFragments",
        "NotStoraged",
        "NvmeFull",
        "ProtocolError",
        "StoragedError",
        "StorageFull",
        "TooLarge",
        "Unavailable",
    ),
    "storaged.client.layout": (
        "DEFAULT_CHUNK_SIZE",
        "MSGPACK_DTYPE",
        "DtypeMismatch",
        "InvalidManifest",
        "KeyNotSaved",
        "LayoutError",
        "Manifest",
        "RegionNotCovered",
        "ShapeMismatch",
        "ShardGap",
        "ShardingError",
        "ShardOverlap",
        "build_manifest",
        "check_layout",
    ),
    "storaged.client.retry": ("RetryPolicy",),
    "storaged.wire": ("STATES", "ByteRange", "state_at_least"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MSGPACK_DTYPE",
    "STATES",
    "AsyncSaver",
    "BadManifest",
    "BadName",
    "BadRange",
    "BadRequest",
    "BodyTooSlow",
    "ByteRange",
    "CheckpointCosts",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CheckpointStatus",
    "CheckpointStore",
    "ChecksumMismatch",
    "ChunkNotFound",
    "Client",
    "ClientStats",
    "ClusterInfo",
    "ColdFull",
    "CommitResult",
    "ConnectionFailed",
    "DtypeMismatch",
    "Exists",
    "Holder",
    "InvalidManifest",
    "KeyNotSaved",
    "LayoutError",
    "Manifest",
    "MissingChunks",
    "NodeInfo",
    "NotEnoughFragments",
    "NotStoraged",
    "NvmeFull",
    "ProtocolError",
    "PutResult",
    "RegionNotCovered",
    "RetryPolicy",
    "SaveHandle",
    "SaveResult",
    "ShapeMismatch",
    "Shard",
    "ShardGap",
    "ShardOverlap",
    "ShardingError",
    "StagedShard",
    "StagingBuffer",
    "StateDict",
    "StorageFull",
    "StoragedError",
    "TierCost",
    "TooLarge",
    "Unavailable",
    "WaitTimeout",
    "build_manifest",
    "check_layout",
    "commit_checkpoint",
    "restore_checkpoint",
    "save_checkpoint",
    "save_shard",
    "stage_shard",
    "state_at_least",
    "upload_shard",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain global
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
