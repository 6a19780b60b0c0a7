"""Where the coordinator is: ``etcd://host:port[,host:port...][/prefix]`` (no client
import here, so that configuration checks work without the ``etcd`` extra)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ENDPOINT = re.compile(r"[A-Za-z0-9.\-]+:\d{1,5}|\[[0-9A-Fa-f:]+\]:\d{1,5}")


@dataclass(frozen=True, slots=True)
class EtcdTarget:
    endpoints: tuple[str, ...]
    root: str


def parse_etcd_url(url: str) -> EtcdTarget:
    """``etcd://host:port[,host:port...][/root]`` -> endpoints and key root.

    Raises ``ValueError`` saying what to write instead."""
    if not url.startswith("etcd://"):
        raise ValueError(f"{url!r}: write etcd://host:port[,host:port...][/prefix]")
    rest = url[len("etcd://") :]
    hosts, slash, path = rest.partition("/")
    endpoints = tuple(h.strip() for h in hosts.split(",") if h.strip())
    if not endpoints:
        raise ValueError(f"{url!r} names no endpoint: write etcd://host:port[,host:port...]")
    for e in endpoints:
        if not _ENDPOINT.fullmatch(e) or not 0 < int(e.rpartition(":")[2]) < 65536:
            raise ValueError(f"{url!r}: endpoint {e!r} is not host:port")
    root = "/" + path.strip("/") if slash and path.strip("/") else "/storaged"
    if "#" in root:
        raise ValueError(f"{url!r}: the key prefix may not contain '#'")
    return EtcdTarget(endpoints, root)
