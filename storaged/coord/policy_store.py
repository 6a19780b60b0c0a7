"""Where a cluster on a coordination service keeps its retention policy.

The embedded coordination has none: its policy is the cluster file's ``[[retention]]``
(``Config.retention``), the same file on every node. On etcd, ``storaged retention set``
stores one policy for the whole cluster under ``<root>/retention`` (one small JSON
document, ``{"version": 1, "rules": [...], "set_at": t}``); while that key is absent a
node goes by its cluster file's (``EtcdPolicyStore``, in ``coord/etcd_catalogue.py``).
``Catalogue.policy_store`` says which a node has.
"""

from __future__ import annotations

import abc
import json
import time
from typing import Any

from storaged.retention import Policy, PolicyError, parse_rules

#: the stored document's version; a node refuses a newer one (applies nothing)
_VERSION = 1


class PolicyStore(abc.ABC):
    """One retention policy for the whole cluster, stored by the coordinator."""

    #: what ``storaged retention show`` says the policy comes from
    origin: str

    @abc.abstractmethod
    async def load(self) -> Policy | None:
        """The stored policy, None when none is stored; ``PolicyError`` when the stored
        document cannot be used (a node then applies nothing), ``CoordinatorUnavailable``
        when the coordinator does not answer."""

    @abc.abstractmethod
    async def save(self, policy: Policy) -> None:
        """Store ``policy`` for every node (an empty one removes the stored policy)."""


def document(policy: Policy) -> bytes:
    doc: dict[str, Any] = {"version": _VERSION, "rules": policy.to_doc(), "set_at": time.time()}
    return json.dumps(doc, sort_keys=True).encode()


def policy_of(blob: bytes) -> Policy:
    try:
        doc = json.loads(blob)
    except ValueError as exc:
        raise PolicyError(f"the stored retention policy is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != _VERSION:
        raise PolicyError("the stored retention policy has an unknown version")
    return parse_rules(doc.get("rules"), source="the stored retention policy")
