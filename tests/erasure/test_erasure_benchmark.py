"""The codec benchmark runs, on a small chunk, and prints one row per codec, (k, n), operation."""

from __future__ import annotations

import pytest

from erasure import isal_available
from loadtest.codec import main


def test_benchmark_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--size-mib", "0.1", "--rounds", "1", "--params", "4,6 3,5"]) == 0
    out = capsys.readouterr().out
    codecs = ["zfec", "isal"] if isal_available() else ["zfec"]
    for codec in codecs:
        for kn in ("4,6", "3,5"):
            for op in ("encode", "decode primaries", "decode missing #0"):
                assert any(
                    line.split()[:2] == [codec, kn] and op in line for line in out.splitlines()
                ), (codec, kn, op)
    assert "BLAKE3 of the chunk" in out
