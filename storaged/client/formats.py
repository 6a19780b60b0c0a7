"""The file formats ``storaged save`` reads and ``storaged restore`` writes, piece by piece.

A file is opened as a ``Source``: its items (key, dtype, shape, size) and, for
each, a function that copies any byte range of the item into a buffer. Nothing
is read before the saver asks for it, so a file of any size is saved with the
memory of the chunks in flight. The readers:

- ``.safetensors``: the header is parsed here (it is JSON behind a length), the
  tensor bytes are read with ``pread``; no library is needed, bfloat16 and
  float8 included. A directory of shards with a ``*.safetensors.index.json`` (as
  Hugging Face writes them) is one source whose items come from every shard.
- ``.npz``: each member's ``.npy`` header is read, then its bytes are streamed:
  a stored member's with ``pread`` straight into the chunk buffer (its CRC-32
  checked on the way), a deflated one's through ``zipfile``. A byte-swapped array
  is swapped piece by piece; a Fortran-ordered one is put in C order in blocks of
  rows (``_FortranReader``). Members that are not ``.npy`` are kept as bytes.
- torch (``.pt``, ``.pth``, ``.bin`` such as ``pytorch_model.bin``):
  ``torch.load(weights_only=True, mmap=True)``; the pages read are handed back
  to the kernel after each copy, so the mapping does not grow resident. A file
  whose loading needs a full unpickle is refused: it can run arbitrary code.
- ``raw``: any bytes (a file or stdin) as one ``uint8`` item named ``data``.

Writers take the restored items in manifest order, each as consecutive row
blocks, and write them as they come: ``.safetensors`` and ``.npz`` need only the
manifest to lay out the file, so they stream (to stdout too); torch files are
written by ``torch.save`` from whole arrays.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import math
import os
import pickle
import re
import shutil
import struct
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Final

import numpy as np

from storaged.client.checkpoint import packed_value
from storaged.client.format_names import (
    FormatError,
    MissingLibrary,
    clean_message,
)
from storaged.client.layout import DCP_BYTES_DTYPE, MSGPACK_DTYPE, VALUE_DTYPES

#: Element types numpy lacks, and the same-width integer type their bytes are held in.
STORAGE_DTYPES: Final[Mapping[str, type[np.generic]]] = {
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
}

#: safetensors dtype codes -> the dtype names manifests use.
SAFETENSORS_DTYPES: Final[Mapping[str, str]] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
_SAFETENSORS_CODES: Final = {name: code for code, name in SAFETENSORS_DTYPES.items()}

_SAFETENSORS_MAX_HEADER = 100 << 20


def import_torch(why: str) -> ModuleType:
    try:
        import torch
    except ImportError:
        raise MissingLibrary(f"{why}: that needs PyTorch (pip install torch)") from None
    return torch


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True, slots=True)
class SourceItem:
    """An item of a source: ``read(offset, into)`` fills ``into`` with its bytes from there."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    read: Callable[[int, memoryview], None]


@dataclass
class Source:
    """An opened input: its items in file order, the manifest ``meta`` it implies, and what
    ``close`` releases. Reads are made from one thread at a time."""

    items: list[SourceItem]
    meta: dict[str, Any]
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(OSError):
                close()
        self.closers.clear()


