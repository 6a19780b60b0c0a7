"""Retention policies: which committed checkpoints of a job to keep, archive or delete.

Pure: no I/O, no clock of its own. The leader's stage (``storaged.node.pipeline.retention``)
feeds ``decide`` what the catalogue, the nodes' read holds and the archive say, and
deletes what it answers through the ``rm`` path (tombstone, GC after the grace).

A policy is a list of rules, one per name prefix; a checkpoint falls under the rule of the
longest prefix its name starts with (none: the policy never touches it). Under a rule,
checkpoints are grouped by *job*, the name's parent (``job42/run-a/step-40`` is of job
``job42/run-a``): each job has its own newest, its own last ``K``. Cluster file::

    [[retention]]
    prefix = "job42/"
    keep_last = 3              # the 3 newest committed checkpoints of each job
    keep_every = 10            # and every checkpoint whose sequence number is a multiple of 10
    keep_every_for = "7d"      # for 7 days after its commit ("forever": no limit; the default)
    archive_every = 5          # sequence numbers that are multiples of 5 go to the archive
    archive_last = true        # and so does each job's newest

*Newest* and *last K* go by commit order (the catalogue's commit time, then the name).
*Every Nth* goes by the **trailing number of the name** (``step-000040`` is 40), not by the
position in commit order: a position shifts as older checkpoints are deleted (after the 5th
of 8 goes, the 8th is the 7th), so "every 4th" would pick other checkpoints at each pass and
delete what it kept before; a number in the name never moves. A name without a trailing
number under a rule that has an every-Nth clause is kept (``no sequence number``): what
cannot be classified is not deleted.

Invariants of ``decide`` (property-tested in ``tests/test_retention.py``): for any input,
the newest checkpoint of each job, every checkpoint being read, and every checkpoint the
policy says must be archived and that is not archived yet, are never in the delete set;
every checkpoint is either kept (with at least one clause saying why) or deleted, never
both; a checkpoint under no rule is never deleted.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class PolicyError(ValueError):
    """A retention policy that cannot be used; the message names the rule and the key."""


#: seconds per unit of a duration (``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_TRAILING_NUMBER = re.compile(r"(\d+)$")
_RULE_KEYS = frozenset(
    {"prefix", "keep_last", "keep_every", "keep_every_for", "archive_every", "archive_last"}
)

#: clauses (reasons a checkpoint is kept), as ``storaged ls`` shows them
NEWEST = "newest"
BEING_READ = "being read"
AWAITING_ARCHIVE = "awaiting archive"
NO_SEQUENCE = "no sequence number"
NO_POLICY = "no policy"


@dataclass(frozen=True, slots=True)
class Rule:
    """What to keep of the checkpoints whose names start with ``prefix``."""

    prefix: str
    keep_last: int = 0
    #: keep sequence numbers that are multiples of this (0: no such clause)
    keep_every: int = 0
    #: for this many seconds after their commit (None: forever)
    keep_every_for: float | None = None
    #: sequence numbers that are multiples of this are archived (0: none)
    archive_every: int = 0
    #: each job's newest is archived
    archive_last: bool = False

    @property
    def archives(self) -> bool:
        return bool(self.archive_every or self.archive_last)

    @property
    def needs_sequence(self) -> bool:
        return bool(self.keep_every or self.archive_every)

    def to_doc(self) -> dict[str, Any]:
        """The rule as written in a cluster file (``parse_rules`` reads it back)."""
        doc: dict[str, Any] = {"prefix": self.prefix, "keep_last": self.keep_last}
        if self.keep_every:
            doc["keep_every"] = self.keep_every
            doc["keep_every_for"] = (
                "forever" if self.keep_every_for is None else format_duration(self.keep_every_for)
            )
        if self.archive_every:
            doc["archive_every"] = self.archive_every
        if self.archive_last:
            doc["archive_last"] = True
        return doc


@dataclass(frozen=True, slots=True)
class Policy:
    """Rules by prefix; the longest prefix a name starts with wins."""

    rules: tuple[Rule, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.rules)

    @property
    def archives(self) -> bool:
        """Whether some rule has an archive clause (the node must have an archive)."""
        return any(r.archives for r in self.rules)

    def rule_for(self, name: str) -> Rule | None:
        best: Rule | None = None
        for rule in self.rules:
            if name.startswith(rule.prefix) and (
                best is None or len(rule.prefix) > len(best.prefix)
            ):
                best = rule
        return best

    def to_doc(self) -> list[dict[str, Any]]:
        return [r.to_doc() for r in self.rules]


@dataclass(frozen=True, slots=True)
class Committed:
    """A committed checkpoint as ``decide`` sees it."""

    name: str
    committed: float
    #: a copy of it is in the archive
    archived: bool = False
    #: some node served its manifest or restore plan recently (a restore may be reading it)
    reading: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """What a policy says of a set of checkpoints.

    ``kept``: name -> the clauses that keep it (never empty); ``delete``: the names to
    delete, oldest first; ``archive``: the names to archive now, oldest first (must-archive
    and not archived yet; all of them are also in ``kept``)."""

    kept: dict[str, tuple[str, ...]] = field(default_factory=dict)
    delete: tuple[str, ...] = ()
    archive: tuple[str, ...] = ()


# ---- parsing -------------------------------------------------------------------------------
def parse_duration(value: object) -> float | None:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"``, a number of seconds -> seconds;
    ``"forever"`` -> None."""
    if isinstance(value, bool):
        raise PolicyError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        if value <= 0:
            raise PolicyError(f"not a duration: {value!r} (write a positive time)")
        return float(value)
    text = str(value).strip().lower()
    if text == "forever":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw]?)", text)
    if not m or float(m.group(1)) <= 0:
        raise PolicyError(f"not a duration: {value!r} (e.g. '7d', '12h', '90s', 'forever')")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]


