"""An optional codec: Intel ISA-L Reed-Solomon through pyeclib (liberasurecode), name "isal".

Needs the ``isal`` extra (``pip install 'storaged[isal]'``, which brings pyeclib with
liberasurecode and ISA-L); without it, constructing the codec raises ``InvalidParameters``
saying so. Importing this module never needs pyeclib.

Choices, measured with pyeclib 1.8 / liberasurecode 1.8 on this machine:

- EC type ``isa_l_rs_cauchy``, not ``isa_l_rs_vand``: the Vandermonde variant is not MDS
  for every (k, m) (k=6, m=6: 8 of the 924 six-fragment subsets fail to decode; k=8, m=6:
  20 subsets), while the Cauchy one decoded every subset tried. Every 1 <= k < n <= 256
  encodes and decodes (checked up to k+m = 256), so no limit beyond ``check_parameters``.
- Each payload is a whole pyeclib fragment, with liberasurecode's own 80-byte header and
  padding: pyeclib splits and pads, and strips the padding on decode.
- pyeclib accepts only ``bytes``: a ``bytearray`` or ``memoryview`` is refused on encode
  and *aborts the process* (a C assertion) on decode. So a chunk that is not already a
  ``bytes`` object is copied once on encode, and a payload that is a slice of a larger
  buffer (a fragment parsed from bytes read off disk) is copied once on decode: both are
  deliberate, and absent when the caller passes ``bytes`` / fragments from ``encode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from erasure.base import (
    BytesLike,
    Codec,
    InvalidParameters,
)
from erasure.fragment import Fragment

__all__ = ["EC_TYPE", "IsalCodec", "isal_available"]

EC_TYPE = "isa_l_rs_cauchy"

_INSTALL_HINT = "install the isal extra: pip install 'storaged[isal]'"


def _driver_class() -> Any:
    """pyeclib's ``ECDriver``, or ``InvalidParameters`` saying how to get it."""
    try:
        from pyeclib.ec_iface import VALID_EC_TYPES, ECDriver
    except ImportError as exc:
        raise InvalidParameters(
            f"codec 'isal' needs pyeclib, which is not installed ({exc}): {_INSTALL_HINT}"
        ) from exc
    if EC_TYPE not in VALID_EC_TYPES:
        raise InvalidParameters(
            f"codec 'isal' needs liberasurecode built with ISA-L ({EC_TYPE} is not among"
            f" {sorted(VALID_EC_TYPES)}): {_INSTALL_HINT}"
        )
    return ECDriver


def isal_available() -> bool:
    """True when pyeclib with ISA-L is importable (the codec can be constructed)."""
    try:
        _driver_class()
    except InvalidParameters:
        return False
    return True


def _as_bytes(view: memoryview) -> bytes:
    """``view`` as a ``bytes`` object: the underlying object when ``view`` covers all of a
    ``bytes``, else a copy (pyeclib accepts nothing else; see the module doc)."""
    obj = view.obj
    if isinstance(obj, bytes) and len(obj) == view.nbytes:
        return obj
    return view.tobytes()


class IsalCodec(Codec):
    """ISA-L Reed-Solomon (Cauchy) via pyeclib; fragments are recorded with codec name "isal"."""

    name = "isal"

    def _open_coder(self) -> None:
        driver_class = _driver_class()
        self._driver = driver_class(k=self.k, m=self.n - self.k, ec_type=EC_TYPE)

    def _encode_payloads(self, data: memoryview) -> Sequence[BytesLike]:
        payloads: list[bytes] = self._driver.encode(_as_bytes(data))
        if len(payloads) != self.n:
            raise InvalidParameters(f"pyeclib made {len(payloads)} fragments, expected {self.n}")
        return payloads

    def _decode_payloads(self, fragments: Sequence[Fragment], length: int) -> bytes:
        data: bytes = self._driver.decode([_as_bytes(f.payload) for f in fragments])
        return data
