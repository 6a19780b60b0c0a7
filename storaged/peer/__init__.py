"""The peer protocol: node-to-node chunk replication and small RPCs over raw TCP.

Why not HTTP: replication is the hot path of the ack (every PUT crosses two peer
hops). A raw ``asyncio.BufferedProtocol`` receives each chunk body straight into
the memory tier's preallocated buffer and costs about a third of aiohttp's CPU
per byte here. The client side of the HTTP API stays aiohttp.

One module per part:

- ``wire``: the format (frames, headers, the authentication handshake, requests and
  replies, documented there), its codec, the proofs, and the errors (``PeerError``);
- ``framing``: frames read and written over ``storaged.transport.BodyProtocol``, the
  receive core the client's direct chunk GETs run on too;
- ``handler``: ``PeerHandler``, what the server calls, and its buffer-ownership contract
  (a put's body goes into a ``BodyBuffer`` the handler lends: ``LentBuffer`` at its plainest);
- ``server``: ``PeerServer``; ``client``: ``PeerClient`` and ``PutStream``.

Every name other modules use is importable from here; the format's other constants
from ``wire``.
"""

from storaged.peer.client import PeerClient, PutStream
from storaged.peer.handler import BodyBuffer, LentBuffer, PeerHandler
from storaged.peer.server import PeerServer
from storaged.peer.wire import MAX_HEADER, Addr, PeerError, PeerUnavailable

__all__ = [
    "MAX_HEADER",
    "Addr",
    "BodyBuffer",
    "LentBuffer",
    "PeerClient",
    "PeerError",
    "PeerHandler",
    "PeerServer",
    "PeerUnavailable",
    "PutStream",
]
