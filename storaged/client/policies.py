"""The retention policy's two calls (extension E20): what the policy in force is, and, on a
coordinator that stores one (etcd), storing the cluster's policy.

Functions over a ``Client`` rather than methods of it: the class is at its bound of 30
methods (tests/test_shape.py), and these calls are the ``storaged retention`` command's
alone. They go through the client's request engine as its own methods do (its nodes in
turn, its retries, its errors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from storaged.client.client import Client
from storaged.client.request import decoded, document

__all__ = ["retention_policy", "set_retention_policy"]


async def _policy(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    return document(await decoded(resp), "retention policy", ("rules", "source"))


async def retention_policy(client: Client) -> dict[str, Any]:
    """The retention policy in force (``GET /v1/retention``): ``{"rules": [...], "source":
    "cluster file"|"etcd"|"none"}``, and ``"error"`` when the nodes cannot apply it."""
    return await client._requests.call("GET", "/v1/retention", _policy)


async def set_retention_policy(
    client: Client, rules: Sequence[Mapping[str, Any]], *, admin_token: str | None = None
) -> dict[str, Any]:
    """Admin (``PUT /v1/admin/retention``): store the cluster's retention policy in its
    coordinator (etcd); the answer is ``retention_policy``'s. A bad policy is refused whole
    (``BadRequest``, ``bad_policy``), and so is any policy on the embedded coordination,
    whose policy is the cluster file's (``Conflict``, ``policy_in_cluster_file``)."""
    doc = {"rules": [dict(r) for r in rules]}
    return await client._requests.admin("PUT", "/v1/admin/retention", _policy, doc, admin_token)
