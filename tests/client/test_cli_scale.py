"""The CLI at the scale of real checkpoints, the formats people have, and the cluster view.

- ``save`` and ``restore`` of a 256 MiB file run in a child process whose peak RSS,
  measured against the same command on a tiny file, stays under half the file's size.
- A Hugging Face ``pytorch_model.bin``, a directory of safetensors shards with its
  index, ``--format``, raw bytes through stdin and stdout round-trip byte for byte;
  a torch file needing a full unpickle gets one clean line.
- ``rm`` of several names and of a prefix, ``--json`` output, the refusal of a
  restore whose target file system is too small, before anything is fetched.
- ``nodes`` against a cluster with a ``kill -9``-ed node, and ``status`` showing
  "reached" counts apart from where copies are now.

Node processes (``LocalCluster``), not in-process nodes: every command runs as a child
process (its RSS, output and exit status are what is checked), and ``nodes`` is asked
about a node process killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from storaged.cli import main
from storaged.client.formats import OutputItem, safetensors_header
from storaged.tools.local_cluster import LocalCluster
from tests.client.helpers import client_for
from tests.conftest import ADMIN_TOKEN, TOKEN, ClusterFactory

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

#: Runs the CLI and prints its peak RSS (KiB) last on stderr. VmHWM, not ru_maxrss: the
#: latter keeps the high-water mark of the forked test process across exec.
_MEASURED = (
    "import re, sys\n"
    "from storaged.cli import main\n"
    "status = main(sys.argv[1:])\n"
    "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())\n"
    "print(f'PEAK_RSS_KIB {hwm.group(1)}', file=sys.stderr)\n"
    "sys.exit(status)\n"
)


class Run(NamedTuple):
    status: int
    out: str
    err: str


def _name(tag: str) -> str:
    return f"scale/{tag}-{time.monotonic_ns() % 10**9}"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONASYNCIODEBUG": ""}


def _child(
    cluster: LocalCluster,
    *args: str,
    stdin: bytes | None = None,
    timeout: float = 240,
    url: str | None = None,
) -> subprocess.CompletedProcess[bytes]:
    argv = [*args, "--url", url or ",".join(cluster.urls), "--token", TOKEN]
    return subprocess.run(
        [sys.executable, "-c", _MEASURED, *argv],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env=_env(),
        cwd=REPO,
    )


def _peak_mib(proc: subprocess.CompletedProcess[bytes]) -> float:
    found = re.search(rb"PEAK_RSS_KIB (\d+)", proc.stderr)
    assert found, proc.stderr.decode(errors="replace")
    return int(found.group(1)) / 1024


@pytest.fixture
def cli(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """``cli(*args) -> Run(status, stdout, stderr)`` in this process, against the cluster."""

    def run(*args: str) -> Run:
        capsys.readouterr()
        argv = [*args, "--url", ",".join(cluster.urls), "--token", TOKEN]
        if args[0] in ("save", "restore"):
            argv.append("--no-progress")
        status = main(argv)
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return Run(status, out, err)

    yield run


def _write_safetensors(path: Path, arrays: dict[str, np.ndarray[Any, Any]]) -> None:
    """A .safetensors file written with the safetensors package (the format's reference)."""
    st = pytest.importorskip("safetensors.numpy")
    st.save_file(arrays, str(path))


def _sha(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MiB):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- memory


def test_save_and_restore_memory_is_bounded(cluster: LocalCluster, tmp_path: Path) -> None:
    size = 256 * MiB
    rng = np.random.default_rng(7)
    big = tmp_path / "big.safetensors"
    # One large tensor and a few small ones: random bytes, so nothing dedups.
    _write_safetensors(
        big,
        {
            "weight": rng.integers(0, 255, size=size - 3 * MiB, dtype=np.uint8).view(np.float32),
            "bias": rng.standard_normal(1000).astype(np.float32),
            "embed": rng.integers(0, 255, size=3 * MiB, dtype=np.uint8).view(np.float16),
        },
    )
    tiny = tmp_path / "tiny.safetensors"
    _write_safetensors(tiny, {"x": np.arange(10, dtype=np.float32)})
    names = {p: _name(p.stem) for p in (big, tiny)}
    peaks: dict[str, float] = {}
    for path, name in names.items():
        proc = _child(cluster, "save", str(path), name, "--no-progress")
        assert proc.returncode == 0, proc.stderr.decode()
        peaks[f"save {path.stem}"] = _peak_mib(proc)
        out = tmp_path / f"back-{path.name}"
        proc = _child(cluster, "restore", name, str(out), "--no-progress")
        assert proc.returncode == 0, proc.stderr.decode()
        peaks[f"restore {path.stem}"] = _peak_mib(proc)
    print(f"peak RSS (MiB): {peaks}")
    for command in ("save", "restore"):
        grown = peaks[f"{command} big"] - peaks[f"{command} tiny"]
        assert grown < size / MiB / 2, (command, peaks)
    # What was restored is what was saved, byte for byte.
    from safetensors.numpy import load_file

    want, got = load_file(str(big)), load_file(str(tmp_path / "back-big.safetensors"))
    assert sorted(want) == sorted(got)
    for key in want:
        assert want[key].dtype == got[key].dtype, key
        assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key  # NaNs


@pytest.mark.timeout(600)
def test_npz_save_memory_is_that_of_safetensors(cluster: LocalCluster, tmp_path: Path) -> None:
    """``save`` of a 256 MiB ``.npz`` (a C-ordered array, a byte-swapped one, a Fortran-
    ordered one, an empty one, a text member) peaks no higher than ``save`` of the same
    arrays as ``.safetensors``, measured in the same test (ratio 1.3 plus 64 MiB: the
    Fortran array's reorder blocks); the restored ``.npz`` holds the very values. A
    truncated archive, a non-zip, and one whose last member is damaged (found by its CRC
    after most chunks were uploaded) each fail in one line and commit nothing."""
    rng = np.random.default_rng(17)
    size = 256 * MiB
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "weight": rng.integers(0, 255, size=size - 96 * MiB, dtype=np.uint8).view(np.float32),
        "swapped": rng.integers(0, 255, size=32 * MiB, dtype=np.uint8).view(">f8"),
        "fortran": np.asfortranarray(
            rng.integers(0, 255, size=64 * MiB, dtype=np.uint8).view(np.float32).reshape(-1, 512)
        ),
        "empty": np.zeros((0, 7), dtype=np.float16),
    }
    npz = tmp_path / "big.npz"
    np.savez(npz, **arrays)  # type: ignore[arg-type]
    with zipfile.ZipFile(npz, "a") as archive:
        archive.writestr("config.json", b'{"lr": 0.001}')
    st = pytest.importorskip("safetensors.numpy")
    native = {
        k: np.ascontiguousarray(v, dtype=v.dtype.newbyteorder("=")) for k, v in arrays.items()
    }
    st.save_file(native, str(tmp_path / "big.safetensors"))
    del native
    peaks = {}
    names = {}
    for path in (tmp_path / "big.safetensors", npz):
        names[path.suffix] = _name(path.suffix[1:])
        proc = _child(cluster, "save", str(path), names[path.suffix], "--no-progress")
        assert proc.returncode == 0, proc.stderr.decode()
        peaks[path.suffix] = _peak_mib(proc)
    print(f"save peak RSS (MiB): {peaks}")
    assert peaks[".npz"] <= peaks[".safetensors"] * 1.3 + 64, peaks

    back = tmp_path / "back.npz"
    proc = _child(cluster, "restore", names[".npz"], str(back), "--no-progress")
    assert proc.returncode == 0, proc.stderr.decode()
    with np.load(back, allow_pickle=False) as z:
        assert sorted(z.files) == sorted([*arrays, "config.json"])
        for key, want in arrays.items():
            got = z[key]
            assert got.shape == want.shape and got.dtype == want.dtype.newbyteorder("="), key
            assert np.array_equal(
                got.view(np.uint8), np.ascontiguousarray(want, dtype=got.dtype).view(np.uint8)
            ), key
    with zipfile.ZipFile(back) as archive:
        assert archive.read("config.json") == b'{"lr": 0.001}'

    # Bad archives: one line each, nothing committed under their names.
    data = npz.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    not_zip = tmp_path / "not-zip.npz"
    not_zip.write_bytes(b"PK not really" + bytes(4096))
    damaged = tmp_path / "damaged.npz"
    # the last bytes of the C-ordered weight, flipped: found when its last piece is read
    at = data.index(arrays["weight"][-4:].tobytes())
    damaged.write_bytes(data[:at] + bytes(b ^ 0xFF for b in data[at : at + 4]) + data[at + 4 :])
    del data
    for path, message in (
        (truncated, "not a readable .npz archive"),
        (not_zip, "not a readable .npz archive"),
        (damaged, "CRC-32 does not match"),
    ):
        name = _name(path.stem)
        proc = _child(cluster, "save", str(path), name, "--no-progress")
        err = re.sub(r"PEAK_RSS_KIB \d+\n", "", proc.stderr.decode())
        assert proc.returncode == 1, (path, err)
        assert message in err and len(err.strip().splitlines()) == 1, (path, err)
        listed = _child(cluster, "ls", name, "--json")
        assert listed.returncode == 0, listed.stderr.decode()
        assert json.loads(listed.stdout)["checkpoints"] == [], path