def format_duration(seconds: float) -> str:
    for unit in ("d", "h", "m"):
        if seconds >= _DURATION_UNITS[unit] and seconds % _DURATION_UNITS[unit] == 0:
            return f"{int(seconds // _DURATION_UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def _count(where: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PolicyError(f"{where}: {key} = {value!r}: write a whole number, 0 or more")
    return value


def parse_rule(entry: object, where: str) -> Rule:
    if not isinstance(entry, Mapping):
        raise PolicyError(f"{where}: not a table")
    unknown = sorted(set(map(str, entry)) - _RULE_KEYS)
    if unknown:
        raise PolicyError(
            f"{where}: unknown key {unknown[0]} (known: {', '.join(sorted(_RULE_KEYS))})"
        )
    prefix = entry.get("prefix")
    if not isinstance(prefix, str) or not prefix:
        raise PolicyError(f'{where}: no prefix (write prefix = "job42/")')
    # Here, not at the top: storaged.config imports this module, and the command line
    # (``storaged --version``) imports neither hashing nor asyncio (tests/client/test_cli_start.py)
    from storaged.ids import CHECKPOINT_NAME_RE

    stem = prefix.rstrip("/")
    if not stem or not CHECKPOINT_NAME_RE.fullmatch(stem):
        raise PolicyError(f"{where}: prefix {prefix!r} cannot begin a checkpoint name")
    if "keep_last" not in entry:
        raise PolicyError(f"{where}: no keep_last (write keep_last = 0 to keep only the newest)")
    keep_last = _count(where, "keep_last", entry["keep_last"])
    keep_every = _count(where, "keep_every", entry.get("keep_every", 0))
    archive_every = _count(where, "archive_every", entry.get("archive_every", 0))
    archive_last = entry.get("archive_last", False)
    if not isinstance(archive_last, bool):
        raise PolicyError(f"{where}: archive_last = {archive_last!r}: write true or false")
    keep_for: float | None = None
    if "keep_every_for" in entry:
        if not keep_every:
            raise PolicyError(f"{where}: keep_every_for without keep_every")
        try:
            keep_for = parse_duration(entry["keep_every_for"])
        except PolicyError as exc:
            raise PolicyError(f"{where}: keep_every_for: {exc}") from None
    return Rule(prefix, keep_last, keep_every, keep_for, archive_every, archive_last)


def parse_rules(entries: object, *, source: str = "[[retention]]") -> Policy:
    """The policy of a list of rule tables (a cluster file's ``[[retention]]``, or the
    document ``storaged retention set`` stores); ``PolicyError`` naming the first bad rule
    and key. Two rules of one prefix are refused."""
    if entries is None:
        return Policy()
    if not isinstance(entries, list):
        raise PolicyError(f"{source}: write [[retention]] tables")
    rules: list[Rule] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        rule = parse_rule(entry, f"{source} entry {i + 1}")
        if rule.prefix in seen:
            raise PolicyError(f"{source} entry {i + 1}: a second rule for prefix {rule.prefix!r}")
        seen.add(rule.prefix)
        rules.append(rule)
    return Policy(tuple(rules))


