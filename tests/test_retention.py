"""The retention policy (``storaged/retention.py``): parsing, the decision, its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storaged.retention import (
    AWAITING_ARCHIVE,
    BEING_READ,
    NEWEST,
    NO_POLICY,
    NO_SEQUENCE,
    Committed,
    Policy,
    PolicyError,
    Rule,
    decide,
    kept_by,
    must_archive,
    parse_duration,
    parse_policy_toml,
    parse_rules,
    sequence_of,
)

DAY = 86400.0
NOW = 1_800_000_000.0


def steps(job: str, count: int, *, start: int = 1, **flags: set[int]) -> list[Committed]:
    """``count`` checkpoints ``job/step-000001``... committed a minute apart, ending now;
    ``archived={2, 4}``, ``reading={3}`` by sequence number."""
    return [
        Committed(
            f"{job}/step-{s:06d}",
            NOW - (start + count - s) * 60.0,
            archived=s in flags.get("archived", set()),
            reading=s in flags.get("reading", set()),
        )
        for s in range(start, start + count)
    ]


def names(job: str, *seqs: int) -> set[str]:
    return {f"{job}/step-{s:06d}" for s in seqs}


# ---- parsing -------------------------------------------------------------------------------
def test_parse_a_full_rule() -> None:
    policy = parse_rules(
        [
            {
                "prefix": "job42/",
                "keep_last": 3,
                "keep_every": 10,
                "keep_every_for": "7d",
                "archive_every": 5,
                "archive_last": True,
            },
            {"prefix": "scratch/", "keep_last": 0},
        ]
    )
    assert policy.rules[0] == Rule("job42/", 3, 10, 7 * DAY, 5, True)
    assert policy.rules[1] == Rule("scratch/", 0)
    assert policy.archives
    assert parse_rules(policy.to_doc()) == policy


def test_keep_every_is_forever_unless_bounded() -> None:
    forever = parse_rules([{"prefix": "j/", "keep_last": 1, "keep_every": 2}])
    assert forever.rules[0].keep_every_for is None
    spelled = parse_rules(
        [{"prefix": "j/", "keep_last": 1, "keep_every": 2, "keep_every_for": "forever"}]
    )
    assert spelled == forever
    assert parse_rules(forever.to_doc()) == forever


@pytest.mark.parametrize(
    ("rules", "says"),
    [
        ([{"keep_last": 1}], "no prefix"),
        ([{"prefix": "", "keep_last": 1}], "no prefix"),
        ([{"prefix": "/x", "keep_last": 1}], "cannot begin a checkpoint name"),
        ([{"prefix": "j/"}], "no keep_last"),
        ([{"prefix": "j/", "keep_last": -1}], "keep_last = -1"),
        ([{"prefix": "j/", "keep_last": True}], "keep_last = True"),
        ([{"prefix": "j/", "keep_last": "3"}], "keep_last = '3'"),
        ([{"prefix": "j/", "keep_last": 1, "keep_every": 1.5}], "keep_every = 1.5"),
        ([{"prefix": "j/", "keep_last": 1, "keep_every_for": "7d"}], "without keep_every"),
        (
            [{"prefix": "j/", "keep_last": 1, "keep_every": 2, "keep_every_for": "soon"}],
            "keep_every_for: not a duration",
        ),
        ([{"prefix": "j/", "keep_last": 1, "archive_last": "yes"}], "archive_last = 'yes'"),
        ([{"prefix": "j/", "keep_last": 1, "keep_evry": 2}], "unknown key keep_evry"),
        ([{"prefix": "j/", "keep_last": 1}, {"prefix": "j/", "keep_last": 2}], "a second rule"),
        ("j/", "write [[retention]] tables"),
        (["j/"], "not a table"),
    ],
)
def test_bad_rules_are_refused_naming_the_key(rules: object, says: str) -> None:
    with pytest.raises(PolicyError, match=r"entry|retention") as info:
        parse_rules(rules)
    assert says in str(info.value)


def test_policy_file() -> None:
    text = (
        '[[retention]]\nprefix = "a/"\nkeep_last = 2\n\n'
        '[[retention]]\nprefix = "b/"\nkeep_last = 0\n'
    )
    assert [r.prefix for r in parse_policy_toml(text).rules] == ["a/", "b/"]
    assert parse_policy_toml("") == Policy()
    with pytest.raises(PolicyError, match="unknown key replication"):
        parse_policy_toml("replication = 3\n")
    with pytest.raises(PolicyError, match="not TOML"):
        parse_policy_toml("[[retention]\n")
    with pytest.raises(PolicyError, match="entry 1: no keep_last"):
        parse_policy_toml('[[retention]]\nprefix = "a/"\n')


def test_durations() -> None:
    assert parse_duration("7d") == 7 * DAY
    assert parse_duration("12h") == 43200
    assert parse_duration("90") == 90
    assert parse_duration(30) == 30
    assert parse_duration("2w") == 14 * DAY
    assert parse_duration("forever") is None
    for bad in ("0d", "-1d", "7 days", True, 0):
        with pytest.raises(PolicyError):
            parse_duration(bad)


def test_longest_prefix_wins() -> None:
    policy = parse_rules(
        [
            {"prefix": "job", "keep_last": 1},
            {"prefix": "job42/", "keep_last": 5},
            {"prefix": "job42/eval", "keep_last": 2},
        ]
    )

    def prefix(name: str) -> str | None:
        rule = policy.rule_for(name)
        return None if rule is None else rule.prefix

    assert prefix("job1/step-1") == "job"
    assert prefix("job42/step-1") == "job42/"
    assert prefix("job42/eval-3/step-1") == "job42/eval"
    assert prefix("other/step-1") is None


def test_sequence_is_the_trailing_number() -> None:
    assert sequence_of("job/step-000040") == 40
    assert sequence_of("job/run2/step40") == 40
    assert sequence_of("job/final") is None
    assert sequence_of("job/step-40.pt") is None


# ---- deciding ------------------------------------------------------------------------------
def test_keep_last_3_every_4th_of_8() -> None:
    policy = Policy((Rule("job/", keep_last=3, keep_every=4),))
    decision = decide(policy, steps("job", 8), NOW)
    assert set(decision.kept) == names("job", 4, 6, 7, 8)
    assert decision.delete == tuple(sorted(names("job", 1, 2, 3, 5)))
    assert decision.kept["job/step-000008"] == (NEWEST, "last 3", "every 4th")
    assert decision.kept["job/step-000004"] == ("every 4th",)
    assert decision.archive == ()


def test_decision_is_stable_once_applied() -> None:
    """A second pass over what the first kept deletes nothing more: every Nth goes by the
    name's number, which deleting older checkpoints does not move."""
    policy = Policy((Rule("job/", keep_last=3, keep_every=4),))
    first = decide(policy, steps("job", 8), NOW)
    left = [c for c in steps("job", 8) if c.name in first.kept]
    again = decide(policy, left, NOW)
    assert again.delete == ()
    assert again.kept == first.kept


