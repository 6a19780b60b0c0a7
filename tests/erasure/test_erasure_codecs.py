"""One conformance suite, run against every codec by subclassing (zfec, isal)."""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import threading
from collections.abc import Sequence
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from erasure import (
    CODECS,
    DEFAULT_CODEC,
    HEADER_SIZE,
    Codec,
    CorruptFragment,
    DecodeMismatch,
    Fragment,
    InvalidParameters,
    IsalCodec,
    NotEnoughFragments,
    ZfecCodec,
    build_fragment,
    isal_available,
    make_codec,
    parse_fragment,
)
from storaged.ids import chunk_id_of

MiB = 1 << 20

# The property tests live on the shared conformance class and so run from one instance per
# codec; the examples depend only on the drawn values, never on which codec drew them.
PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.differing_executors])


def random_bytes(length: int, seed: int) -> bytes:
    # Hypothesis draws the length and a seed; drawing megabytes byte by byte would be slow.
    return random.Random(seed).randbytes(length)


def flip(buf: bytes, position: int, bit: int = 0) -> bytes:
    out = bytearray(buf)
    out[position] ^= 1 << bit
    return bytes(out)


def subsets(n: int, k: int, rng: random.Random, limit: int) -> list[tuple[int, ...]]:
    """Every k-subset of range(n) when there are at most ``limit``, else a sample of them
    that always includes the primary and the last-k subsets."""
    total = 1
    for i in range(k):
        total = total * (n - i) // (i + 1)
    if total <= limit:
        return list(itertools.combinations(range(n), k))
    picked = {tuple(range(k)), tuple(range(n - k, n))}
    while len(picked) < limit:
        picked.add(tuple(sorted(rng.sample(range(n), k))))
    return sorted(picked)


