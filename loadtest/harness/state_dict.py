"""A training job's state dict, and the cluster sized for it (``vs_dcp``, ``direct``).

- ``state_layout``: float32 tensors of a model's mix of sizes adding up to a total;
  ``prefaulted_arrays``: arrays of those shapes with every page touched; ``digest_arrays``.
- ``start_sized_cluster``: the load tests' cluster with a RAM tier of ``memory_per_node``
  bytes and 64 MiB chunks allowed; ``node_pids``; ``ram_tier_check``: how many of a
  checkpoint's chunks the RAM tier can serve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from loadtest.harness.cluster import start_cluster
from loadtest.harness.machine import MiB
from storaged.client import Client
from storaged.client.layout import DEFAULT_CHUNK_SIZE
from storaged.tools.local_cluster import LocalCluster

#: RAM tier per node: this much above an even share of three copies, for uneven placement
MEMORY_MARGIN = 1.2


#: the smallest RAM tier a node gets (quick runs: placement of a few chunks is lumpy)
MIN_MEMORY = 256 * MiB


F32 = np.dtype(np.float32)


Array = np.ndarray[Any, np.dtype[np.float32]]


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    kind: str  # large | medium | small

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * F32.itemsize


#: the sizes small tensors cycle through (norms, biases, per-layer scales...): 87 of them at
#: 2 GiB. ``--small-kib 4,16,64,1024`` gives 416 (477 tensors in all, a manifest of about
#: 85 KB: more than one peer-protocol header holds, which once broke commits).
DEFAULT_SMALL = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def state_layout(total: int, small: Sequence[int] = DEFAULT_SMALL) -> list[TensorSpec]:
    """Float32 tensors whose sizes add up to ``total`` bytes (a multiple of 4, >= 64 KiB).

    Half the bytes in 4 large tensors (embeddings and their optimizer moments), about
    45 % in medium tensors of ``total / 128`` (projection weights), the rest in small
    ones cycling through the ``small`` sizes (multiples of 4), the last one taking what
    is left.
    """
    if total % F32.itemsize or total < 64 << 10:
        raise ValueError(f"total must be a multiple of 4 and at least 64 KiB, not {total}")
    if not small or any(s <= 0 or s % F32.itemsize for s in small):
        raise ValueError(f"small tensor sizes must be positive multiples of 4, not {small}")
    specs: list[TensorSpec] = []
    width = 1024  # elements per row of the 2-D tensors

    def rows(nbytes: int) -> tuple[int, ...]:
        elements = nbytes // F32.itemsize
        return (elements // width, width) if elements % width == 0 else (elements,)

    large = (total // 8) // (width * 4) * (width * 4)
    for name in ("model.embed_tokens.weight", "model.lm_head.weight",
                 "optim.embed_tokens.exp_avg", "optim.lm_head.exp_avg"):  # fmt: skip
        if large:
            specs.append(TensorSpec(name, rows(large), "large"))
    medium = (total // 128) // (width * 4) * (width * 4)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    if medium:
        for i in range(int(total * 0.45) // medium):
            layer, proj = divmod(i, len(projections))
            specs.append(TensorSpec(f"model.layers.{layer}.{projections[proj]}.weight",
                                    rows(medium), "medium"))  # fmt: skip
    left = total - sum(s.nbytes for s in specs)
    i = 0
    while left > 0:
        size = min(small[i % len(small)], left)
        specs.append(TensorSpec(f"model.norms.{i}.weight", (size // F32.itemsize,), "small"))
        left -= size
        i += 1
    return specs


def prefaulted_arrays(specs: Sequence[TensorSpec]) -> dict[str, Array]:
    # np.zeros would map pages lazily: fill() touches every page now, not while timed.
    out: dict[str, Array] = {}
    for s in specs:
        array: Array = np.empty(s.shape, dtype=F32)
        array.fill(0)
        out[s.key] = array
    return out


def digest_arrays(arrays: Sequence[np.ndarray[Any, Any]]) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for array in arrays:
        hasher.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return hasher.hexdigest()


def memory_per_node(total: int, nodes: int, chunk: int = DEFAULT_CHUNK_SIZE) -> int:
    """RAM tier per node for three copies of ``total`` bytes spread by placement, rounded up."""
    share = 3 * total / nodes * MEMORY_MARGIN + 4 * chunk
    return max(MIN_MEMORY, math.ceil(share / MiB) * MiB)


def start_sized_cluster(
    root: Path,
    nodes: int,
    memory: int,
    settings: Mapping[str, Any] | None = None,
    *,
    die_with_parent: bool = False,
) -> LocalCluster:
    """The load tests' cluster with ``memory`` bytes of RAM tier per node and 64 MiB chunks
    allowed (and any other ``settings``; ``die_with_parent`` as for ``start_cluster``)."""

    return start_cluster(
        root,
        nodes,
        memory=f"{memory // MiB}MiB",
        max_chunk=64 * MiB,
        settings=settings,
        die_with_parent=die_with_parent,
    )


def node_pids(cluster: LocalCluster) -> list[int]:
    return [cluster.procs[i].pid for i in range(cluster.nodes)]


async def ram_tier_check(client: Client, name: str) -> dict[str, int]:
    """How many of the checkpoint's chunks the RAM tier can serve, and from how many nodes."""
    plan = await client.plan(name)
    in_memory = [sum(1 for h in holders if h.tier == "memory") for holders in plan.values()]
    return {
        "chunks": len(plan),
        "chunks_in_memory": sum(1 for n in in_memory if n > 0),
        "min_memory_holders": min(in_memory, default=0),
    }