def test_the_newest_is_kept_with_keep_last_0() -> None:
    policy = Policy((Rule("job/", keep_last=0),))
    decision = decide(policy, steps("job", 5), NOW)
    assert decision.kept == {"job/step-000005": (NEWEST,)}
    assert len(decision.delete) == 4


def test_newest_goes_by_commit_time_not_by_number() -> None:
    """A job restarted from an older step commits step 3 after step 9: step 3 is newest."""
    policy = Policy((Rule("job/", keep_last=0),))
    checkpoints = [Committed("job/step-9", NOW - 60), Committed("job/step-3", NOW)]
    assert decide(policy, checkpoints, NOW).kept == {"job/step-3": (NEWEST,)}


def test_each_job_under_a_prefix_has_its_own_newest() -> None:
    policy = Policy((Rule("jobs/", keep_last=1),))
    decision = decide(policy, steps("jobs/a", 3) + steps("jobs/b", 2), NOW)
    assert set(decision.kept) == {"jobs/a/step-000003", "jobs/b/step-000002"}


def test_keep_every_for_expires() -> None:
    policy = Policy((Rule("job/", keep_last=1, keep_every=2, keep_every_for=DAY),))
    old = [Committed("job/step-2", NOW - 2 * DAY), Committed("job/step-4", NOW - DAY / 2)]
    decision = decide(policy, [*old, Committed("job/step-5", NOW)], NOW)
    assert decision.delete == ("job/step-2",)
    assert decision.kept["job/step-4"][0].startswith("every 2nd until ")


def test_being_read_is_kept() -> None:
    policy = Policy((Rule("job/", keep_last=1),))
    decision = decide(policy, steps("job", 4, reading={2}), NOW)
    assert decision.kept["job/step-000002"] == (BEING_READ,)
    assert set(decision.delete) == names("job", 1, 3)


def test_archive_every_waits_for_the_archive() -> None:
    policy = Policy((Rule("job/", keep_last=1, archive_every=2),))
    decision = decide(policy, steps("job", 5, archived={2}), NOW)
    # 4 must be archived and is not: kept and asked for; 2 is archived: it may go
    assert decision.archive == ("job/step-000004",)
    assert decision.kept["job/step-000004"] == (AWAITING_ARCHIVE,)
    assert set(decision.delete) == names("job", 1, 2, 3)


def test_archive_last_asks_for_the_newest() -> None:
    policy = Policy((Rule("job/", keep_last=0, archive_last=True),))
    decision = decide(policy, steps("job", 3), NOW)
    assert decision.archive == ("job/step-000003",)
    assert decision.kept["job/step-000003"] == (NEWEST, AWAITING_ARCHIVE)
    assert must_archive(policy.rules[0], "job/step-000003", newest=True)
    assert not must_archive(policy.rules[0], "job/step-000002", newest=False)