def _pread_all(fd: int, into: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            raise FormatError(f"{what}: file ended early (truncated while being read?)")
        done += n


def _value_item(key: str, value: Any) -> SourceItem:
    encoded = packed_value(key, value, instead="a tensor", error=FormatError)

    def read(offset: int, into: memoryview) -> None:
        into[:] = encoded[offset : offset + len(into)]

    return SourceItem(key, MSGPACK_DTYPE, (), len(encoded), read)


def _array_read(flat: np.ndarray[Any, Any]) -> Callable[[int, memoryview], None]:
    data = flat.reshape(-1).view(np.uint8)

    def read(offset: int, into: memoryview) -> None:
        into[:] = data[offset : offset + len(into)].data

    return read


def _itemsize(dtype: str) -> int:
    if dtype in STORAGE_DTYPES:
        return np.dtype(STORAGE_DTYPES[dtype]).itemsize
    return np.dtype(dtype).itemsize


# ---- safetensors


@dataclass(frozen=True, slots=True)
class _Tensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _safetensors_header(fd: int, size: int, what: str) -> tuple[list[_Tensor], dict[str, str], int]:
    """(tensors in file order, metadata, where the data starts); ``FormatError`` if malformed."""
    bad = f"{what}: not a readable .safetensors file"
    if size < 8:
        raise FormatError(f"{bad}: {size} bytes, shorter than its header length")
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > min(size - 8, _SAFETENSORS_MAX_HEADER):
        raise FormatError(f"{bad}: header of {length} bytes in a file of {size}")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{bad}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{bad}: header is not a JSON object")
    data_start = 8 + length
    raw_meta = header.pop("__metadata__", None) or {}
    if not isinstance(raw_meta, dict):
        raise FormatError(f"{bad}: __metadata__ is not an object")
    tensors = []
    for key, entry in header.items():
        try:
            code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(d) for d in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{bad}: entry {key!r} is malformed ({exc!r})") from None
        dtype = SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise FormatError(f"{what}: {key} is of dtype {code}, which cannot be saved")
        want = math.prod(shape) * _itemsize(dtype)
        if min(shape, default=0) < 0 or end - begin != want or begin < 0:
            raise FormatError(f"{bad}: {key} spans [{begin}, {end}), not {want} bytes")
        if data_start + end > size:
            raise FormatError(f"{bad}: {key} ends past the end of the file (truncated?)")
        tensors.append(_Tensor(key, dtype, shape, begin, end))
    tensors.sort(key=lambda t: t.begin)
    return tensors, {str(k): str(v) for k, v in raw_meta.items()}, data_start


def _open_fd(path: Path) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if Path(path).is_dir():
            raise IsADirectoryError(21, "Is a directory")
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _safetensors_items(
    path: Path, source: Source
) -> tuple[list[SourceItem], dict[str, str], SourceItem | None]:
    """The tensors of a file, its metadata, and its header (length prefix included) as an
    item when the tensors fill the rest of the file back to back (else None)."""
    fd, size = _open_fd(path)
    source.closers.append(lambda: os.close(fd))
    tensors, metadata, data_start = _safetensors_header(fd, size, str(path))
    items = []
    end = 0
    for t in tensors:

        def read(offset: int, into: memoryview, base: int = data_start + t.begin) -> None:
            _pread_all(fd, into, base + offset, str(path))

        items.append(SourceItem(t.key, t.dtype, t.shape, t.end - t.begin, read))
        end = end if t.begin != end else t.end
    header = None
    if data_start + end == size:
        header = _bytes_item(HEADER_PREFIX + path.name, fd, 0, data_start, str(path))
    return items, metadata, header


def _metadata_values(path: Path, metadata: dict[str, str]) -> list[SourceItem]:
    """The non-tensor values a restore kept in the metadata (``VALUES_METADATA_KEY``, taken
    out of ``metadata``), as value items again."""
    text = metadata.pop(VALUES_METADATA_KEY, None)
    if text is None:
        return []
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise FormatError(
            f"{path}: {VALUES_METADATA_KEY} in its metadata is not JSON ({exc})"
        ) from None
    if not isinstance(values, dict):
        raise FormatError(f"{path}: {VALUES_METADATA_KEY} in its metadata is not a JSON object")
    return [_value_item(str(key), value) for key, value in values.items()]


def open_safetensors(path: Path) -> Source:
    """A ``.safetensors`` file, or a directory of shards (``_open_shard_directory``)."""
    source = Source([], {})
    try:
        if path.is_dir():
            _open_shard_directory(path, source)
            return source
        items, metadata, _ = _safetensors_items(path, source)
        source.items = items + _metadata_values(path, metadata)
        if metadata:
            source.meta["safetensors_metadata"] = metadata
        return source
    except BaseException:
        source.close()
        raise


#: key prefixes of the items a shard directory's checkpoint holds besides its tensors:
#: a shard's header as it was (so that the shard comes back byte for byte), and every
#: other file of the directory, whole (config.json, tokenizer files, the index...)
HEADER_PREFIX: Final = "header:"
FILE_PREFIX: Final = "file:"


def _bytes_item(key: str, fd: int, offset: int, size: int, what: str) -> SourceItem:
    def read(at: int, into: memoryview) -> None:
        _pread_all(fd, into, offset + at, what)

    return SourceItem(key, "uint8", (size,), size, read)


def _directory_files(path: Path) -> list[str]:
    """Every regular file under ``path`` (symlinks to files followed, to directories not),
    relative, sorted."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in files:
            full = Path(root) / name
            if full.is_file():
                found.append(full.relative_to(path).as_posix())
    return sorted(found)


def _open_shard_directory(path: Path, source: Source) -> None:
    """A directory of safetensors shards (a Hugging Face model), whole: each shard's tensors
    as items (chunked and deduplicated like any), preceded by the shard's header as it was
    when its tensors fill the rest of it, and every other file (the index, config.json,
    tokenizer files...) as one ``uint8`` item. ``meta["safetensors_shards"]`` says how to
    lay them out again (``DirectoryWriter``)."""
    indexes = sorted(path.glob("*.safetensors.index.json"))
    index: dict[str, Any] = {}
    if indexes:
        try:
            index = json.loads(indexes[0].read_text())
            shard_names = list(dict.fromkeys(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{indexes[0]}: not a readable shard index ({exc!r})") from None
    else:
        shard_names = sorted(p.name for p in path.glob("*.safetensors"))
    if not shard_names:
        raise FormatError(f"{path}: a directory without .safetensors shards")
    seen: dict[str, str] = {}
    first_meta: dict[str, str] = {}
    headers: list[str] = []
    for name in shard_names:
        items, metadata, header = _safetensors_items(path / name, source)
        if header is not None:
            # The tensors fill the file after the header (as every writer lays them out):
            # keep the header's bytes, and the shard comes back identical.
            source.items.append(header)
            headers.append(name)
        first_meta = first_meta or metadata
        for item in items:
            if item.key in seen:
                raise FormatError(f"{path}: {item.key} is in both {seen[item.key]} and {name}")
            if item.key.startswith((HEADER_PREFIX, FILE_PREFIX)):
                raise FormatError(f"{path}: a tensor named {item.key!r} cannot be saved here")
            seen[item.key] = name
        source.items.extend(items)
    files = [rel for rel in _directory_files(path) if rel not in set(shard_names)]
    for rel in files:
        fd, size = _open_fd(path / rel)
        source.closers.append(lambda fd=fd: os.close(fd))  # type: ignore[misc]
        source.items.append(_bytes_item(FILE_PREFIX + rel, fd, 0, size, str(path / rel)))
    source.meta["safetensors_shards"] = {
        "index": indexes[0].name if indexes else None,
        "metadata": index.get("metadata") if isinstance(index, dict) else None,
        "weight_map": seen,
        "shards": shard_names,
        "headers": headers,
        "files": files,
    }
    if first_meta:
        source.meta["safetensors_metadata"] = first_meta


# ---- npz

#: bytes of whole rows a Fortran-ordered array is put in C order at a time (at least a row)
_REORDER_BUDGET: Final = 8 << 20
#: bytes read at once when a reorder reads whole columns, and by a checksum pass
_SPAN_READ: Final = 4 << 20
#: a gap between the runs a reorder needs that is read across rather than skipped by one
#: read per run (a few KiB of memory bandwidth beat a system call)
_READ_ACROSS: Final = 4096
_LOCAL_HEADER: Final = struct.Struct("<4s22xHH")  # signature, ..., name and extra lengths

#: ``read(offset, into)``: fill ``into`` with an item's (or a member's) bytes from there
Reader = Callable[[int, memoryview], None]


class _StoredMember:
    """A stored (uncompressed) member's data, read straight from the archive with ``pread``
    into the caller's buffer, as safetensors tensors are. Its CRC-32 (which covers the
    ``.npy`` header ``head`` too) is checked as the bytes pass in order: a damaged archive
    fails the save before anything is committed."""

    def __init__(self, fd: int, base: int, size: int, crc: int, head: bytes, what: str) -> None:
        self._fd, self._base, self._size, self._what = fd, base, size, what
        self._want, self._crc = crc, zlib.crc32(head)
        #: bytes checksummed so far; None once a read went out of order (none does: the
        #: saver reads every item once, front to back)
        self._pos: int | None = 0
        if size == 0:
            self._check()

    def read(self, offset: int, into: memoryview) -> None:
        _pread_all(self._fd, into, self._base + offset, self._what)
        if self._pos is None or offset != self._pos:
            self._pos = None
            return
        self._crc = zlib.crc32(into, self._crc)  # releases the GIL
        self._pos += len(into)
        if self._pos == self._size:
            self._check()

    def _check(self) -> None:
        if self._crc != self._want:
            raise FormatError(f"{self._what}: its CRC-32 does not match (the archive is damaged)")


class _MemberReader:
    """Sequential reads of one deflated member's data through ``zipfile`` (which checks the
    CRC-32 at the member's end), reopened if asked to go back."""

    def __init__(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo, data_offset: int) -> None:
        self._archive, self._info, self._data_offset = archive, info, data_offset
        self._member: IO[bytes] | None = None
        self._pos = 0
        self._what = f"{archive.filename}: {info.filename}"

    def read(self, offset: int, into: memoryview) -> None:
        try:
            self._read(offset, into)
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            self.close()
            raise FormatError(f"{self._what}: {exc} (the archive is damaged)") from None

    def _read(self, offset: int, into: memoryview) -> None:
        if self._member is None or offset != self._pos:
            self.close()
            self._member = self._archive.open(self._info)
            self._member.seek(self._data_offset + offset)
            self._pos = offset
        done = 0
        while done < len(into):
            # ZipExtFile has no true readinto: a copy of at most one piece, decompressed
            chunk = self._member.read(len(into) - done)
            if not chunk:
                raise FormatError(f"{self._what}: member ended early")
            into[done : done + len(chunk)] = chunk
            done += len(chunk)
        self._pos += done
        if self._pos >= self._info.file_size - self._data_offset:
            self.close()

    def close(self) -> None:
        if self._member is not None:
            self._member.close()
            self._member = None


