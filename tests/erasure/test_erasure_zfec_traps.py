"""The two zfec 1.6 traps: shown on raw zfec, and shown handled by ``ZfecCodec``.

If a zfec release fixes a trap, its "raw" test fails: then the guard may be simplified,
but the codec tests must keep passing.
"""

from __future__ import annotations

import itertools
import random

import pytest
import zfec

from erasure import HEADER_SIZE, CorruptFragment, NotEnoughFragments, ZfecCodec, parse_fragment
from storaged.ids import chunk_id_of

K, N, BLOCK = 4, 6, 1000


def raw_blocks(seed: int = 0) -> tuple[bytes, list[bytes]]:
    data = random.Random(seed).randbytes(K * BLOCK)
    primaries = [data[i * BLOCK : (i + 1) * BLOCK] for i in range(K)]
    return data, list(zfec.Encoder(K, N).encode(primaries))


# -- trap 1: Decoder.decode reorders the list it is given, in place ----------------------


def test_raw_zfec_reorders_a_list_in_place_and_a_reused_list_decodes_garbage() -> None:
    data, blocks = raw_blocks()
    decoder = zfec.Decoder(K, N)
    numbers = [0, 4, 1, 5]
    given = [blocks[i] for i in numbers]
    before = list(given)
    assert b"".join(decoder.decode(given, numbers)) == data
    assert given != before  # the blocks moved...
    assert numbers == [0, 4, 1, 5]  # ...their numbers did not
    assert b"".join(decoder.decode(given, numbers)) != data  # so a second call is wrong


def test_raw_zfec_reorders_even_a_tuple_but_a_fresh_one_each_call_is_safe() -> None:
    # zfec swaps the items of whatever sequence object it gets, a tuple included, so the
    # only guard is the one ZfecCodec uses: a fresh container, held by nobody else, per call.
    data, blocks = raw_blocks()
    decoder = zfec.Decoder(K, N)
    reused = tuple(blocks[i] for i in (0, 4, 1, 5))
    assert b"".join(decoder.decode(reused, (0, 4, 1, 5))) == data
    assert b"".join(decoder.decode(reused, (0, 4, 1, 5))) != data
    for order in itertools.permutations([0, 4, 1, 5]):
        for _ in range(2):
            fresh = tuple(blocks[i] for i in order)
            assert b"".join(decoder.decode(fresh, tuple(order))) == data


def test_codec_decodes_the_same_list_twice_and_every_permutation() -> None:
    data = random.Random(1).randbytes(K * BLOCK - 3)
    codec = ZfecCodec(K, N)
    chunk_id = chunk_id_of(data)
    blobs = [f.to_bytes() for f in codec.encode(chunk_id, data)]
    frags = codec.encode(chunk_id, data)
    for order in itertools.permutations([0, 4, 1, 5]):
        given = [blobs[i] for i in order]
        snapshot = list(given)
        assert codec.decode(chunk_id, given) == data
        assert given == snapshot  # the caller's list is left alone
        assert codec.decode(chunk_id, given) == data
        objects = [frags[i] for i in order]
        assert codec.decode(chunk_id, objects) == data
        assert codec.decode(chunk_id, objects) == data


# -- trap 2: a corrupted block decodes into wrong bytes without error ----------------------


@pytest.mark.parametrize("victim", [1, 4])  # a primary block, a parity block
def test_raw_zfec_returns_wrong_bytes_from_a_corrupted_block(victim: int) -> None:
    data, blocks = raw_blocks(2)
    corrupted = bytearray(blocks[victim])
    corrupted[BLOCK // 2] ^= 0x01
    numbers = (victim, *[i for i in (0, 2, 3, 5) if i != victim][: K - 1])
    given = tuple(bytes(corrupted) if i == victim else blocks[i] for i in numbers)
    decoded = b"".join(zfec.Decoder(K, N).decode(given, numbers))
    assert len(decoded) == len(data)
    assert decoded != data  # no error raised, wrong bytes


@pytest.mark.parametrize("victim", [1, 4])
def test_codec_skips_the_corrupted_fragment(victim: int) -> None:
    data = random.Random(2).randbytes(K * BLOCK)
    codec = ZfecCodec(K, N)
    chunk_id = chunk_id_of(data)
    blobs = [f.to_bytes() for f in codec.encode(chunk_id, data)]
    corrupted = bytearray(blobs[victim])
    corrupted[HEADER_SIZE + BLOCK // 2] ^= 0x01
    with pytest.raises(CorruptFragment, match=f"fragment {victim}: payload checksum mismatch"):
        parse_fragment(corrupted)
    others = [i for i in range(N) if i != victim]
    # k good fragments besides the corrupted one: it is skipped and the bytes are right.
    assert codec.decode(chunk_id, [corrupted, *(blobs[i] for i in others[:K])]) == data
    # Only k-1 besides it: the raw library would have returned wrong bytes; the codec refuses.
    with pytest.raises(NotEnoughFragments, match=r"3 good fragment.*4 needed.*checksum mismatch"):
        codec.decode(chunk_id, [corrupted, *(blobs[i] for i in others[: K - 1])])