def test_a_name_without_a_number_is_kept_under_every_clauses() -> None:
    policy = Policy((Rule("job/", keep_last=1, keep_every=2),))
    checkpoints = [Committed("job/final", NOW - 120), *steps("job", 2)]
    decision = decide(policy, checkpoints, NOW)
    assert decision.kept["job/final"] == (NO_SEQUENCE,)
    assert decision.delete == ("job/step-000001",)


def test_names_under_no_rule_are_never_deleted() -> None:
    policy = Policy((Rule("job/", keep_last=0),))
    decision = decide(policy, steps("other", 3), NOW)
    assert decision.delete == ()
    assert set(decision.kept.values()) == {(NO_POLICY,)}


def test_kept_by_says_why() -> None:
    policy = Policy((Rule("job/", keep_last=2, keep_every=3),))
    shown = kept_by(policy, steps("job", 4) + steps("other", 1), NOW)
    assert shown == {
        "job/step-000001": "to delete",
        "job/step-000002": "to delete",
        "job/step-000003": "last 2, every 3rd",
        "job/step-000004": "newest, last 2",
        "other/step-000001": "no policy",
    }


# ---- the invariants, for any input ---------------------------------------------------------
_rules = st.builds(
    Rule,
    prefix=st.sampled_from(["j/", "j/a", "k/"]),
    keep_last=st.integers(0, 4),
    keep_every=st.integers(0, 4),
    keep_every_for=st.one_of(st.none(), st.floats(1, 10 * DAY)),
    archive_every=st.integers(0, 4),
    archive_last=st.booleans(),
)
_checkpoints = st.lists(
    st.builds(
        Committed,
        name=st.builds(
            lambda job, stem, n: f"{job}/{stem}{n if n is not None else ''}",
            st.sampled_from(["j", "j/a", "j/b", "k", "x"]),
            st.sampled_from(["step-", "s", "final"]),
            st.one_of(st.none(), st.integers(0, 40)),
        ),
        committed=st.floats(NOW - 20 * DAY, NOW),
        archived=st.booleans(),
        reading=st.booleans(),
    ),
    max_size=30,
    unique_by=lambda c: c.name,
)


@settings(max_examples=400, deadline=None)
@given(
    rules=st.lists(_rules, max_size=3, unique_by=lambda r: r.prefix),
    checkpoints=_checkpoints,
)
def test_never_deletes_what_must_stay(rules: list[Rule], checkpoints: list[Committed]) -> None:
    policy = Policy(tuple(rules))
    decision = decide(policy, checkpoints, NOW)
    deleted = set(decision.delete)
    everyone = {c.name for c in checkpoints}
    assert deleted.isdisjoint(decision.kept)
    assert deleted | set(decision.kept) == everyone
    assert all(decision.kept.values())
    assert set(decision.archive) <= set(decision.kept)
    assert len(deleted) == len(decision.delete)
    jobs: dict[tuple[str, str], list[Committed]] = {}
    for c in checkpoints:
        rule = policy.rule_for(c.name)
        if rule is None:
            assert c.name not in deleted  # no rule: never deleted
            continue
        jobs.setdefault((rule.prefix, c.name.rpartition("/")[0]), []).append(c)
        assert not (c.reading and c.name in deleted)  # being read
    for (prefix, _), group in jobs.items():
        rule = policy.rule_for(prefix)
        assert rule is not None
        newest = max(group, key=lambda c: (c.committed, c.name))
        assert newest.name not in deleted  # the newest of every job
        for c in group:
            if must_archive(rule, c.name, newest=c is newest) and not c.archived:
                assert c.name not in deleted  # must be archived first
                assert c.name in decision.archive


# ---- the cluster file ----------------------------------------------------------------------
def _cluster(**extra: object) -> dict[str, object]:
    nodes = [
        {"id": f"n{i}", "url": f"http://127.0.0.1:{7000 + i}", "peer": f"127.0.0.1:{8000 + i}"}
        for i in range(4)
    ]
    return {"auth": {"cluster_secret": "s3cret"}, "data": "/tmp/n0", "nodes": nodes, **extra}


def test_the_cluster_file_carries_the_policy() -> None:
    from storaged.config import check_file_document, config_from_document

    rules = [{"prefix": "job/", "keep_last": 2, "keep_every": 10, "keep_every_for": "7d"}]
    doc = _cluster(retention=rules, retention_interval=5)
    check_file_document(doc)
    config = config_from_document(doc, "n0")
    assert config.retention == Policy((Rule("job/", 2, 10, 7 * DAY),))
    assert config.retention_interval == 5.0
    assert config_from_document(_cluster(), "n0").retention == Policy()


def test_a_bad_rule_in_the_cluster_file_is_refused() -> None:
    from storaged.config import ConfigError, check_file_document, config_from_document

    doc = _cluster(retention=[{"prefix": "job/", "keep_last": 1, "keep_evry": 3}])
    for check in (check_file_document, lambda d: config_from_document(d, "n0")):
        with pytest.raises(ConfigError, match=r"\[\[retention\]\] entry 1: unknown key keep_evry"):
            check(doc)
