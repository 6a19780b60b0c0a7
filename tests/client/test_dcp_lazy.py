"""The lazy copy on the DCP path: torch's own asynchronous staging (``DefaultStager`` with
``use_async_staging``) in front of ``StoragedWriter``, against a real cluster (in-process
nodes, ``inproc_cluster``; the synchronous training loop runs in a thread).

``dcp.async_save`` then returns before the copy is done, with ``staging_completion``: the
future a training loop waits on before its optimizer changes the parameters (here a step
pre-hook on a real ``torch.optim.SGD``). ``StoragedWriter`` needs nothing for it: it
uploads what the stager copied. The checkpoint holds the values of the step it was taken
at, though the step came right after ``async_save`` returned.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

from storaged.client.dcp import StoragedReader, StoragedWriter
from tests.conftest import TOKEN
from tests.service.inproc import InprocCluster

pytestmark = [pytest.mark.torch, pytest.mark.timeout(200)]

#: CPU tensors: torch's pinned and shared memory and non-blocking copies need an accelerator.
CPU_ASYNC = StagingOptions(
    use_pinned_memory=False,
    use_shared_memory=False,
    use_async_staging=True,
    use_non_blocking_copy=False,
)


async def test_async_staging_lets_the_step_wait_for_the_copy_only(
    inproc_cluster: InprocCluster,
) -> None:
    # The training loop is synchronous (DCP blocks its caller): it runs in a thread, the
    # nodes in the test's loop.
    urls = inproc_cluster.urls

    def train() -> None:
        torch.manual_seed(11)
        params = [torch.nn.Parameter(torch.randn(1 << 18)), torch.nn.Parameter(torch.randn(77))]
        optimizer = torch.optim.SGD(params, lr=1.0)
        for p in params:
            p.grad = torch.ones_like(p)
        pending: list[Any] = []

        def hold(*_: Any) -> None:  # the step waits for the copy of a save in progress
            while pending:
                pending.pop().result(timeout=60)

        optimizer.register_step_pre_hook(hold)
        stager = DefaultStager(CPU_ASYNC)
        try:
            for step in range(2):
                name = f"dcp-lazy-{uuid.uuid4().hex[:12]}/{step}"
                want = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
                response = dcp_async_save(
                    {f"p{i}": p.detach() for i, p in enumerate(params)},
                    storage_writer=StoragedWriter(urls, name, TOKEN, chunk_size=64 << 10),
                    async_stager=stager,
                    no_dist=True,
                )
                assert isinstance(response, AsyncSaveResponse)
                pending.append(response.staging_completion)
                optimizer.step()  # right away: the hook holds it until the copy is done
                assert not torch.equal(params[0].detach(), want["p0"])
                response.upload_completion.result(timeout=60)
                loaded = {k: torch.zeros_like(v) for k, v in want.items()}
                dcp_load(loaded, storage_reader=StoragedReader(urls, name, TOKEN), no_dist=True)
                for key, value in want.items():
                    assert torch.equal(loaded[key], value), (step, key)
        finally:
            stager.close()

    await asyncio.to_thread(train)