class CodecConformance:
    """What every ``Codec`` must do. Subclasses set ``codec_name`` (and may skip)."""

    codec_name: ClassVar[str]
    #: the largest n this codec is exercised at in the property tests
    max_n: ClassVar[int] = 256

    def codec(self, k: int, n: int) -> Codec:
        return make_codec(self.codec_name, k, n)

    def encoded(self, k: int, n: int, data: bytes) -> tuple[Codec, str, list[bytes]]:
        codec = self.codec(k, n)
        chunk_id = chunk_id_of(data)
        return codec, chunk_id, [f.to_bytes() for f in codec.encode(chunk_id, data)]

    # -- identity --------------------------------------------------------------------------

    def test_make_codec_gives_this_codec(self) -> None:
        codec = self.codec(3, 5)
        assert (codec.name, codec.k, codec.n) == (self.codec_name, 3, 5)
        assert isinstance(codec, CODECS[self.codec_name])

    def test_fragments_describe_themselves(self) -> None:
        data = random_bytes(1001, 1)
        _, chunk_id, blobs = self.encoded(3, 5, data)
        assert len(blobs) == 5
        for index, blob in enumerate(blobs):
            frag = parse_fragment(blob)
            assert (frag.codec, frag.k, frag.n, frag.index) == (self.codec_name, 3, 5, index)
            assert (frag.length, frag.chunk_id) == (1001, chunk_id)

    # -- round trips -----------------------------------------------------------------------

    @settings(PROPERTY, max_examples=40)
    @given(
        n=st.integers(2, 7),
        k_fraction=st.floats(0, 1, exclude_max=True),
        length=st.one_of(st.integers(0, 64), st.integers(0, 256 * 1024)),
        seed=st.integers(0, 2**32),
    )
    def test_every_k_subset_round_trips_small_n(
        self, n: int, k_fraction: float, length: int, seed: int
    ) -> None:
        k = 1 + int(k_fraction * (n - 1))
        data = random_bytes(length, seed)
        codec, chunk_id, blobs = self.encoded(k, n, data)
        for subset in itertools.combinations(range(n), k):
            assert codec.decode(chunk_id, [blobs[i] for i in subset]) == data

    @settings(PROPERTY, max_examples=8)
    @given(
        kn=st.sampled_from([(4, 6), (8, 12), (10, 14), (1, 3), (6, 12)]),
        length=st.integers(2 * MiB, 6 * MiB),
        seed=st.integers(0, 2**32),
    )
    def test_megabyte_chunks_round_trip(self, kn: tuple[int, int], length: int, seed: int) -> None:
        k, n = kn
        data = random_bytes(length, seed)
        codec, chunk_id, blobs = self.encoded(k, n, data)
        rng = random.Random(seed)
        for subset in subsets(n, k, rng, limit=4):
            assert codec.decode(chunk_id, {i: blobs[i] for i in subset}) == data

    @settings(PROPERTY, max_examples=20)
    @given(
        n=st.integers(8, 256),
        k_fraction=st.floats(0, 1, exclude_max=True),
        length=st.one_of(st.integers(0, 300), st.integers(0, MiB)),
        seed=st.integers(0, 2**32),
    )
    def test_sampled_k_subsets_round_trip_large_n(
        self, n: int, k_fraction: float, length: int, seed: int
    ) -> None:
        n = min(n, self.max_n)
        k = 1 + int(k_fraction * (n - 1))
        data = random_bytes(length, seed)
        codec, chunk_id, blobs = self.encoded(k, n, data)
        rng = random.Random(seed)
        for subset in subsets(n, k, rng, limit=5):
            shuffled = list(subset)
            rng.shuffle(shuffled)
            assert codec.decode(chunk_id, [blobs[i] for i in shuffled]) == data

    @pytest.mark.parametrize(("k", "n"), [(1, 256), (255, 256), (128, 256), (1, 2)])
    def test_extreme_parameters(self, k: int, n: int) -> None:
        n = min(n, self.max_n)
        k = min(k, n - 1)
        data = random_bytes(3000, k + n)
        codec, chunk_id, blobs = self.encoded(k, n, data)
        assert codec.decode(chunk_id, blobs[n - k :]) == data
        assert codec.decode(chunk_id, blobs[:k]) == data

    def test_every_subset_of_k6_n12(self) -> None:
        # ISA-L's Vandermonde matrix fails 8 of these 924 subsets; the codec must not.
        data = random_bytes(600, 6)
        codec, chunk_id, blobs = self.encoded(6, 12, data)
        for subset in itertools.combinations(range(12), 6):
            assert codec.decode(chunk_id, [blobs[i] for i in subset]) == data

    @pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 5, 7])
    def test_empty_and_smaller_than_k(self, length: int) -> None:
        data = random_bytes(length, length)
        codec, chunk_id, blobs = self.encoded(5, 8, data)
        for subset in [(0, 1, 2, 3, 4), (3, 4, 5, 6, 7), (0, 2, 4, 6, 7)]:
            assert codec.decode(chunk_id, [blobs[i] for i in subset]) == data

    @pytest.mark.quick
    def test_decode_accepts_every_input_form(self) -> None:
        data = random_bytes(5000, 2)
        codec = self.codec(3, 5)
        chunk_id = chunk_id_of(data)
        frags = codec.encode(chunk_id, bytearray(data))
        blobs = [f.to_bytes() for f in frags]
        forms: list[object] = [
            frags,  # Fragment objects straight from encode
            tuple(blobs[2:]),
            [bytearray(b) for b in blobs[:3]],
            [memoryview(b) for b in blobs[1:4]],
            {4: blobs[4], 0: memoryview(blobs[0]), 2: frags[2]},
            (b for b in blobs[::2]),  # any iterable
            [frags[0], blobs[3], bytearray(blobs[4])],
        ]
        for form in forms:
            assert codec.decode(chunk_id, form) == data  # type: ignore[arg-type]
        assert codec.encode(chunk_id, memoryview(data))[0].length == 5000

    def test_decode_twice_and_permuted_gives_the_same_bytes(self) -> None:
        # zfec reorders a list of blocks in place; reusing the caller's inputs must not matter.
        data = random_bytes(4000, 3)
        codec, chunk_id, blobs = self.encoded(4, 6, data)
        for order in itertools.permutations([0, 4, 1, 5]):
            given = [blobs[i] for i in order]
            assert codec.decode(chunk_id, given) == data
            assert codec.decode(chunk_id, given) == data
            by_index = {i: blobs[i] for i in order}
            assert codec.decode(chunk_id, by_index) == data
            assert codec.decode(chunk_id, by_index) == data

    # -- corruption ------------------------------------------------------------------------

    @settings(PROPERTY, max_examples=30)
    @given(
        n=st.integers(2, 8),
        k_fraction=st.floats(0, 1, exclude_max=True),
        length=st.integers(0, 20000),
        seed=st.integers(0, 2**32),
        where=st.floats(0, 1, exclude_max=True),
        bit=st.integers(0, 7),
    )
    def test_a_flipped_byte_anywhere_is_skipped_never_decoded(
        self, n: int, k_fraction: float, length: int, seed: int, where: float, bit: int
    ) -> None:
        k = 1 + int(k_fraction * (n - 1))
        data = random_bytes(length, seed)
        codec, chunk_id, blobs = self.encoded(k, n, data)
        rng = random.Random(seed)
        victim = rng.randrange(n)
        blob = blobs[victim]
        bad = flip(blob, int(where * len(blob)), bit)
        with pytest.raises(CorruptFragment):
            parse_fragment(bad)
        others = [i for i in range(n) if i != victim]
        # With k good ones besides the bad one, the bad one is skipped, wherever it sits.
        chosen = rng.sample(others, k)
        given = [blobs[i] for i in chosen]
        given.insert(rng.randrange(len(given) + 1), bad)
        assert codec.decode(chunk_id, given) == data
        # With only k-1 good ones besides it: an error, never bytes.
        with pytest.raises(NotEnoughFragments) as info:
            codec.decode(chunk_id, [bad] + [blobs[i] for i in chosen[: k - 1]])
        assert (info.value.available, info.value.needed) == (k - 1, k)

    @settings(PROPERTY, max_examples=20)
    @given(
        n=st.integers(2, 12),
        k_fraction=st.floats(0, 1, exclude_max=True),
        length=st.integers(0, 5000),
        seed=st.integers(0, 2**32),
    )
    def test_fewer_than_k_good_is_an_error(
        self, n: int, k_fraction: float, length: int, seed: int
    ) -> None:
        k = 1 + int(k_fraction * (n - 1))
        data = random_bytes(length, seed)
        codec, chunk_id, blobs = self.encoded(k, n, data)
        rng = random.Random(seed)
        count = rng.randrange(k)
        chosen = rng.sample(range(n), count)
        with pytest.raises(NotEnoughFragments) as info:
            codec.decode(chunk_id, [blobs[i] for i in chosen])
        assert (info.value.available, info.value.needed) == (count, k)
        assert f"{count} good fragment(s) available, {k} needed" in str(info.value)

    def test_no_fragments_at_all(self) -> None:
        codec = self.codec(2, 3)
        with pytest.raises(NotEnoughFragments, match=r"0 good fragment.*2 needed"):
            codec.decode(chunk_id_of(b"x"), [])

    def test_the_error_says_why_fragments_were_rejected(self) -> None:
        data = random_bytes(3000, 4)
        codec, chunk_id, blobs = self.encoded(3, 5, data)
        given = [flip(blobs[0], 10), flip(blobs[1], HEADER_SIZE + 5), blobs[2], b"junk"]
        with pytest.raises(NotEnoughFragments) as info:
            codec.decode(chunk_id, given)
        message = str(info.value)
        assert "1 good fragment(s) available, 3 needed" in message
        assert "header checksum mismatch" in message
        assert "fragment 1: payload checksum mismatch" in message
        assert "truncated header" in message

    def test_repeated_fragment_counts_once(self) -> None:
        data = random_bytes(3000, 5)
        codec, chunk_id, blobs = self.encoded(3, 5, data)
        with pytest.raises(NotEnoughFragments) as info:
            codec.decode(chunk_id, [blobs[1]] * 5 + [blobs[2]])
        assert info.value.available == 2

    def test_a_bad_copy_then_a_good_copy_of_one_index(self) -> None:
        data = random_bytes(3000, 6)
        codec, chunk_id, blobs = self.encoded(3, 5, data)
        bad_zero = flip(blobs[0], len(blobs[0]) - 1)
        assert codec.decode(chunk_id, [bad_zero, blobs[0], blobs[1], blobs[2]]) == data

    # -- foreign fragments -----------------------------------------------------------------

    def test_fragments_of_another_chunk_are_rejected(self) -> None:
        data, other = random_bytes(3000, 7), random_bytes(3000, 8)
        codec, chunk_id, blobs = self.encoded(2, 4, data)
        _, _, other_blobs = self.encoded(2, 4, other)
        with pytest.raises(NotEnoughFragments, match="belongs to chunk"):
            codec.decode(chunk_id, [blobs[0], other_blobs[1], other_blobs[2]])
        assert codec.decode(chunk_id, [other_blobs[1], blobs[0], blobs[3]]) == data

    def test_fragments_of_other_parameters_are_rejected(self) -> None:
        data = random_bytes(3000, 9)
        codec, chunk_id, blobs = self.encoded(2, 4, data)
        _, _, wider = self.encoded(2, 5, data)
        _, _, deeper = self.encoded(3, 4, data)
        with pytest.raises(NotEnoughFragments, match="k=2 n=5"):
            codec.decode(chunk_id, [blobs[0], wider[1], wider[2]])
        with pytest.raises(NotEnoughFragments, match="k=3 n=4"):
            codec.decode(chunk_id, [deeper[0], deeper[1], blobs[3]])

    def test_fragments_of_another_codec_are_rejected(self) -> None:
        data = random_bytes(3000, 10)
        codec, chunk_id, blobs = self.encoded(2, 4, data)
        foreign = [
            build_fragment(
                codec="other",
                k=2,
                n=4,
                index=f.index,
                length=f.length,
                chunk_id=f.chunk_id,
                payload=f.payload,
            ).to_bytes()
            for f in map(parse_fragment, blobs)
        ]
        with pytest.raises(NotEnoughFragments, match="made by other k=2 n=4"):
            codec.decode(chunk_id, foreign)
        for name in CODECS:
            if name != self.codec_name and (name != "isal" or isal_available()):
                theirs = [f.to_bytes() for f in make_codec(name, 2, 4).encode(chunk_id, data)]
                with pytest.raises(NotEnoughFragments, match=f"made by {name}"):
                    codec.decode(chunk_id, theirs)

    def test_a_mapping_key_must_match_the_header(self) -> None:
        data = random_bytes(3000, 11)
        codec, chunk_id, blobs = self.encoded(2, 4, data)
        with pytest.raises(NotEnoughFragments, match="header says index 1"):
            codec.decode(chunk_id, {0: blobs[0], 3: blobs[1]})

    def test_not_a_fragment_is_reported(self) -> None:
        data = random_bytes(300, 12)
        codec, chunk_id, blobs = self.encoded(2, 4, data)
        with pytest.raises(NotEnoughFragments, match="not a fragment"):
            codec.decode(chunk_id, [blobs[0], 42])  # type: ignore[list-item]
        with pytest.raises(InvalidParameters, match="not a single bytes"):
            codec.decode(chunk_id, blobs[0])  # type: ignore[arg-type]
        with pytest.raises(InvalidParameters, match="chunk id"):
            codec.decode("not-an-id", blobs)

    # -- fragments that pass their CRC yet are wrong: the BLAKE3 verdict -------------------

    def forged(self, blob: bytes, payload: bytes | None = None, **fields: object) -> bytes:
        """``blob`` rebuilt with a valid header and CRC but other payload bytes or fields."""
        frag = parse_fragment(blob)
        if payload is None:
            payload = flip(bytes(frag.payload), len(frag.payload) // 2)
        values: dict[str, object] = {
            "codec": frag.codec,
            "k": frag.k,
            "n": frag.n,
            "index": frag.index,
            "length": frag.length,
            "chunk_id": frag.chunk_id,
        }
        values.update(fields)
        return build_fragment(payload=payload, **values).to_bytes()  # type: ignore[arg-type]

    @pytest.mark.parametrize("victim", [0, 2, 4])
    def test_a_crc_valid_wrong_fragment_is_outvoted_by_the_hash(self, victim: int) -> None:
        data = random_bytes(5000, 13)
        codec, chunk_id, blobs = self.encoded(3, 5, data)
        given = list(blobs)
        given[victim] = self.forged(blobs[victim])
        assert codec.decode(chunk_id, given) == data
        # With exactly k, one of them wrong: no subset hashes right, and no bytes come out.
        others = [given[i] for i in range(5) if i != victim][:2]
        with pytest.raises(DecodeMismatch, match="none hashes to the chunk id"):
            codec.decode(chunk_id, [given[victim], *others])

    @pytest.mark.parametrize("victim", [0, 9])
    def test_one_wrong_fragment_among_many_is_found_within_k_tries(self, victim: int) -> None:
        data = random_bytes(20000, 18)
        codec, chunk_id, blobs = self.encoded(10, 14, data)
        codec.max_decode_attempts = 11  # the first subset, then at most k swaps
        given = list(blobs)
        given[victim] = self.forged(blobs[victim])
        assert codec.decode(chunk_id, given) == data

    @pytest.mark.parametrize("length", [0, 1, 4999, 5000, 5003])
    def test_decode_into_writes_the_same_bytes_into_the_callers_buffer(self, length: int) -> None:
        data = random_bytes(length, 21)
        codec, chunk_id, blobs = self.encoded(3, 5, data)
        for subset in ((0, 1, 2), (1, 3, 4), (4, 2, 0)):
            out = memoryview(bytearray(b"\xee" * (length + 7)))
            got = codec.decode_into(chunk_id, [blobs[i] for i in subset], out)
            assert got.obj is out.obj and got.nbytes == length and bytes(got) == data
            assert bytes(out[length:]) == b"\xee" * 7  # nothing written past the chunk
        if length:
            with pytest.raises(InvalidParameters, match="out holds"):
                codec.decode_into(chunk_id, blobs, memoryview(bytearray(length - 1)))
        with pytest.raises(InvalidParameters, match="writable"):
            codec.decode_into(chunk_id, blobs, memoryview(bytes(length)))

    def test_decode_into_outvotes_a_crc_valid_wrong_fragment_too(self) -> None:
        data = random_bytes(5000, 22)
        codec, chunk_id, blobs = self.encoded(3, 5, data)
        given = list(blobs)
        given[1] = self.forged(blobs[1])
        out = memoryview(bytearray(5000))
        assert bytes(codec.decode_into(chunk_id, given, out)) == data
        with pytest.raises(DecodeMismatch):
            codec.decode_into(chunk_id, given[:3], out)

    def test_a_forged_length_is_its_own_group(self) -> None:
        data = random_bytes(5000, 14)
        codec, chunk_id, blobs = self.encoded(2, 4, data)
        liar = self.forged(blobs[0], payload=bytes(parse_fragment(blobs[0]).payload), length=1)
        if self.codec_name == "zfec":
            # zfec knows the payload size a length implies, so the lie is caught up front.
            with pytest.raises(NotEnoughFragments, match="expected 1"):
                codec.decode(chunk_id, [liar, blobs[1]])
        assert codec.decode(chunk_id, [liar, blobs[1], blobs[2]]) == data

    def test_decode_attempts_are_bounded(self) -> None:
        data = random_bytes(2000, 15)
        codec = type(self.codec(2, 6))(2, 6, max_decode_attempts=3)
        chunk_id = chunk_id_of(data)
        blobs = [f.to_bytes() for f in codec.encode(chunk_id, data)]
        given = [self.forged(b) for b in blobs[:5]] + [blobs[5]]
        with pytest.raises(DecodeMismatch, match="3 decode"):
            codec.decode(chunk_id, given)
        with pytest.raises(InvalidParameters):
            type(codec)(2, 6, max_decode_attempts=0)

    def test_a_wrong_chunk_id_at_encode_never_yields_bytes(self) -> None:
        data = random_bytes(2000, 16)
        codec = self.codec(2, 4)
        wrong = chunk_id_of(b"something else")
        with pytest.raises(InvalidParameters, match="does not hash"):
            codec.encode(wrong, data, verify_id=True)
        frags = codec.encode(wrong, data)  # trusted without verify_id...
        with pytest.raises(DecodeMismatch):  # ...and decode refuses the bytes
            codec.decode(wrong, frags)
        with pytest.raises(InvalidParameters, match="chunk id"):
            codec.encode("0" * 63, data)
        with pytest.raises(InvalidParameters, match="contiguous"):
            codec.encode(chunk_id_of(data[::2]), memoryview(data)[::2])
        with pytest.raises(InvalidParameters, match="contiguous"):
            codec.encode(chunk_id_of(b""), "text")  # type: ignore[arg-type]

    # -- async -----------------------------------------------------------------------------

    async def test_async_wrappers_run_in_threads(self, monkeypatch: pytest.MonkeyPatch) -> None:
        data = random_bytes(300_000, 17)
        codec = self.codec(4, 6)
        chunk_id = chunk_id_of(data)
        loop_thread = threading.get_ident()
        seen: list[int] = []
        encode, decode = codec._encode_with_crcs, codec._decode_payloads

        def spy_encode(
            view: memoryview,
        ) -> tuple[Sequence[bytes | bytearray | memoryview], Sequence[int | None]]:
            seen.append(threading.get_ident())
            return encode(view)

        def spy_decode(fragments: Sequence[Fragment], length: int) -> bytes:
            seen.append(threading.get_ident())
            return decode(fragments, length)

        monkeypatch.setattr(codec, "_encode_with_crcs", spy_encode)
        monkeypatch.setattr(codec, "_decode_payloads", spy_decode)
        frags = await codec.encode_async(chunk_id, data)
        assert await codec.decode_async(chunk_id, frags[2:]) == data
        assert len(seen) == 2 and loop_thread not in seen

    async def test_concurrent_decodes_share_one_codec(self) -> None:
        codec = self.codec(4, 6)
        chunks = [random_bytes(200_000 + i, i) for i in range(8)]
        ids = [chunk_id_of(c) for c in chunks]
        encoded = await asyncio.gather(
            *(codec.encode_async(i, c) for i, c in zip(ids, chunks, strict=True))
        )
        decoded = await asyncio.gather(
            *(
                codec.decode_async(i, frags[j % 3 : j % 3 + 4])
                for j, (i, frags) in enumerate(zip(ids, encoded, strict=True))
            )
        )
        assert decoded == chunks
        with pytest.raises(NotEnoughFragments):
            await codec.decode_async(ids[0], encoded[0][:3])


class TestZfec(CodecConformance):
    codec_name = "zfec"


@pytest.mark.skipif(
    not isal_available(), reason="pyeclib with ISA-L not installed (the optional isal extra)"
)
class TestIsal(CodecConformance):
    codec_name = "isal"


# -- make_codec and parameters -----------------------------------------------------------


def test_default_codec_is_zfec() -> None:
    assert DEFAULT_CODEC == "zfec"
    assert isinstance(make_codec(DEFAULT_CODEC, 4, 6), ZfecCodec)


@pytest.mark.parametrize(
    ("k", "n"), [(0, 2), (2, 2), (3, 2), (1, 257), (-1, 4), (True, 3), (2.0, 4), (2, "4")]
)
@pytest.mark.parametrize("name", sorted(CODECS))
def test_bad_parameters_are_refused_clearly(name: str, k: object, n: object) -> None:
    with pytest.raises(InvalidParameters, match="1 <= k < n <= 256"):
        make_codec(name, k, n)  # type: ignore[arg-type]


def test_unknown_codec_names_the_known_ones() -> None:
    with pytest.raises(InvalidParameters, match="unknown codec 'rs'; known: isal, zfec"):
        make_codec("rs", 2, 3)


def test_isal_without_pyeclib_says_to_install_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyeclib.ec_iface", None)  # makes the import fail
    assert not isal_available()
    with pytest.raises(InvalidParameters, match=r"storaged\[isal\]"):
        make_codec("isal", 4, 6)
    with pytest.raises(InvalidParameters, match="pyeclib"):
        IsalCodec(4, 6)