# --------------------------------------------------------------------------- formats


class TrainerState:
    """An object a training script pickles along with its tensors."""


def test_pytorch_model_bin_and_refusal(cli: Any, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    state = {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=gen),
        "lm_head.weight": torch.randn(300, 64, generator=gen).t(),  # not contiguous
    }
    bin_file = tmp_path / "pytorch_model.bin"
    torch.save(state, bin_file)
    name = _name("bin")
    r = cli("save", str(bin_file), name, "--chunk-size", "64KiB")
    assert r.status == 0, r.err
    assert f"saved {name}: 3 items" in r.out
    r = cli("restore", name, str(tmp_path / "back.safetensors"))
    assert r.status == 0, r.err
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "back.safetensors"))
    for key, want in state.items():
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key

    unsafe = tmp_path / "full.pt"
    torch.save({"w": torch.ones(2), "obj": TrainerState()}, unsafe)
    r = cli("save", str(unsafe), _name("unsafe"))
    assert r.status == 1
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert "needs a full unpickle" in r.err and f"{__name__}.TrainerState" in r.err
    assert "\x1b[" not in r.err and r.err.rstrip().endswith(".safetensors")


def test_sharded_safetensors_directory(cli: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    shards: dict[str, dict[str, np.ndarray[Any, Any]]] = {
        "model-00001-of-00002.safetensors": {
            "a.weight": rng.standard_normal((200, 300)).astype(np.float32),
            "a.bias": rng.standard_normal(300).astype(np.float16),
        },
        "model-00002-of-00002.safetensors": {
            "b.weight": rng.integers(-100, 100, (50, 70)).astype(np.int64),
        },
    }
    directory = tmp_path / "hf-model"
    directory.mkdir()
    weight_map = {}
    for filename, arrays in shards.items():
        _write_safetensors(directory / filename, arrays)
        weight_map.update(dict.fromkeys(arrays, filename))
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text("{}")  # what else such a directory holds

    name = _name("shards")
    r = cli("save", str(directory), name, "--json")
    assert r.status == 0, r.err
    assert json.loads(r.out)["items"] == 3 + 2 + 2  # tensors, shard headers, other files
    out = tmp_path / "merged.safetensors"
    r = cli("restore", name, str(out))
    assert r.status == 0, r.err
    from safetensors.numpy import load_file

    got = load_file(str(out))
    for arrays in shards.values():
        for key, want in arrays.items():
            assert got[key].dtype == want.dtype and np.array_equal(got[key], want), key

    assert "config.json" in r.err and "directory restore" in r.err  # what it left out
    # A directory naming a shard that is not there: one line, nothing saved.
    (directory / "model-00002-of-00002.safetensors").unlink()
    r = cli("save", str(directory), _name("shards"))
    assert r.status == 1 and "cannot read" in r.err and "00002" in r.err


def _hf_directory(root: Path) -> Path:
    """A Hugging Face model directory as ``save_pretrained`` leaves it: two shards, their
    index, the config, generation config and tokenizer files, an empty file, a subfolder."""
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(11)
    root.mkdir()
    shards: dict[str, dict[str, np.ndarray[Any, Any]]] = {
        "model-00001-of-00002.safetensors": {
            "model.embed.weight": rng.standard_normal((300, 64)).astype(np.float32),
            "model.norm.weight": rng.standard_normal(64).astype(np.float16),
        },
        "model-00002-of-00002.safetensors": {
            "lm_head.weight": rng.standard_normal((300, 64)).astype(np.float32),
        },
    }
    weight_map: dict[str, str] = {}
    for filename, arrays in shards.items():
        st.save_file(arrays, str(root / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(arrays, filename))
    index = {"metadata": {"total_size": 2 * 300 * 64 * 4 + 64 * 2}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text('{"architectures": ["Tiny"], "hidden_size": 64}\n')
    (root / "generation_config.json").write_text('{"max_new_tokens": 32}\n')
    (root / "tokenizer.json").write_bytes(rng.bytes(300_000))  # several chunks of 64 KiB
    (root / "special_tokens_map.json").write_text("")
    (root / "extra").mkdir()
    (root / "extra" / "notes.txt").write_text("fine-tuned on step 1200\n")
    return root


def _same_tree(a: Path, b: Path) -> None:
    """``diff -r`` equal: the same files, byte for byte, and nothing else."""
    proc = subprocess.run(["diff", "-r", str(a), str(b)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_empty_item_before_a_large_one_saves_every_byte(cli: Any, tmp_path: Path) -> None:
    """An empty array shares its stream start with the large one after it: the large one's
    first chunk was once uploaded unfilled (test_client_layout has the property)."""
    big = np.random.default_rng(3).standard_normal(600_000).astype(np.float32)  # 2.3 MiB
    src = tmp_path / "e.npz"
    np.savez(src, big=big, empty=np.zeros(0, dtype=np.float32))
    name = _name("empty")
    assert cli("save", str(src), name, "--chunk-size", "1MiB").status == 0
    out = tmp_path / "back.npz"
    r = cli("restore", name, str(out))
    assert r.status == 0, r.err
    with np.load(out) as z:
        assert np.array_equal(z["big"], big) and z["empty"].shape == (0,)


def test_a_hugging_face_directory_comes_back_as_it_was(cli: Any, tmp_path: Path) -> None:
    source = _hf_directory(tmp_path / "hf")
    name = _name("hf")
    r = cli("save", str(source) + "/", name, "--chunk-size", "64KiB")
    assert r.status == 0, r.err

    out = tmp_path / "out"
    out.mkdir()
    r = cli("restore", name, str(out / "hf") + "/")
    assert r.status == 0, r.err
    _same_tree(source, out / "hf")
    # a name without a suffix, and an existing empty directory: a directory too
    r = cli("restore", name, str(out / "plain"))
    assert r.status == 0, r.err
    _same_tree(source, out / "plain")
    (out / "empty").mkdir()
    r = cli("restore", name, str(out / "empty"))
    assert r.status == 0, r.err
    _same_tree(source, out / "empty")
    # a directory with something in it: refused, untouched; --force replaces it
    (out / "busy").mkdir()
    (out / "busy" / "keep.txt").write_text("mine")
    r = cli("restore", name, str(out / "busy"))
    assert r.status == 1 and "not empty" in r.err and "--force" in r.err
    assert [p.name for p in (out / "busy").iterdir()] == ["keep.txt"]
    r = cli("restore", name, str(out / "busy"), "--force")
    assert r.status == 0, r.err
    _same_tree(source, out / "busy")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left

    # saved again from the restored tree: every chunk is already held
    r = cli("save", str(out / "hf"), _name("hf-again"), "--chunk-size", "64KiB", "--json")
    assert r.status == 0, r.err
    assert json.loads(r.out)["uploaded"] == 0

    # into one file: the tensors merged, and a note of the files left out
    merged = tmp_path / "merged.safetensors"
    r = cli("restore", name, str(merged))
    assert r.status == 0, r.err
    assert "config.json" in r.err and "directory restore" in r.err
    from safetensors.numpy import load_file

    assert set(load_file(str(merged))) == {
        "model.embed.weight", "model.norm.weight", "lm_head.weight"}  # fmt: skip

    # a checkpoint saved from one file, into a directory: says what to do instead
    single = _name("single")
    assert cli("save", str(merged), single).status == 0
    r = cli("restore", single, str(out / "nope") + "/")
    assert r.status == 1 and "not a directory of shards" in r.err
    assert not (out / "nope").exists()
    r = cli("restore", single, str(out / "nosuffix"))
    assert r.status == 2 and "unknown file type" in r.err


def test_format_flag_stdin_and_stdout(cluster: LocalCluster, tmp_path: Path) -> None:
    payload = np.random.default_rng(9).bytes(3 * MiB + 12345)
    name = _name("raw")
    proc = _child(
        cluster, "save", "-", name, "--format", "raw", "--chunk-size", "1MiB", stdin=payload
    )
    assert proc.returncode == 0, proc.stderr.decode()
    proc = _child(cluster, "restore", name, "-", "--format", "raw")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == payload  # the report went to stderr, the data alone to stdout
    proc = _child(cluster, "restore", name, "-")  # the format it was saved from: raw
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == payload

    # No extension: --format says it; without it, a usage error naming --format.
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "n": np.arange(3),
    }
    odd = tmp_path / "weights.data"
    _write_safetensors(odd, arrays)
    name = _name("fmt")
    proc = _child(cluster, "save", str(odd), name)
    assert proc.returncode == 2 and b"--format" in proc.stderr
    proc = _child(cluster, "save", str(odd), name, "--format", "safetensors")
    assert proc.returncode == 0, proc.stderr.decode()
    # Restored to stdout as .safetensors, and as .npz.
    proc = _child(cluster, "restore", name, "-", "--format", "safetensors")
    assert proc.returncode == 0, proc.stderr.decode()
    (tmp_path / "out.safetensors").write_bytes(proc.stdout)
    from safetensors.numpy import load_file

    got = load_file(str(tmp_path / "out.safetensors"))
    assert all(np.array_equal(got[k], v) for k, v in arrays.items())
    proc = _child(cluster, "restore", name, "-")  # saved from safetensors: safetensors
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == (tmp_path / "out.safetensors").read_bytes()
    proc = _child(cluster, "restore", name, "-", "--format", "npz")
    assert proc.returncode == 0, proc.stderr.decode()
    (tmp_path / "out.npz").write_bytes(proc.stdout)
    npz_name = _name("npz")
    proc = _child(cluster, "save", str(tmp_path / "out.npz"), npz_name)
    assert proc.returncode == 0, proc.stderr.decode()
    proc = _child(cluster, "restore", npz_name, "-")  # saved from npz: npz
    assert proc.returncode == 0, proc.stderr.decode()
    (tmp_path / "again.npz").write_bytes(proc.stdout)
    with np.load(tmp_path / "again.npz") as z:
        assert all(np.array_equal(z[k], v) for k, v in arrays.items())
    with np.load(tmp_path / "out.npz") as z:
        assert all(np.array_equal(z[k], v) for k, v in arrays.items())
    # torch needs a seekable file; stdin holds raw bytes only.
    proc = _child(cluster, "restore", name, "-", "--format", "torch")
    assert proc.returncode == 2 and b"stdout" in proc.stderr
    torch_file = tmp_path / "w.pt"
    proc = _child(cluster, "restore", name, str(torch_file))
    assert proc.returncode == 0, proc.stderr.decode()
    torch_name = _name("pt")
    proc = _child(cluster, "save", str(torch_file), torch_name)
    assert proc.returncode == 0, proc.stderr.decode()
    proc = _child(cluster, "restore", torch_name, "-")  # saved from torch: cannot, says so
    assert proc.returncode == 2 and b"--format" in proc.stderr and proc.stdout == b""
    proc = _child(cluster, "save", "-", _name("x"), "--format", "npz", stdin=b"")
    assert proc.returncode == 2 and b"stdin" in proc.stderr


def test_safetensors_header_matches_the_reference(tmp_path: Path) -> None:
    """The header restore writes is one the safetensors package reads, bfloat16 included."""
    items = [
        OutputItem("a", "float32", (2, 3)),
        OutputItem("b", "bfloat16", (5,)),
        OutputItem("c", "bool", ()),
    ]
    body = np.arange(6, dtype=np.float32).tobytes() + bytes(range(10)) + b"\x01"
    path = tmp_path / "h.safetensors"
    path.write_bytes(safetensors_header(items, {"step": 7}) + body)
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"step": "7"}
        assert np.array_equal(f.get_tensor("a"), np.arange(6, dtype=np.float32).reshape(2, 3))
        assert f.get_tensor("c").shape == ()
        assert f.get_slice("b").get_dtype() == "BF16"


# --------------------------------------------------------------------------- rm / room


def test_rm_several_and_prefix(cli: Any, tmp_path: Path) -> None:
    src = tmp_path / "a.npz"
    np.savez(src, x=np.arange(100))
    prefix = _name("rm")
    names = [f"{prefix}/{i}" for i in range(4)]
    for name in names:
        assert cli("save", str(src), name).status == 0
    r = cli("rm", names[0], names[1], "--json")
    assert r.status == 0, r.err
    assert json.loads(r.out) == {"deleted": names[:2], "missing": []}
    # A missing name among others: the others go, the status says one was not there.
    r = cli("rm", names[2], f"{prefix}/nope")
    assert r.status == 1 and f"no checkpoint named {prefix}/nope" in r.err
    assert f"deleted {names[2]}" in r.out
    r = cli("rm", "--prefix", prefix + "/")
    assert r.status == 0 and r.out.strip() == f"deleted {names[3]}"
    r = cli("ls", prefix, "--json")
    assert json.loads(r.out) == {"checkpoints": []}
    # A prefix matching nothing (now, or a typo) says so and fails: nothing was deleted.
    r = cli("rm", "--prefix", prefix + "/")
    assert r.status == 1 and "no checkpoint name starts with" in r.err and r.out == ""
    assert cli("rm").status == 2
    assert cli("rm", "--prefix", "").status == 2


def test_restore_refused_when_the_target_cannot_hold_it(cli: Any, tmp_path: Path) -> None:
    small = tmp_path / "small-fs"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        src = tmp_path / "a.npz"
        np.savez(src, x=np.random.default_rng(1).random(4 * MiB // 8))
        name = _name("room")
        assert cli("save", str(src), name).status == 0
        r = cli("restore", name, str(small / "out.npz"))
        assert r.status == 1
        assert "cannot restore into" in r.err and "free (nothing was fetched)" in r.err
        assert list(small.iterdir()) == []
        r = cli("restore", name, str(tmp_path / "out.npz"))  # where there is room
        assert r.status == 0, r.err
    finally:
        subprocess.run(["umount", str(small)], check=False)


# --------------------------------------------------------------------------- cluster view


def _nodes(
    cluster: LocalCluster, *extra: str, url: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    return _child(cluster, "nodes", *extra, timeout=60, url=url)


def test_nodes_and_status_after_a_kill(cluster_factory: ClusterFactory, tmp_path: Path) -> None:
    cluster = cluster_factory(4)
    src = tmp_path / "a.npz"
    np.savez(src, x=np.random.default_rng(2).random(3 * MiB // 8), y=np.arange(10))
    name = _name("view")
    proc = _child(cluster, "save", str(src), name, "--chunk-size", "1MiB", "--wait", "nvme")
    assert proc.returncode == 0, proc.stderr.decode()

    proc = _nodes(cluster, "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    doc = json.loads(proc.stdout)
    assert [n["id"] for n in doc["nodes"]] == [cluster.node_id(i) for i in range(4)]
    assert doc["down"] == []
    # Each node's chunk counts (from its figures): the 4 chunks are held somewhere.
    counts = [n[tier]["chunks"] for n in doc["nodes"] for tier in ("memory", "nvme", "cold")]
    assert all(isinstance(c, int) for c in counts) and sum(counts) >= 4
    assert all(n["drain_backlog"] is not None for n in doc["nodes"])
    # Repair's backlog, apart: what lacks copies and what only sits outside its placement.
    assert all(n["repair_backlog"] is not None for n in doc["nodes"])
    assert all(n["misplaced_backlog"] is not None for n in doc["nodes"])

    # "reached" never goes back; "now" follows the copies: evicted from RAM, they are on nvme.
    async def evict() -> None:
        async with client_for(cluster) as client:
            await client.evict(name, "memory", admin_token=ADMIN_TOKEN)

    asyncio.run(evict())
    proc = _child(cluster, "status", name, "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    st = json.loads(proc.stdout)
    assert st["memory"] == st["nvme"] == st["chunks"] == 4
    assert st["now"]["memory"] == 0 and st["now"]["hot"] == 4 and st["now"]["unavailable"] == 0

    cluster.kill(1)
    deadline = time.monotonic() + 60
    while True:  # until the survivors have noticed (down_after)
        proc = _nodes(cluster, url=cluster.url(0))
        # Exit 3 comes as soon as the client finds the node not answering (marked NOT
        # ANSWERING), before the survivors' heartbeats call it DOWN: wait for the verdict.
        rows = proc.stdout.decode().splitlines()
        killed = [r for r in rows if r.startswith(cluster.node_id(1))]
        if (proc.returncode == 3 and killed and "DOWN" in killed[0]) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.3)
    assert proc.returncode == 3, proc.stdout.decode() + proc.stderr.decode()
    table = proc.stdout.decode().splitlines()
    assert table[0].split()[:2] == ["NODE", "STATE"]
    assert "LACKING" in table[0].split() and "MISPLACED" in table[0].split()
    row = next(line for line in table if line.startswith(cluster.node_id(1)))
    assert "DOWN" in row
    assert f"1 of 4 nodes down: {cluster.node_id(1)}" in proc.stderr.decode()
    proc = _child(cluster, "status", name, "--json", url=cluster.url(0))
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["now"]["unavailable"] == 0  # 3 copies, one node gone


def test_nodes_marks_a_gc_stall_with_its_cause(cluster_factory: ClusterFactory) -> None:
    """A node whose GC has not completed a pass for longer than the grace is STALLED in
    ``storaged nodes``, with a line saying since when and why; the others say ok."""
    cluster = cluster_factory(4, gc_grace=1.0, gc_interval=0.3)
    stalled = cluster.node_id(2)

    async def pause() -> None:
        import aiohttp

        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{cluster.url(2)}/v1/admin/gc",
                json={"pause": 120},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            ) as r,
        ):
            assert r.status == 200, await r.text()
            assert (await r.json())["node"] == stalled

    asyncio.run(pause())
    deadline = time.monotonic() + 60
    while True:  # until the stall is older than the grace and in a heartbeat
        proc = _nodes(cluster, url=cluster.url(0))
        if "GC stalled" in proc.stdout.decode() or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    table = out.splitlines()
    assert "GC" in table[0].split()
    ids = {cluster.node_id(i) for i in range(4)}
    rows = {line.split()[0]: line for line in table[1:] if line.split()[0] in ids}
    assert set(rows) == ids
    assert "STALLED" in rows[stalled]
    assert all(" ok " in row for node, row in rows.items() if node != stalled), out
    assert f"{stalled}: GC stalled since" in out and "paused by an operator" in out
    doc = json.loads(_nodes(cluster, "--json").stdout)
    gc = next(n["gc"] for n in doc["nodes"] if n["id"] == stalled)
    assert gc["stalled_since"] is not None and "paused" in gc["cause"]


def test_a_saved_file_name_never_leaves_the_restored_directory(tmp_path: Path) -> None:
    """A manifest naming a side file outside its directory (``file:../x``, absolute) is
    refused before anything is written there."""
    from storaged.client.format_names import FormatError
    from storaged.client.formats import DirectoryWriter

    root = tmp_path / "out"
    root.mkdir()
    writer = DirectoryWriter(root, {"weight_map": {}}, [])
    for rel in ("../evil.txt", "/etc/evil", "a/../../evil"):
        with pytest.raises(FormatError, match="outside the directory"):
            writer.begin(OutputItem(f"file:{rel}", "uint8", (1,)))
    writer.abandon()
    assert not (tmp_path / "evil.txt").exists() and list(root.iterdir()) == []


def test_bad_values_metadata_is_refused_in_one_line(tmp_path: Path) -> None:
    """A .safetensors whose ``storaged.values`` is not a JSON object is not saved."""
    from storaged.client.format_names import FormatError
    from storaged.client.formats import open_source

    st = pytest.importorskip("safetensors.numpy")
    for text, why in (("{not json", "is not JSON"), ("[1, 2]", "is not a JSON object")):
        path = tmp_path / "v.safetensors"
        st.save_file({"w": np.zeros(3, np.float32)}, str(path), metadata={"storaged.values": text})
        with pytest.raises(FormatError, match=why):
            open_source(str(path), "safetensors")
