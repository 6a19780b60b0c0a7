"""Two ranks save a sharded DTensor into storaged; the same checkpoint loads resharded.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 docs/examples/dcp_torchrun.py NAME

STORAGED_URL and STORAGED_TOKEN name the cluster; NAME (default docs/dcp-torchrun) the
checkpoint, which must not exist yet.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from storaged.client.dcp import StoragedReader, StoragedWriter

URL = os.environ["STORAGED_URL"].split(",")
TOKEN = os.environ.get("STORAGED_TOKEN")
NAME = sys.argv[1] if len(sys.argv) > 1 else "docs/dcp-torchrun"

dist.init_process_group("gloo")  # torchrun gives each process its rank and the rendezvous
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))

weight = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
bias = torch.linspace(-1.0, 1.0, 6)

# Saved: each rank holds 8 / world rows of the weight (Shard(0)) and the same plain bias.
# Every rank uploads its own rows; rank 0 commits one manifest once all are acknowledged.
state = {"weight": distribute_tensor(weight, mesh, [Shard(0)]), "bias": bias.clone()}
dcp.save(state, storage_writer=StoragedWriter(URL, NAME, TOKEN))

# Loaded resharded: by columns (Shard(1)). Each rank reads only the bytes of its columns.
by_columns = {
    "weight": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
    "bias": torch.zeros(6),
}
dcp.load(by_columns, storage_reader=StoragedReader(URL, NAME, TOKEN))
cols = 6 // world
assert torch.equal(by_columns["weight"].to_local(), weight[:, rank * cols : (rank + 1) * cols])
assert torch.equal(by_columns["bias"], bias)

# And whole on every rank (Replicate): the full 8 x 6, from both saved shards.
whole = {"weight": distribute_tensor(torch.zeros(8, 6), mesh, [Replicate()])}
dcp.load(whole, storage_reader=StoragedReader(URL, NAME, TOKEN))
assert torch.equal(whole["weight"].to_local(), weight)

print(f"rank {rank} of {world}: saved rows, loaded columns and the whole weight: ok")
dist.destroy_process_group()
