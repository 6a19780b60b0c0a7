"""``storaged.wire``: the one ordering of states (ranks from 1, as the state log persists
them), the byte range the client and the DCP adapter use, and the one vocabulary of error
codes (checked by reading the sources, as ``test_loadtest_imports`` reads imports)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import TypeVar

import msgpack
import pytest

from storaged import client, wire
from storaged.node import index
from tiers import base as tier_base


def test_states_rank_from_one_in_order_for_server_and_client() -> None:
    assert wire.STATES == ("memory", "nvme", "cold")
    assert [wire.state_rank(s) for s in wire.STATES] == [1, 2, 3]
    assert [wire.state_name(r) for r in (1, 2, 3)] == list(wire.STATES)
    assert tuple(wire.ChunkState) == (index.MEMORY, index.NVME, index.COLD)
    # what the state log packs stays a plain int
    assert all(type(r) is int for r in (index.MEMORY, index.NVME, index.COLD))
    assert wire.state_at_least("cold", "nvme") and wire.state_at_least("nvme", "nvme")
    assert not wire.state_at_least("memory", "nvme")


@pytest.mark.parametrize("bad", ["", "Memory", "ram", "hot"])
def test_an_unknown_state_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown durability level"):
        wire.state_rank(bad)
    with pytest.raises(ValueError):
        wire.state_at_least("cold", bad)


def test_the_client_exports_the_wire_range_with_the_tiers_semantics() -> None:
    assert client.ByteRange is wire.ByteRange and client.STATES is wire.STATES
    for start, end in [(0, None), (3, 7), (10, 10), (0, 10)]:
        assert wire.ByteRange(start, end).resolve(10) == tier_base.ByteRange(start, end).resolve(10)
    for start, end in [(-1, 3), (5, 4), (0, 11), (11, None)]:
        with pytest.raises(wire.InvalidRange, match="outside value of 10 bytes"):
            wire.ByteRange(start, end).resolve(10)
        with pytest.raises(tier_base.InvalidRange, match="outside value of 10 bytes"):
            tier_base.ByteRange(start, end).resolve(10)


# --- error codes: one vocabulary, found by reading the sources ----------------------------

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
#: callables whose first argument is an error code (server kinds, the peer protocol's)
_CODE_FIRST = {
    "StoragedError", "BadInput", "NotFound", "Conflict", "TooLarge", "Unavailable",
    "InsufficientStorage", "unavailable", "PeerError", "_error_header", "_refuse_and_close",
}  # fmt: skip


def _literal(node: ast.expr | None) -> list[str]:
    """The string constants ``node`` may be (``a if c else "b"`` may be either)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _literal(node.body) + _literal(node.orelse)
    return []


def codes_in(source: str) -> set[str]:
    """Every error code written as a literal in ``source``: the code argument of an error
    kind, ``ApiError(status, code, ...)``, ``bad_request(..., code=...)``, a ``code=``
    keyword, and the ``"error"`` of a dict literal."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in _CODE_FIRST and node.args:
                found.update(_literal(node.args[0]))
            elif (name == "ApiError" and len(node.args) > 1) or (
                name == "bad_request" and len(node.args) > 1
            ):
                found.update(_literal(node.args[1]))
            for keyword in node.keywords:
                if keyword.arg == "code":
                    found.update(_literal(keyword.value))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "error":
                    found.update(_literal(value))
    return found


def test_the_code_finder_finds_codes() -> None:
    source = (
        'raise BadInput("bad_name", "x")\nraise ApiError(404, "chunk_not_found", "y")\n'
        'bad_request("z", code="bad_range")\nPeerError("a" if c else "b", m)\n'
        'reply({"error": "exists", "message": m})\nraise TooLarge(code, "not a literal")\n'
    )
    assert codes_in(source) == {"bad_name", "chunk_not_found", "bad_range", "a", "b", "exists"}


def test_every_error_code_the_product_writes_is_in_the_vocabulary() -> None:
    sources = sorted((REPO / "storaged").rglob("*.py"))
    found = {code: path for path in sources for code in codes_in(path.read_text())}
    # a real scan: codes of the server, the peer protocol, shared memory and the client
    assert {"memory_full", "unknown_method", "seal_refused", "cold_full"} <= set(found)
    assert len(found) > 30
    vocabulary = {str(code) for code in wire.ErrorCode}
    assert {c: str(p.relative_to(REPO)) for c, p in found.items() if c not in vocabulary} == {}


def test_the_client_exceptions_and_the_server_status_table_use_the_vocabulary() -> None:
    from storaged.client import errors
    from storaged.front import http as server

    kinds: list[type[errors.StoragedError]] = [errors.StoragedError]
    kinds += _subclasses(errors.StoragedError)
    assert len(kinds) > 25
    assert all(isinstance(kind.default_code, wire.ErrorCode) for kind in kinds)
    assert all(isinstance(code, wire.ErrorCode) for code in server._STATUS_CODES.values())
    # a code is still a plain string on an exception and in a document
    exc = errors.ChunkNotFound()
    assert type(exc.code) is str and exc.code == "chunk_not_found"
    assert json.dumps({"error": wire.ErrorCode.TOO_LARGE}) == '{"error": "too_large"}'
    assert msgpack.packb(wire.ErrorCode.TOO_LARGE) == msgpack.packb("too_large")


def _subclasses(cls: type[T]) -> list[type[T]]:
    found: list[type[T]] = []
    for direct in cls.__subclasses__():
        found += [direct, *_subclasses(direct)]
    return found
