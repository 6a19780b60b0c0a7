"""Retention: the leader applies the cluster's retention policy (``storaged/retention.py``).

Relies on: the catalogue's listings (each live checkpoint's commit time); every live
node's *read holds* (``ReadHolds``: the names whose manifest or restore plan it served
within ``gc_grace``), asked at each pass; the archive's two calls when a rule has archive
clauses (``archive(name)``, ``is_archived(name)``, injected: the node has no archive of
its own here).

Upholds: a checkpoint is deleted only through the ``rm`` path (``Checkpoints.delete``: a
tombstone, its chunks collected by GC after the grace), so I3 and the other invariants of
a chunk's life hold unchanged; the newest committed checkpoint of each job, one a node
served within the hold, and one the policy says must be archived and that is not yet, are
never deleted (``decide``'s invariants). A pass in which some member may be serving a
restore without answering (a live node that does not answer, or one down for less than
``gone_after``) deletes nothing: it may be reading. What a pass cannot learn keeps data.

Who leads: the live member first by id (``leader``). Two views can disagree for a heartbeat
and two nodes then run the same pass: both decide from the catalogue, and a delete the
other made first answers 404, which is taken as done.

A restore that fetches its manifest in the milliseconds between the leader's question and
the tombstone is not held, as with an ``rm`` racing it; the hold does not follow the
restore's chunk reads (they do not name the checkpoint), so a restore that reads for longer
than ``gc_grace`` after its last manifest or plan is not held either.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

from storaged.errors import NotFound, Unavailable
from storaged.peer import PeerError
from storaged.placement import Placement
from storaged.retention import NEWEST, NO_POLICY, Committed, Decision, Policy, PolicyError, decide

if TYPE_CHECKING:
    from storaged.coord.catalogue import Catalogue
    from storaged.coord.manifest_store import CatalogRecord
    from storaged.coord.policy_store import PolicyStore
    from storaged.node.services import ClusterView, LocalStore

log = logging.getLogger("storaged.node.retention")

#: seconds a member has to say which checkpoints it holds for reads
_HOLDS_TIMEOUT = 5.0

Archive = Callable[[str], Awaitable[object]]
IsArchived = Callable[[str], Awaitable[bool]]


class ReadHolds:
    """The checkpoints whose manifest or restore plan this node served recently: a restore
    may be reading them. A hold lasts ``seconds`` from the last time it was served."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._until: dict[str, float] = {}

    def hold(self, name: str) -> None:
        self._until[name] = time.monotonic() + self.seconds

    def names(self) -> list[str]:
        now = time.monotonic()
        for name in [n for n, until in self._until.items() if until <= now]:
            del self._until[name]
        return sorted(self._until)


@dataclass(frozen=True, slots=True)
class PassReport:
    """What a pass decided and did (for the log, the tests and the metrics)."""

    decision: Decision
    deleted: tuple[str, ...] = ()
    archived: tuple[str, ...] = ()
    #: why the pass deleted nothing it would have (empty: it deleted what it decided)
    held_back: str = ""


