"""``storaged.manifest_schema``: one schema for server and client. A manifest that breaks
it is refused by both with the same words (the server's 400 ``bad_manifest`` message is
the client's ``InvalidManifest``); the server's limits come on top."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storaged import manifest_schema
from storaged.client.layout import InvalidManifest, Manifest
from storaged.errors import BadInput
from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from storaged.manifest_schema import ManifestLimits, SchemaError, check_chunks, check_schema

CHUNK = chunk_id_of(b"x")


def _good() -> dict[str, Any]:
    item = {"key": "w", "dtype": "float32", "global_shape": [4, 4], "start": 0, "length": 32}
    return {
        "format": 1,
        "created": 1.0,
        "meta": {},
        "shards": [
            {
                "rank": 0,
                "chunks": [[CHUNK, 64]],
                "items": [
                    {**item, "offsets": [0, 0], "shape": [2, 4]},
                    {**item, "offsets": [2, 0], "shape": [2, 4], "start": 32},
                ],
            }
        ],
    }


def _item(change: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["shards"][0]["items"][1].update(change)


BROKEN: list[tuple[Callable[[dict[str, Any]], None], str]] = [
    (lambda d: d.update(format=2), "format must be 1, got 2"),
    (lambda d: d.update(created="x"), "created must be a finite non-negative number"),
    (lambda d: d.update(meta=[]), "meta must be a map"),
    (lambda d: d.update(shards={}), "shards must be a non-empty list"),
    (lambda d: d["shards"].append(copy.deepcopy(d["shards"][0])), "rank 0 appears twice"),
    (lambda d: d["shards"][0]["chunks"].append(["zz", 3]), "'zz' is not a chunk id"),
    (lambda d: d["shards"][0]["chunks"].append([CHUNK, 3]), "listed with two different sizes"),
    (lambda d: d["shards"][0].update(items=3), "shards[0].items must be a list"),
    (_item({"key": ""}), "shards[0].items[1].key must be a non-empty string"),
    (_item({"shape": [2]}), "shards[0].items[1]: global_shape, offsets and shape differ in rank"),
    (_item({"offsets": [3, 0]}), "shards[0].items[1]: dimension 0 spans 3+2 > global 4"),
    (_item({"start": 40}), "bytes [40, 72) lie outside its rank's stream of 64 bytes"),
    (_item({"length": 31}), "(w): float32[2, 4] needs 32 bytes, not 31"),
]


@pytest.mark.parametrize(("breaks", "words"), BROKEN)
def test_server_and_client_refuse_a_broken_manifest_in_the_same_words(
    breaks: Callable[[dict[str, Any]], None], words: str
) -> None:
    doc = _good()
    check_manifest(doc, 2**20)
    Manifest.from_wire(doc)
    breaks(doc)
    with pytest.raises(BadInput) as server:
        check_manifest(doc, 2**20)
    with pytest.raises(InvalidManifest) as client:
        Manifest.from_wire(doc)
    assert server.value.code == "bad_manifest"
    assert words in server.value.message
    assert str(client.value) == server.value.message


def test_the_server_limits_come_on_top_of_the_schema() -> None:
    limited: list[tuple[Callable[[dict[str, Any]], None], str]] = [
        (lambda d: d.update(extra=1), "unknown manifest field(s): ['extra']"),
        (lambda d: d.update(created=-1.0), "created must be a finite non-negative number"),
        (lambda d: d.update(shards=[]), "shards must be a non-empty list"),
        (
            _item(
                {
                    "dtype": "bfloat16",
                    "global_shape": [1] * 65,
                    "offsets": [0] * 65,
                    "shape": [1] * 65,
                }
            ),
            "global_shape must be a list of at most 64 integers",
        ),
        (lambda d: d["shards"][0]["chunks"][0].__setitem__(1, 2**21), "over the max chunk size"),
    ]
    for breaks, words in limited:
        doc = _good()
        breaks(doc)
        check_schema(doc)  # the schema alone lets it through: the client reads it
        with pytest.raises(SchemaError, match=re.escape(words)):
            check_schema(doc, ManifestLimits(max_chunk_size=2**20))


# A valid id (hex), an id of the wrong form, and values of the wrong type for each field:
# what a bad or hostile manifest may hold anywhere.
_ODD_VALUES: list[Any] = [
    -1, 0, 1, 2**62, 2**62 + 1, True, 1.5, "", "w", "a" * 64, "A" * 64, "é" * 64, CHUNK,
    [], [1], [CHUNK, 64], (CHUNK, 64), [CHUNK, 64, 1], {}, {"key": "w"}, None,
]  # fmt: skip


def _paths(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a document a value sits (map values and list entries)."""
    found = [path]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += _paths(value, (*path, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            found += _paths(value, (*path, index))
    return found


LIMITS = ManifestLimits(max_chunk_size=2**20, max_dims=2)


def _verdict(doc: Any) -> Any:
    try:
        fields = check_schema(doc, LIMITS)
    except SchemaError as exc:
        return str(exc)
    return fields


def _verdict_on_read(doc: Any) -> Any:
    """``check_schema(chunks_on_read=True)``, then every shard's chunks as a reader checks
    them: the shards' fields as the full check gives them, or a message."""
    try:
        fields = check_schema(doc, LIMITS, chunks_on_read=True)
        return [
            (s.rank, s.items, check_chunks(s.unchecked_chunks, f"shards[{i}]", LIMITS))
            if s.unchecked_chunks is not None
            else (s.rank, s.items, s.chunks)
            for i, s in enumerate(fields.shards)
        ]
    except SchemaError as exc:
        return str(exc)


def _a_document_with_repeats() -> dict[str, Any]:
    doc = _good()
    other = chunk_id_of(b"y")
    doc["shards"][0]["chunks"] = [[CHUNK, 32], [other, 16], [CHUNK, 32]]  # 80 bytes
    second = copy.deepcopy(doc["shards"][0])
    second["rank"] = 1
    second["chunks"] = [[other, 16], [chunk_id_of(b"z"), 64]]
    doc["shards"].append(second)
    return doc


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_whole_list_checks_and_the_entry_by_entry_check_agree(data: st.DataObject) -> None:
    """A shard is checked in whole-list passes first and entry by entry when one fails: the
    verdict (the fields, or the message) is the entry-by-entry check's, whatever is broken."""
    doc = _a_document_with_repeats()
    for _ in range(data.draw(st.integers(0, 2))):
        path = data.draw(st.sampled_from(_paths(doc)[1:]))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = copy.deepcopy(data.draw(st.sampled_from(_ODD_VALUES)))
    fast = _verdict(doc)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest_schema, "_chunks_at_once", lambda *_: None)
        patch.setattr(manifest_schema, "_items_at_once", lambda *_: None)
        slow = _verdict(doc)
    assert fast == slow
    if not isinstance(fast, str):
        assert list(fast.chunks.items()) == list(slow.chunks.items())  # first-seen order
    # Chunks checked when read: the same shards, or refused all the same (but for an id
    # two shards list with two sizes, which is not looked for there)
    on_read = _verdict_on_read(doc)
    if isinstance(fast, str):
        assert isinstance(on_read, str) or "listed with two different sizes" in fast
    else:
        assert on_read == [(s.rank, s.items, s.chunks) for s in fast.shards]


def test_an_id_repeated_within_and_across_shards_keeps_its_one_size() -> None:
    fields = check_schema(_a_document_with_repeats())
    assert list(fields.chunks.values()) == [32, 16, 64]
    assert fields.shards[0].chunks[2] == (CHUNK, 32)
    broken = _a_document_with_repeats()
    broken["shards"][1]["chunks"][0][1] = 17
    with pytest.raises(SchemaError, match="listed with two different sizes"):
        check_schema(broken)