class _Swapped:
    """Reads of a byte-swapped array's data in native order, from in-order reads of its
    file bytes. A piece that starts or ends inside an element (a small item packed across
    a chunk boundary) is put together in a small buffer, the element's other bytes
    carried from the previous piece or read ahead for the next: a deliberate copy of that
    piece only."""

    def __init__(self, read: Reader, dtype: np.dtype[Any]) -> None:
        self._read, self._dtype, self._unit = read, dtype, dtype.itemsize
        self._next = 0
        self._behind = b""  # file bytes of the element the last piece ended inside
        self._ahead = b""  # ... and those of it after that piece, read ahead

    def read(self, offset: int, into: memoryview) -> None:
        if offset != self._next:
            raise AssertionError(f"out-of-order read at {offset}, expected {self._next}")
        end, unit = offset + len(into), self._unit
        self._next = end
        if not self._behind and not self._ahead and offset % unit == 0 and end % unit == 0:
            self._read(offset, into)
            np.frombuffer(into, dtype=self._dtype).byteswap(inplace=True)
            return
        lo, hi = offset - len(self._behind), end + (-end % unit)
        whole = np.empty(hi - lo, dtype=np.uint8)
        at = len(self._behind)
        whole[:at] = np.frombuffer(self._behind, dtype=np.uint8)
        ahead = np.frombuffer(self._ahead, dtype=np.uint8)[: hi - offset]
        whole[at : at + len(ahead)] = ahead
        if offset + len(ahead) < hi:
            self._read(offset + len(ahead), whole.data[at + len(ahead) :])
        self._behind = whole[end - lo - end % unit : end - lo].tobytes()
        self._ahead = whole[end - lo :].tobytes()
        swapped = whole.view(self._dtype).byteswap().view(np.uint8)
        into[:] = swapped[offset - lo : end - lo].data