@dataclass(eq=False, repr=False)
class Retention:
    local: LocalStore
    cluster: ClusterView
    _: KW_ONLY
    catalogue: Catalogue
    #: the ``rm`` path (``Checkpoints.delete``)
    delete: Callable[[str], Awaitable[None]]
    holds: ReadHolds
    archive: Archive | None = None
    is_archived: IsArchived | None = None
    #: the last pass's report (None before the first)
    last: PassReport | None = field(default=None, init=False)

    @property
    def store(self) -> PolicyStore | None:
        return self.catalogue.policy_store()

    def check(self, policy: Policy) -> Policy:
        """``policy`` if this node can apply it; ``PolicyError`` for archive clauses on a
        node without an archive."""
        if policy.archives and (self.archive is None or self.is_archived is None):
            rules = ", ".join(repr(r.prefix) for r in policy.rules if r.archives)
            raise PolicyError(
                f"the retention rule(s) for {rules} archive checkpoints, and this node has no "
                "archive: start the nodes with one (--archive URL) or remove archive_every "
                "and archive_last"
            )
        return policy

    async def policy(self) -> tuple[Policy, str]:
        """The policy in force and where it comes from: the coordinator's when it stores
        one, else the cluster file's (``"cluster file"``; ``"none"`` when that is empty)."""
        store = self.store
        if store is not None:
            stored = await store.load()
            if stored is not None:
                return self.check(stored), store.origin
        policy = self.local.config.retention
        return self.check(policy), "cluster file" if policy else "none"

    @staticmethod
    def leader(placement: Placement) -> str | None:
        alive = sorted(placement.alive)
        return alive[0] if alive else None

    async def retention_pass(self) -> PassReport | None:
        """One pass, on the leader only (None elsewhere, or with no policy)."""
        placement = self.cluster.placement()
        if self.leader(placement) != self.local.id:
            return None
        try:
            policy, _ = await self.policy()
        except PolicyError as exc:
            log.error("retention: the policy cannot be applied, nothing is deleted: %s", exc)
            return None
        if not policy:
            return None
        records = await self.records(policy)
        reading, unknown = await self.reads(placement)
        decision = await self.decision(policy, records, reading)
        deleted: tuple[str, ...] = ()
        if unknown and decision.delete:
            log.info(
                "retention: %d checkpoint(s) to delete wait for the next pass: %s",
                len(decision.delete),
                unknown,
            )
        elif not unknown:
            # Deletes first, right after the question about reads; archiving may take long,
            # and what it archives goes at a later pass (decided again then).
            deleted = await self._delete(decision.delete)
        archived = await self._archive(decision.archive)
        self.last = PassReport(decision, deleted, archived, held_back=unknown)
        return self.last

    async def records(self, policy: Policy) -> list[CatalogRecord]:
        """Every live checkpoint under some rule's prefix (whole jobs: a job's newest and
        last ``K`` need all of it)."""
        found: dict[str, CatalogRecord] = {}
        for rule in policy.rules:
            for record in await self.catalogue.list(rule.prefix):
                found[record.name] = record
        return list(found.values())

    async def reads(self, placement: Placement) -> tuple[set[str], str]:
        """The names some member holds for reads, and, when that cannot be known of every
        member that may serve one, why not (then nothing may be deleted)."""
        view = placement.view
        now = time.time()
        away = [
            m.id
            for m in view.members
            if m.id not in view.alive
            and (since := self.cluster.membership.down_since(m.id)) is not None
            and now - since < self.local.config.gone_after
        ]
        reading: set[str] = set()
        silent: list[str] = []

        async def ask(node_id: str) -> None:
            try:
                reply, _ = await self.cluster.call(
                    node_id, "read_holds", {}, timeout=_HOLDS_TIMEOUT, until_down=True
                )
            except (PeerError, OSError, TimeoutError):
                silent.append(node_id)
                return
            reading.update(str(n) for n in reply.get("names", []))

        await asyncio.gather(*(ask(n) for n in placement.alive))
        why = []
        if silent:
            why.append(f"{', '.join(sorted(silent))} did not say what it serves")
        if away:
            why.append(f"{', '.join(sorted(away))} is down and may be serving a restore")
        return reading, "; ".join(why)

    async def decision(
        self, policy: Policy, records: list[CatalogRecord], reading: set[str]
    ) -> Decision:
        """``decide`` on ``records``, the archive asked only about the checkpoints the
        policy wants archived (a first decision names them)."""
        committed = [Committed(r.name, r.committed, reading=r.name in reading) for r in records]
        now = time.time()
        first = decide(policy, committed, now)
        if not first.archive or self.is_archived is None:
            return first
        wanted = set(first.archive)
        done = set()
        for name in wanted:
            try:
                if await self.is_archived(name):
                    done.add(name)
            except Exception as exc:  # an archive out of reach: not archived, kept
                log.warning("retention: is %s archived? the archive did not say: %s", name, exc)
        return decide(
            policy,
            [
                Committed(c.name, c.committed, archived=c.name in done, reading=c.reading)
                for c in committed
            ],
            now,
        )

    async def _archive(self, names: tuple[str, ...]) -> tuple[str, ...]:
        if self.archive is None:
            return ()
        done = []
        for name in names:
            try:
                await self.archive(name)
            except Exception as exc:  # kept until archived: the next pass tries again
                log.warning("retention: archiving %s failed: %s", name, exc)
                continue
            done.append(name)
        return tuple(done)

    async def _delete(self, names: tuple[str, ...]) -> tuple[str, ...]:
        deleted = []
        for name in names:
            try:
                await self.delete(name)
            except NotFound:
                continue  # deleted meanwhile (an rm, another leader)
            except Unavailable as exc:
                # the catalogue out of reach (etcd cut off, a leader change): what is left
                # waits for the next pass, decided again then. A line, not a traceback.
                log.warning("retention: deleting %s: %s (the rest waits for the next pass)",
                            name, exc)  # fmt: skip
                break
            deleted.append(name)
            log.info("retention: deleted %s", name)
        return tuple(deleted)

    async def annotate(self, records: list[CatalogRecord]) -> dict[str, dict[str, Any]]:
        """Per listed checkpoint, the rule it falls under and the clauses that keep it, as
        the next pass would decide now (extension E20)."""
        try:
            policy, _ = await self.policy()
        except PolicyError as exc:
            return {
                r.name: {"rule": None, "kept_by": f"policy not applied: {exc}"} for r in records
            }
        out: dict[str, dict[str, Any]] = {}
        # Only the rules something listed falls under: every checkpoint under one of them
        # starts with its prefix, so their jobs are whole in these prefixes' listings.
        rules = {rule for r in records if (rule := policy.rule_for(r.name)) is not None}
        if not rules:
            return {r.name: {"rule": None, "kept_by": NO_POLICY} for r in records}
        reading, _ = await self.reads(self.cluster.placement())
        listed = await self.records(Policy(tuple(rules)))
        decision = await self.decision(policy, listed, reading)
        for r in records:
            rule = policy.rule_for(r.name)
            reasons = decision.kept.get(r.name, ())
            if rule is None:
                out[r.name] = {"rule": None, "kept_by": NO_POLICY}
            elif r.name in decision.delete:
                out[r.name] = {"rule": rule.prefix, "kept_by": "to delete"}
            else:
                # committed since the pass's listing: the next pass decides it
                out[r.name] = {"rule": rule.prefix, "kept_by": ", ".join(reasons) or NEWEST}
        return out
