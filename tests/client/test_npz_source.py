"""``.npz`` archives read as ``storaged save`` reads them, against ``np.load``.

- Any mix of arrays (C and Fortran order, byte-swapped, empty, scalars, complex, bool),
  stored or deflated, streamed through ``_stream_reader`` at any chunk size, gives each
  item's C-ordered native bytes exactly, with reorder blocks far smaller than an array so
  that the blocked reorder of Fortran arrays crosses many blocks.
- Members that are not ``.npy`` are kept whole; a damaged stored member fails its CRC-32;
  arrays of objects are refused, saying why.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storaged.client import formats
from storaged.client.format_names import FormatError
from storaged.client.formats import open_npz
from storaged.client.layout import pack_stream
from storaged.client.streaming import _stream_reader


def _streamed(path: Path, chunk_size: int) -> dict[str, bytes]:
    """Each item's bytes as the saver's stream holds them."""
    source = open_npz(path)
    try:
        fill, starts = _stream_reader(source, chunk_size)
        layout = pack_stream([item.nbytes for item in source.items], chunk_size)
        stream = bytearray(layout.size)
        buffer = np.empty(chunk_size, dtype=np.uint8)
        for offset, size in layout.chunks:
            assert fill(buffer.data) == size
            stream[offset : offset + size] = buffer[:size].tobytes()
        assert fill(buffer.data) == 0
        return {
            item.key: bytes(stream[start : start + item.nbytes])
            for item, start in zip(source.items, starts, strict=True)
        }
    finally:
        source.close()


_DTYPES = ["<f4", ">f4", "<i8", ">i8", ">u2", "|u1", "|b1", ">c16", "<c8", ">f2"]


@st.composite
def _arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
    n = int(np.prod(shape))
    raw = np.random.default_rng(n * 31 + len(shape)).integers(0, 256, n * dtype.itemsize)
    array = raw.astype(np.uint8).view(dtype).reshape(shape)
    if dtype.kind == "b":
        array = array.view(np.uint8) % 2 == 1
    if draw(st.booleans()):
        array = np.asfortranarray(array)
    return array


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrays=st.lists(_arrays(), min_size=1, max_size=5),
    compressed=st.booleans(),
    chunk_size=st.sampled_from([1, 5, 8, 64, 1000]),
    budget=st.sampled_from([1, 24, 100, 1 << 20]),
)
def test_every_array_streams_as_its_c_ordered_native_bytes(
    tmp_path_factory: pytest.TempPathFactory,
    arrays: list[np.ndarray[Any, Any]],
    compressed: bool,
    chunk_size: int,
    budget: int,
) -> None:
    path = tmp_path_factory.mktemp("npz") / "a.npz"
    named = {f"a{i}": a for i, a in enumerate(arrays)}
    save: Any = np.savez_compressed if compressed else np.savez
    save(path, **named)
    with (
        mock.patch.object(formats, "_REORDER_BUDGET", budget),
        mock.patch.object(formats, "_SPAN_READ", max(budget, 16)),
    ):
        got = _streamed(path, chunk_size)
    source = open_npz(path)
    dtypes = {item.key: (item.dtype, item.shape) for item in source.items}
    source.close()
    assert sorted(got) == sorted(named)
    for key, want in named.items():
        native = np.ascontiguousarray(want, dtype=want.dtype.newbyteorder("="))
        assert dtypes[key] == (native.dtype.name, want.shape), key
        assert got[key] == native.tobytes(), (key, want.dtype, want.shape, want.flags.f_contiguous)


def test_a_large_fortran_array_reorders_in_blocks(tmp_path: Path) -> None:
    """Rows of a few KiB read one run per column, and columns narrower than the gap
    threshold read across: both ways give the C-ordered bytes."""
    rng = np.random.default_rng(5)
    tall = np.asfortranarray(rng.standard_normal((3000, 40)).astype(">f8"))  # runs
    wide = np.asfortranarray(rng.integers(0, 9, (3, 50_000), dtype=np.int32))  # across
    path = tmp_path / "f.npz"
    np.savez(path, tall=tall, wide=wide)
    with mock.patch.object(formats, "_REORDER_BUDGET", 64 << 10):
        got = _streamed(path, 100_003)
    assert got["tall"] == np.ascontiguousarray(tall, dtype="<f8").tobytes()
    assert got["wide"] == np.ascontiguousarray(wide).tobytes()


def test_other_members_are_kept_and_damage_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "m.npz"
    np.savez(path, x=np.arange(1000, dtype=np.float32))
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("notes/README.txt", b"trained on a Tuesday")
        archive.writestr("empty.bin", b"")
    got = _streamed(path, 64)
    assert got["file:notes/README.txt"] == b"trained on a Tuesday"
    assert got["file:empty.bin"] == b""
    assert got["x"] == np.arange(1000, dtype=np.float32).tobytes()

    # One flipped byte in the stored array's data: its CRC-32 says so, as a FormatError.
    data = bytearray(path.read_bytes())
    at = data.index(np.arange(1000, dtype=np.float32)[500:501].tobytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="CRC-32 does not match"):
        _streamed(path, 64)
    # The same damage in a Fortran array is caught before any of it is read.
    f = tmp_path / "f.npz"
    np.savez(f, y=np.asfortranarray(np.arange(20_000, dtype=np.int32).reshape(200, 100)))
    data = bytearray(f.read_bytes())
    data[data.index(np.int32(19_000).tobytes())] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="CRC-32 does not match"):
        open_npz(f)


def test_objects_strings_and_odd_members_are_refused(tmp_path: Path) -> None:
    objects = tmp_path / "o.npz"
    np.savez(objects, o=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(FormatError, match=r"Python objects .* never runs"):
        open_npz(objects)
    bzip = tmp_path / "b.npz"
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.arange(3))
    with zipfile.ZipFile(bzip, "w", zipfile.ZIP_BZIP2) as archive:
        archive.writestr("x.npy", buffer.getvalue())
    with pytest.raises(FormatError, match="stored and deflated"):
        open_npz(bzip)
    twice = tmp_path / "t.npz"
    with zipfile.ZipFile(twice, "w") as archive, pytest.warns(UserWarning):
        archive.writestr("x.npy", buffer.getvalue())
        archive.writestr("x.npy", buffer.getvalue())
    with pytest.raises(FormatError, match="'x' twice"):
        open_npz(twice)
    lying = tmp_path / "l.npz"
    header = io.BytesIO()
    np.lib.format.write_array(header, np.arange(3))
    with zipfile.ZipFile(lying, "w") as archive:
        archive.writestr("x.npy", header.getvalue()[:-8])  # a header for 3, data for 2
    with pytest.raises(FormatError, match="holds 16 bytes of data, its header says 24"):
        open_npz(lying)
