"""``storaged.manifest_schema``: one schema for server and client. A manifest that breaks
it is refused by both with the same words (the server's 400 ``bad_manifest`` message is
the client's ``InvalidManifest``); the server's limits come on top."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from storaged.client.layout import InvalidManifest, Manifest
from storaged.errors import BadInput
from storaged.ids import chunk_id_of
from storaged.manifest import check_manifest
from storaged.manifest_schema import ManifestLimits, SchemaError, check_schema

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
