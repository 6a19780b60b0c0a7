"""A storaged node that answers chunk GETs the old way, with ``web.Response(body=...)``.

``python -m loadtest.harness.response_node serve ...`` takes ``storaged serve``'s
arguments; ``LocalCluster(node_module=RESPONSE_NODE)`` starts a cluster of such nodes. The
product sends a chunk's body as a view after the head (``storaged.front.http._send_body``):
``web.Response`` makes aiohttp join head and body into one new ``bytes`` on Python
< 3.12.9, a copy of the whole chunk per GET. This variant is that old path, kept as the
baseline of ``loadtest.nodesend`` and as the reference answer of
``tests/service/test_get_send.py``: it lives here so that the product carries no switch
for it. Everything else is the product's node, unchanged.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from storaged import cli
from storaged.front import http as server

#: ``LocalCluster.node_module`` of a node of this kind
RESPONSE_NODE = "loadtest.harness.response_node"
#: what such a node logs (once, at WARNING) when it answers its first GET this way
ANSWERED = "chunk GETs answered with web.Response (loadtest.harness.response_node)"

log = logging.getLogger("loadtest.response_node")
_answered = False


async def send_by_response(
    request: web.Request, body: memoryview, status: int, headers: dict[str, str]
) -> web.StreamResponse:
    """What ``storaged.front.http._send_body`` sends, the old way."""
    global _answered
    if not _answered:
        _answered = True
        log.warning(ANSWERED)
    return web.Response(
        body=body, status=status, headers=headers, content_type="application/octet-stream"
    )


def main(argv: Sequence[str] | None = None) -> int:
    # The one difference from `storaged serve`: the handlers look the sender up when they
    # run, so replacing it before the app starts changes every chunk GET of this process.
    server._send_body = send_by_response
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