def parse_policy_toml(text: str, *, source: str = "the policy file") -> Policy:
    """A TOML document of ``[[retention]]`` tables (and nothing else) -> its policy."""
    import tomllib

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not TOML: {exc}") from None
    other = sorted(set(doc) - {"retention"})
    if other:
        raise PolicyError(f"{source}: unknown key {other[0]} (write [[retention]] tables only)")
    return parse_rules(doc.get("retention", []), source=f"{source}: [[retention]]")


# ---- deciding ------------------------------------------------------------------------------
def sequence_of(name: str) -> int | None:
    """The trailing number of ``name`` (``job/step-000040`` -> 40), or None."""
    m = _TRAILING_NUMBER.search(name)
    return int(m.group(1)) if m else None


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``22nd``."""
    if n % 100 in (11, 12, 13):
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def job_of(name: str) -> str:
    """The job a checkpoint belongs to: its name's parent."""
    return name.rpartition("/")[0]


def must_archive(rule: Rule, name: str, *, newest: bool) -> bool:
    """Whether ``rule`` wants ``name`` in the archive (``newest``: it is its job's newest)."""
    if rule.archive_last and newest:
        return True
    seq = sequence_of(name)
    return bool(rule.archive_every) and seq is not None and seq % rule.archive_every == 0


def decide(policy: Policy, checkpoints: Iterable[Committed], now: float | None = None) -> Decision:
    """What ``policy`` keeps, archives and deletes of ``checkpoints`` (the live committed
    ones; all of a job's must be given for its newest and last ``K`` to be right: the
    caller lists whole prefixes). ``now`` (wall clock) bounds ``keep_every_for``."""
    at = time.time() if now is None else now
    jobs: dict[tuple[str, str], list[Committed]] = {}
    kept: dict[str, tuple[str, ...]] = {}
    for c in checkpoints:
        rule = policy.rule_for(c.name)
        if rule is None:
            kept[c.name] = (NO_POLICY,)
            continue
        jobs.setdefault((rule.prefix, job_of(c.name)), []).append(c)
    delete: list[str] = []
    archive: list[str] = []
    for (prefix, _), group in sorted(jobs.items()):
        rule = policy.rule_for(prefix)
        assert rule is not None
        group.sort(key=lambda c: (c.committed, c.name))
        for position, c in enumerate(reversed(group)):
            reasons = _clauses(rule, c, position, at)
            if must_archive(rule, c.name, newest=position == 0) and not c.archived:
                reasons.append(AWAITING_ARCHIVE)
                archive.append(c.name)
            if reasons:
                kept[c.name] = tuple(reasons)
            else:
                delete.append(c.name)
    delete.reverse()  # oldest first
    archive.reverse()
    return Decision(kept, tuple(delete), tuple(archive))


def _clauses(rule: Rule, c: Committed, position: int, now: float) -> list[str]:
    """Why ``rule`` keeps ``c``, the ``position``-th newest of its job (0: the newest);
    the archive clause aside."""
    reasons: list[str] = []
    if position == 0:
        reasons.append(NEWEST)
    if position < rule.keep_last:
        reasons.append(f"last {rule.keep_last}")
    seq = sequence_of(c.name)
    if rule.needs_sequence and seq is None:
        reasons.append(NO_SEQUENCE)
    elif rule.keep_every and seq is not None and seq % rule.keep_every == 0:
        if rule.keep_every_for is None:
            reasons.append(f"every {ordinal(rule.keep_every)}")
        elif now < c.committed + rule.keep_every_for:
            until = time.strftime("%Y-%m-%d", time.gmtime(c.committed + rule.keep_every_for))
            reasons.append(f"every {ordinal(rule.keep_every)} until {until}")
    if c.reading:
        reasons.append(BEING_READ)
    return reasons


def kept_by(
    policy: Policy, records: Sequence[Committed], now: float | None = None
) -> dict[str, str]:
    """Per name, the clauses that keep it as one string (``"last 3, every 4th"``), or
    ``"no policy"``, or ``"to delete"`` (what a listing shows: extension E20)."""
    decision = decide(policy, records, now)
    out = {name: ", ".join(reasons) for name, reasons in decision.kept.items()}
    for name in decision.delete:
        out[name] = "to delete"
    return out


__all__ = [
    "AWAITING_ARCHIVE",
    "BEING_READ",
    "NEWEST",
    "NO_POLICY",
    "NO_SEQUENCE",
    "Committed",
    "Decision",
    "Policy",
    "PolicyError",
    "Rule",
    "decide",
    "format_duration",
    "job_of",
    "kept_by",
    "must_archive",
    "ordinal",
    "parse_duration",
    "parse_policy_toml",
    "parse_rule",
    "parse_rules",
    "sequence_of",
]
