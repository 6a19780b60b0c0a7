"""A thin HTTP helper for the service tests: msgpack in and out, the test token by default."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack

from storaged.ids import chunk_id_of


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def doc(self) -> Any:
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            import json

            return json.loads(self.raw)
        return msgpack.unpackb(self.raw, raw=False)

    @property
    def error(self) -> str:
        return str(self.doc["error"])


class Api:
    def __init__(self, session: aiohttp.ClientSession, url: str, token: str | None) -> None:
        self.session = session
        self.url = url
        self.token = token

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        h.update(extra or {})
        return h

    async def request(
        self,
        method: str,
        path: str,
        *,
        data: bytes | None = None,
        doc: Any = None,
        headers: dict[str, str] | None = None,
        url: str | None = None,
    ) -> Reply:
        extra = dict(headers or {})
        if doc is not None:
            data = msgpack.packb(doc, use_bin_type=True)
            extra.setdefault("Content-Type", "application/msgpack")
        async with self.session.request(
            method,
            (url or self.url) + path,
            data=data,
            headers=self._headers(extra),
            timeout=aiohttp.ClientTimeout(total=60),
        ) as resp:
            raw = await resp.read()
            return Reply(resp.status, dict(resp.headers), raw)

    async def put_chunk(self, data: bytes, url: str | None = None) -> Reply:
        return await self.request("PUT", f"/v1/chunks/{chunk_id_of(data)}", data=data, url=url)

    async def get_chunk(self, cid: str, url: str | None = None, **kw: Any) -> Reply:
        return await self.request("GET", f"/v1/chunks/{cid}", url=url, **kw)

    async def commit(self, name: str, manifest: Any, url: str | None = None) -> Reply:
        return await self.request("PUT", f"/v1/checkpoints/{name}", doc=manifest, url=url)

    async def wait_state(self, name: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
        """Poll ``?status`` until the checkpoint reaches ``state`` (bounded)."""
        order = ["memory", "nvme", "cold"]
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            r = await self.request("GET", f"/v1/checkpoints/{name}?status")
            if r.status == 200:
                last = r.doc
                if order.index(last["state"]) >= order.index(state):
                    return last
            import asyncio

            await asyncio.sleep(0.2)
        raise AssertionError(f"{name} did not reach {state} in {timeout}s: {last}")


def random_chunk(size: int) -> bytes:
    return os.urandom(size)


def manifest_for(chunks: list[bytes], *, created: float = 1764403200.0) -> dict[str, Any]:
    """A one-rank manifest whose stream is the chunks, with one uint8 item spanning it all."""
    total = sum(len(c) for c in chunks)
    return {
        "format": 1,
        "created": created,
        "meta": {"step": 1},
        "shards": [
            {
                "rank": 0,
                "chunks": [[chunk_id_of(c), len(c)] for c in chunks],
                "items": [
                    {
                        "key": "blob",
                        "dtype": "uint8",
                        "global_shape": [total],
                        "offsets": [0],
                        "shape": [total],
                        "start": 0,
                        "length": total,
                    }
                ],
            }
        ],
    }