class _FortranReader:
    """C-ordered reads of a Fortran-ordered array stored raw at ``base`` of ``fd``.

    The array is put in C order a block of whole rows (of its first axis) at a time, about
    ``_REORDER_BUDGET`` bytes or one row if that is larger: its file bytes are a C-ordered
    array of the reversed shape, so a block of rows is one run of ``rows`` elements per
    position in the other axes, read run by run, or across the gaps when they are small,
    then transposed. Memory: the block twice (read, reordered), not the array."""

    def __init__(
        self, fd: int, base: int, shape: tuple[int, ...], dtype: np.dtype[Any], what: str
    ) -> None:
        self._fd, self._base, self._what = fd, base, what
        self._shape, self._dtype = shape, dtype
        self._rest = math.prod(shape[1:])
        self._row = self._rest * dtype.itemsize
        self._rows = max(1, _REORDER_BUDGET // max(self._row, 1))
        self._first = -1  # the first row of the block held
        self._block: np.ndarray[Any, np.dtype[np.uint8]] = np.empty(0, dtype=np.uint8)

    def read(self, offset: int, into: memoryview) -> None:
        done = 0
        while done < len(into):
            at = offset + done
            row = at // self._row
            if not self._first <= row < self._first + self._rows or self._first < 0:
                self._load(row - row % self._rows)
            start = at - self._first * self._row
            n = min(len(into) - done, len(self._block) - start)
            into[done : done + n] = self._block[start : start + n].data
            done += n

    def _load(self, first: int) -> None:
        self._block = np.empty(0, dtype=np.uint8)  # let the last block go first
        d0, unit = self._shape[0], self._dtype.itemsize
        rows = min(self._rows, d0 - first)
        run, stride = rows * unit, d0 * unit
        # tile[m] holds rows [first, first + rows) at position m of the other axes (their
        # Fortran order: the first of them fastest)
        tile = np.empty((self._rest, rows), dtype=self._dtype)
        flat = tile.reshape(-1).view(np.uint8)
        if stride - run < _READ_ACROSS:
            columns = max(1, _SPAN_READ // stride)
            span = np.empty(columns * stride, dtype=np.uint8)
            for m in range(0, self._rest, columns):
                k = min(columns, self._rest - m)
                _pread_all(self._fd, span.data[: k * stride], self._base + m * stride, self._what)
                tile[m : m + k] = (
                    span[: k * stride].view(self._dtype).reshape(k, d0)[:, first : first + rows]
                )
            del span
        else:
            for m in range(self._rest):
                _pread_all(
                    self._fd,
                    flat.data[m * run : (m + 1) * run],
                    self._base + m * stride + first * unit,
                    self._what,
                )
        # the rows in C order: (rest reversed..., rows) transposed to (rows, rest...)
        block = np.ascontiguousarray(tile.reshape((*self._shape[:0:-1], rows)).transpose())
        del tile, flat
        if not self._dtype.isnative:
            block.byteswap(inplace=True)
        self._block = block.reshape(-1).view(np.uint8)
        self._first = first


def _checked_crc(fd: int, base: int, size: int, want: int, what: str) -> None:
    """Check a stored member's CRC-32 in one pass of ``_SPAN_READ`` reads (for members
    that are not read in order)."""
    buffer = np.empty(min(size, _SPAN_READ), dtype=np.uint8)
    crc = 0
    for at in range(0, size, _SPAN_READ):
        piece = buffer.data[: min(_SPAN_READ, size - at)]
        _pread_all(fd, piece, base + at, what)
        crc = zlib.crc32(piece, crc)
    if crc != want:
        raise FormatError(f"{what}: its CRC-32 does not match (the archive is damaged)")


_NPY_HEADERS: Final[Mapping[tuple[int, int], Callable[[IO[bytes]], Any]]] = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _member_start(fd: int, info: zipfile.ZipInfo, size: int, what: str) -> int:
    """Where a member's bytes start in the archive (after its local header)."""
    head = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
    if len(head) < _LOCAL_HEADER.size:
        raise FormatError(f"{what}: its header lies past the end of the file (truncated?)")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(head)
    if signature != b"PK\x03\x04":
        raise FormatError(f"{what}: no member header where the directory says")
    start: int = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if start + info.compress_size > size:
        raise FormatError(f"{what}: it ends past the end of the file (truncated?)")
    return start


def _npy_header(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, what: str
) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """(shape, Fortran order, dtype, where the data starts in the member)."""
    try:
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            read_header = _NPY_HEADERS.get(version)
            if read_header is None:
                raise ValueError(f"unsupported .npy version {version}")
            shape, fortran, dtype = read_header(member)
            return tuple(int(d) for d in shape), bool(fortran), dtype, member.tell()
    except (ValueError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
        raise FormatError(f"{what}: {exc}") from None


def _member_reader(
    archive: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    fd: int,
    size: int,
    data_offset: int,
    what: str,
    source: Source,
) -> Reader:
    """In-order reads of a member's bytes from ``data_offset`` on: ``pread`` for a stored
    member, ``zipfile`` for a deflated one."""
    if info.compress_type == zipfile.ZIP_STORED:
        start = _member_start(fd, info, size, what)
        head = os.pread(fd, data_offset, start)
        length = info.file_size - data_offset
        return _StoredMember(fd, start + data_offset, length, info.CRC, head, what).read
    reader = _MemberReader(archive, info, data_offset)
    source.closers.append(reader.close)
    return reader.read


def _fortran_item(
    archive: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    fd: int,
    size: int,
    data_offset: int,
    key: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    what: str,
    source: Source,
) -> SourceItem:
    """A Fortran-ordered array, reordered as it is read (``_FortranReader``): from the
    archive when the member is stored (its CRC checked first, in one pass), else from
    a temporary file it is decompressed into (memory stays bounded; the disk holds it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if info.compress_type == zipfile.ZIP_STORED:
        start = _member_start(fd, info, size, what)
        _checked_crc(fd, start, info.file_size, info.CRC, what)
        read_fd, base = fd, start + data_offset
    else:
        spill = tempfile.TemporaryFile(prefix="storaged-npz-")  # noqa: SIM115 - closed below
        source.closers.append(spill.close)
        try:
            with archive.open(info) as member:
                member.seek(data_offset)
                shutil.copyfileobj(member, spill, 1 << 20)
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise FormatError(f"{what}: {exc} (the archive is damaged)") from None
        spill.flush()
        read_fd, base = spill.fileno(), 0
    reader = _FortranReader(read_fd, base, shape, dtype, what)
    return SourceItem(key, dtype.newbyteorder("=").name, shape, nbytes, reader.read)


def open_npz(path: Path) -> Source:
    """An ``.npz`` archive: each ``.npy`` member an item, streamed (stored members read
    like safetensors tensors, deflated ones through ``zipfile``); a byte-swapped array is
    swapped as it is read, a Fortran-ordered one reordered in blocks of rows. Any other
    member (not ``.npy``) is kept whole as a ``uint8`` item ``file:<its name>``, which a
    restore into ``.npz`` writes back as it was. Arrays of Python objects are refused
    (loading them needs a pickle), and so are strings and structured dtypes."""
    bad = f"{path}: not a readable .npz archive"
    with open(path, "rb") as f:
        if f.read(6) == b"\x93NUMPY":
            raise FormatError(f"{path}: not an .npz archive (a .npy file)")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise FormatError(f"{bad}: {exc}") from None
    source = Source([], {}, [archive.close])
    try:
        fd, size = _open_fd(path)
        source.closers.append(lambda: os.close(fd))
        seen: set[str] = set()
        for info in archive.infolist():
            what = f"{path}: {info.filename}"
            if info.is_dir():
                continue
            if info.flag_bits & 0x1:
                raise FormatError(f"{what}: an encrypted member cannot be saved")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise FormatError(
                    f"{what}: compressed with method {info.compress_type}; storaged reads "
                    "stored and deflated members (what np.savez and np.savez_compressed write)"
                )
            if not info.filename.endswith(".npy"):
                key = FILE_PREFIX + info.filename
                read = _member_reader(archive, info, fd, size, 0, what, source)
                source.items.append(
                    SourceItem(key, "uint8", (info.file_size,), info.file_size, read)
                )
                seen.add(key)
                continue
            key = info.filename[: -len(".npy")]
            if key in seen or key.startswith(FILE_PREFIX):
                why = "twice" if key in seen else f"under a name starting with {FILE_PREFIX!r}"
                raise FormatError(f"{path}: an array {key!r} {why} cannot be saved")
            seen.add(key)
            shape, fortran, dtype, data_offset = _npy_header(
                archive, info, f"{bad}: {info.filename}"
            )
            if dtype.hasobject:
                raise FormatError(
                    f"{what}: {key} holds Python objects (dtype object); loading them needs a "
                    "pickle, which storaged never runs: convert it to a numeric array"
                )
            if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype:
                raise FormatError(f"{key}: cannot save arrays of dtype {dtype}")
            nbytes = math.prod(shape) * dtype.itemsize
            if info.file_size - data_offset != nbytes:
                raise FormatError(
                    f"{bad}: {info.filename} holds {info.file_size - data_offset} bytes of "
                    f"data, its header says {nbytes}"
                )
            if fortran and sum(1 for d in shape if d > 1) > 1:
                source.items.append(
                    _fortran_item(
                        archive, info, fd, size, data_offset, key, shape, dtype, what, source
                    )
                )
                continue
            # C order (or one axis only: the same bytes either way)
            read = _member_reader(archive, info, fd, size, data_offset, what, source)
            if not dtype.isnative:
                read = _Swapped(read, dtype).read
            name = dtype.newbyteorder("=").name
            source.items.append(SourceItem(key, name, shape, nbytes, read))
        return source
    except BaseException:
        source.close()
        raise


# ---- torch


def _flatten(
    value: Any, path: tuple[str | int, ...], out: dict[str, Any], keys: dict[str, list[Any]]
) -> None:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise FormatError(f"key {key!r} under {list(path)}: only str and int keys")
            _flatten(item, (*path, key), out, keys)
        return
    flat = ".".join(str(p) for p in path)
    if flat in out:
        raise FormatError(f"two entries flatten to the same key {flat!r}")
    out[flat] = value
    keys[flat] = list(path)


def torch_dtypes(torch: Any) -> dict[Any, tuple[str, Any, type[np.generic]]]:
    """torch dtypes numpy lacks -> (manifest name, same-width torch int, numpy storage)."""
    return {
        torch.bfloat16: ("bfloat16", torch.int16, np.int16),
        torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8, np.uint8),
        torch.float8_e5m2: ("float8_e5m2", torch.uint8, np.uint8),
    }


_MADV_PAGEOUT: Final = 21
_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):  # not Linux: pages stay until the process ends
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _paged_read(flat: np.ndarray[Any, Any]) -> Callable[[int, memoryview], None]:
    """Reads of an mmap-backed array that hand the pages read back to the kernel.

    MADV_PAGEOUT never loses data (file pages are re-read, anonymous ones swapped),
    so it is safe whatever backs the array; it only keeps the mapping from growing
    resident as the whole file is read once.
    """
    data = flat.reshape(-1).view(np.uint8)
    base = data.ctypes.data
    madvise = _madvise()

    def read(offset: int, into: memoryview) -> None:
        into[:] = data[offset : offset + len(into)].data
        if madvise is None:
            return
        start = -(-(base + offset) // _PAGE) * _PAGE
        end = (base + offset + len(into)) // _PAGE * _PAGE
        if end > start:
            madvise(start, end - start, _MADV_PAGEOUT)  # EINVAL on old kernels: no harm

    return read


def _weights_only_failure(path: Path, exc: BaseException) -> FormatError:
    """One line for torch's many-line weights-only error: a refusal when the file names
    a global that only a full unpickle would import, else "not a readable torch file"."""
    text = clean_message(str(exc))
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found is None:
        reason = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", text)
        why = reason.group(1).strip() if reason else "not a torch.save file"
        return FormatError(f"{path}: not a readable torch file: {why}")
    return FormatError(
        f"{path}: loading it needs a full unpickle (it holds {found.group(1)}, which "
        "could run arbitrary code); storaged loads torch files with weights_only=True "
        "only: save the model's state_dict() or convert it to .safetensors"
    )


def open_torch(path: Path) -> Source:
    torch = import_torch(f"{path} is a torch file")
    mapped = zipfile.is_zipfile(path)  # the legacy (pre-1.6) format cannot be mapped
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except OSError:
        raise
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            raise _weights_only_failure(path, exc) from None
        raise FormatError(f"{path}: not a readable torch file: {clean_message(str(exc))}") from None
    except Exception as exc:  # torch.load raises many unrelated types on a bad file
        raise FormatError(f"{path}: not a readable torch file: {clean_message(str(exc))}") from None
    if not isinstance(obj, Mapping) or not obj:
        raise FormatError(f"{path}: expected a (state) dict, found {type(obj).__name__}")
    flat: dict[str, Any] = {}
    keys: dict[str, list[Any]] = {}
    _flatten(obj, (), flat, keys)
    special = torch_dtypes(torch)
    items = []
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            tensor = value.detach().resolve_conj().resolve_neg()
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()  # a deliberate copy: the stream is C-ordered
            kind = special.get(tensor.dtype)
            try:
                array = tensor.view(kind[1]).numpy() if kind else tensor.numpy()
            except (TypeError, RuntimeError) as exc:
                raise FormatError(f"{key}: cannot save a tensor of {tensor.dtype}: {exc}") from None
            dtype = kind[0] if kind else array.dtype.name
            shape = tuple(int(d) for d in tensor.shape)
            read = _paged_read(array) if mapped else _array_read(array)
            items.append(SourceItem(key, dtype, shape, array.nbytes, read))
        elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            raise FormatError(f"{path}: {key} is a list holding tensors; only dicts nest tensors")
        else:
            items.append(_value_item(key, value))  # a number, string, list...
    return Source(items, {"torch_keys": keys})


# ---- raw


def open_raw_file(path: Path) -> Source:
    fd, size = _open_fd(path)

    def read(offset: int, into: memoryview) -> None:
        _pread_all(fd, into, offset, str(path))

    return Source([SourceItem("data", "uint8", (size,), size, read)], {}, [lambda: os.close(fd)])


def open_source(path: str, fmt: str) -> Source:
    """Open ``path`` as ``fmt`` for saving (``FormatError``, ``OSError`` when it cannot be)."""
    p = Path(path)
    if fmt != "safetensors" and p.is_dir():
        raise IsADirectoryError(21, "Is a directory", path)
    opener = {
        "safetensors": open_safetensors,
        "npz": open_npz,
        "torch": open_torch,
        "raw": open_raw_file,
    }[fmt]
    source = opener(p)
    source.meta["source"] = {"format": fmt, "file": p.name}
    return source


# --------------------------------------------------------------------------- writers


@dataclass(frozen=True, slots=True)
class OutputItem:
    """An item as a writer lays it out: its key, manifest dtype and (global) shape."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        if self.dtype in VALUE_DTYPES:
            return 0
        return math.prod(self.shape) * _itemsize(self.dtype)


#: the ``__metadata__`` entry of a restored ``.safetensors`` that holds the checkpoint's
#: non-tensor values (a JSON object, key -> value); ``save`` turns it back into values
VALUES_METADATA_KEY: Final = "storaged.values"


def check_writable(fmt: str, items: Iterable[OutputItem]) -> None:
    """Refuse, before any download, what ``fmt`` cannot hold."""
    items = list(items)
    values = [i.key for i in items if i.dtype in VALUE_DTYPES]
    if fmt == "raw" and values:
        shown = ", ".join(values[:5]) + (" ..." if len(values) > 5 else "")
        raise FormatError(
            f"the checkpoint holds non-tensor values ({shown}) which raw output cannot hold; "
            "restore into .pt or .safetensors instead"
        )
    if any(i.dtype == DCP_BYTES_DTYPE for i in items):
        import_torch("reading the non-tensor values a DCP checkpoint holds")
    if fmt == "raw" and len(items) != 1:
        raise FormatError(
            f"raw output holds one item and this checkpoint has {len(items)}: "
            "restore into .safetensors or .npz instead"
        )
    if fmt == "torch":
        import_torch("writing a torch file")


def decode_value(item: OutputItem, value: Any) -> Any:
    """A restored value as a Python object: a DCP-saved one (``torch.save``'s bytes) is
    loaded with ``torch.load(weights_only=True)``, so restoring never runs a pickle's code;
    one that needs more is refused, saying how to read it."""
    if item.dtype != DCP_BYTES_DTYPE:
        return value
    torch = import_torch("reading the non-tensor values a DCP checkpoint holds")
    try:
        return torch.load(io.BytesIO(value), weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ...
        raise FormatError(
            f"{item.key}: a pickled value that torch.load(weights_only=True) refuses "
            f"({clean_message(str(exc)).splitlines()[0][:160]}); load the checkpoint with "
            "storaged.client.dcp.StoragedReader to read it"
        ) from None


def values_metadata(values: Mapping[str, Any]) -> str:
    """The JSON of the non-tensor values a restored ``.safetensors`` keeps in its metadata
    (tuples become lists); ``FormatError`` naming a value JSON cannot hold."""
    for key, value in values.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise FormatError(
                f"{key} is a {type(value).__name__}, which .safetensors metadata (JSON) cannot "
                f"hold ({exc}); restore into .pt instead"
            ) from None
    return json.dumps(dict(values), separators=(",", ":"))


def safetensors_header(items: Iterable[OutputItem], metadata: Mapping[str, Any] | None) -> bytes:
    """The header (length prefix included) of a file holding ``items`` back to back; value
    items (``VALUE_DTYPES``) are left out (their values go in ``metadata``)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for item in items:
        if item.dtype in VALUE_DTYPES:
            continue
        header[item.key] = {
            "dtype": _SAFETENSORS_CODES[item.dtype],
            "shape": list(item.shape),
            "data_offsets": [offset, offset + item.nbytes],
        }
        offset += item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


class ItemWriter:
    """Receives each item's bytes in order, as consecutive pieces; ``finish`` at the end."""

    def begin(self, item: OutputItem) -> None:
        raise NotImplementedError

    def write(self, data: memoryview) -> None:
        raise NotImplementedError

    def value(self, item: OutputItem, value: Any) -> None:
        raise FormatError(f"{item.key}: a non-tensor value cannot be written here")

    def finish(self) -> None:
        pass

    def abandon(self) -> None:
        """Release what is open after a failure (the output is discarded)."""


class StreamWriter(ItemWriter):
    """Items back to back after an optional header: safetensors and raw."""

    def __init__(self, out: IO[bytes], header: bytes = b"") -> None:
        self._out = out
        #: a safetensors header: the values are in it (``value`` is not called then)
        self.has_header = bool(header)
        out.write(header)

    def begin(self, item: OutputItem) -> None:
        pass

    def write(self, data: memoryview) -> None:
        self._out.write(data)


class NpzWriter(ItemWriter):
    """One stored (uncompressed) ``.npy`` member per item, written as its pieces come; an
    item ``file:<name>`` (a member that was not ``.npy`` in the archive saved) is written
    back as that member, its bytes as they were."""

    def __init__(self, out: IO[bytes]) -> None:
        self._archive = zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._member: IO[bytes] | None = None

    def _close_member(self) -> None:
        if self._member is not None:
            self._member.close()
            self._member = None

    def begin(self, item: OutputItem) -> None:
        self._close_member()
        if item.key.startswith(FILE_PREFIX) and item.dtype == "uint8" and len(item.shape) == 1:
            name = item.key.removeprefix(FILE_PREFIX)
            self._member = self._archive.open(name, "w", force_zip64=True)
            return
        dtype = np.dtype(STORAGE_DTYPES.get(item.dtype, item.dtype))
        self._member = self._archive.open(f"{item.key}.npy", "w", force_zip64=True)
        header = {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": item.shape,
        }
        np.lib.format.write_array_header_2_0(self._member, header)

    def write(self, data: memoryview) -> None:
        assert self._member is not None
        self._member.write(data)

    def value(self, item: OutputItem, value: Any) -> None:
        self._close_member()
        value = decode_value(item, value)
        try:
            array = None if isinstance(value, dict) else np.asarray(value)
        except ValueError:  # a ragged list
            array = None
        if array is None or array.dtype.kind not in "biufcUS":
            raise FormatError(
                f"{item.key} is a {type(value).__name__}, which an .npz cannot hold (numbers, "
                "strings and arrays of them only); restore into .pt or .safetensors instead"
            )
        with self._archive.open(f"{item.key}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, array, allow_pickle=False)

    def finish(self) -> None:
        self._close_member()
        self._archive.close()

    def abandon(self) -> None:
        with contextlib.suppress(Exception):
            self.finish()


class DirectoryWriter(ItemWriter):
    """A shard directory laid out as it was saved (``_open_shard_directory``): each shard
    its header as it was, then its tensors; every side file whole. A shard saved without
    its header gets one made here; an index the checkpoint does not hold as a file (saved
    by an older storaged) is written from the layout it recorded."""

    def __init__(self, root: Path, layout: Mapping[str, Any], items: Iterable[OutputItem]) -> None:
        self._root = root
        self._weight_map = {str(k): str(v) for k, v in (layout.get("weight_map") or {}).items()}
        self._layout = layout
        self._metadata: Mapping[str, Any] | None = None
        self._tensors_of: dict[str, list[OutputItem]] = {}
        for item in items:
            if item.key.startswith((HEADER_PREFIX, FILE_PREFIX)) or item.dtype in VALUE_DTYPES:
                continue
            shard = self._weight_map.get(item.key)
            if shard is None:
                raise FormatError(f"{item.key}: in no shard of the directory it was saved from")
            self._tensors_of.setdefault(shard, []).append(item)
        self._out: IO[bytes] | None = None
        self._shard: str | None = None
        self._written: set[str] = set()

    def with_metadata(self, metadata: Mapping[str, Any] | None) -> DirectoryWriter:
        self._metadata = metadata
        return self

    def _open(self, rel: str) -> IO[bytes]:
        self._close()
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            raise FormatError(f"{rel!r}: a saved file name outside the directory")
        target = self._root.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(target, "wb")  # noqa: SIM115 - closed by _close
        self._written.add(rel)
        return self._out

    def _close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def begin(self, item: OutputItem) -> None:
        key = item.key
        if key.startswith(HEADER_PREFIX):
            self._shard = key.removeprefix(HEADER_PREFIX)
            self._open(self._shard)
        elif key.startswith(FILE_PREFIX):
            self._shard = None
            self._open(key.removeprefix(FILE_PREFIX))
        else:
            shard = self._weight_map[key]
            if shard != self._shard:
                out = self._open(shard)
                self._shard = shard
                out.write(safetensors_header(self._tensors_of[shard], self._metadata))

    def write(self, data: memoryview) -> None:
        assert self._out is not None
        self._out.write(data)

    def value(self, item: OutputItem, value: Any) -> None:
        raise FormatError(f"{item.key}: a shard directory holds no non-tensor values")

    def abandon(self) -> None:
        self._close()

    def finish(self) -> None:
        self._close()
        index = self._layout.get("index")
        if isinstance(index, str) and index not in self._written:
            doc = {"metadata": self._layout.get("metadata"), "weight_map": self._weight_map}
            with self._open(index) as out:
                out.write(json.dumps(doc, indent=2).encode())
            self._out = None


def to_torch(torch: Any, array: np.ndarray[Any, Any], dtype: str) -> Any:
    for torch_dtype, (name, _, as_int) in torch_dtypes(torch).items():
        if name == dtype:
            return torch.from_numpy(array.view(as_int)).view(torch_dtype)
    return torch.from_numpy(array)


def write_torch(
    path: Path | IO[bytes],
    values: Mapping[str, Any],
    dtypes: Mapping[str, str],
    meta: Mapping[str, Any],
) -> None:
    torch = import_torch("writing a torch file")
    leaves = {
        key: decode_value(OutputItem(key, dtypes[key], ()), value)
        if dtypes[key] in VALUE_DTYPES
        else to_torch(torch, value, dtypes[key])
        for key, value in values.items()
    }
    paths = meta.get("torch_keys")
    if not isinstance(paths, Mapping) or set(paths) != set(leaves):
        obj: dict[Any, Any] = leaves  # not saved from a torch file: a flat dict
    else:
        obj = {}
        for key, value in leaves.items():
            node = obj
            *parents, last = paths[key]
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
    torch.save(obj, path)


def stdout_bytes() -> IO[bytes]:
    return sys.stdout.buffer
