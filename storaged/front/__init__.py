"""The node's two front ends side by side: HTTP (``http.py``, the API of docs/API.md) and
shared memory (``shm.py``, the co-located fast path over a Unix socket)."""
