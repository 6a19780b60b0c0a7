"""The scale model: one checkpoint's phases on a cluster of N nodes, on paper.

Projects the save stall, the ack, the drain to nvme, the erasure encode and the restores
of one checkpoint next to a central filesystem, from two inputs kept apart:

- ``Rates``: what one node's storaged does per core, per drive or per thread, measured by
  the load tests (``python -m loadtest ...`` result files, which the caller names). A
  rate without a file that measures it keeps a documented default, and says so.
- ``Assumptions``: what one machine cannot measure (NIC bandwidth, cores given to
  storaged, drives, RAM, GPUs, the filesystem, the model size, the sharding).

Each phase is a set of demands, one per resource it needs (seconds of NIC, CPU, disk,
...); the phase takes as long as its largest demand, and that resource is its bound.
Phases that run concurrently in a real cluster (ack, drain, encode) are summed per
resource to give the time until a checkpoint is durable on nvme or cold. Every formula
is written out in docs/SCALE.md. ``storaged advise`` uses it; ``python -m loadtest.model``
prints it for many cluster sizes, with a plot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

GB = 1e9
#: The ack and fabric load tests run the default replication: their CPU per acked GB and
#: their bytes on the links per byte saved cover 3 copies.
MEASURED_REPLICATION = 3
#: The load tests' result files the rates are read from, by kind (``<kind>.json``).
RESULT_KINDS = ("ack", "save", "restore", "nvme", "fabric")

#: zfec through storaged's codec wrapper, GB/s on one core, 8 MiB chunks: encode, decode
#: from the k primary fragments, decode with fragment 0 missing (docs/BENCHMARKS.md, Codec).
ZFEC_RATES: dict[tuple[int, int], tuple[float, float, float]] = {
    (4, 6): (1.00, 2.66, 1.20),
    (8, 12): (0.54, 2.42, 1.15),
    (10, 14): (0.50, 2.23, 1.03),
}


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Assumptions:
    """What a production node and job look like; nothing here is measured."""

    #: Bytes of one checkpoint: 405e9 parameters x 16 bytes (bf16 weights, fp32 master
    #: weights, two fp32 Adam moments, fp32 gradients... the usual mixed-precision total).
    model_bytes: float = 405e9 * 16
    #: Copies of each byte of state held across the job: 1 when data-parallel ranks shard
    #: the optimizer state too (ZeRO-3/FSDP), R when R data-parallel replicas each hold a full
    #: copy (only one replica writes; every replica restores).
    replicas: int = 1
    #: NIC bandwidth per direction, GB/s (400 Gb/s = 50 GB/s).
    nic_gbps: float = 50.0
    #: Cores the node gives to storaged (the rest feed the GPUs).
    cores: int = 16
    gpus: int = 8
    #: Practical device-to-host (and back) copy rate per GPU, GB/s.
    pcie_gbps: float = 25.0
    #: The memory tier's capacity per node, bytes.
    memory_bytes: float = 256e9
    #: Local nvme drives per node, each as fast as this machine's disk (measured).
    nvme_drives: int = 8
    replication: int = 3
    k: int = 4
    n: int = 6
    #: The client hands its chunks to the local node through shared memory (DESIGN.md), so
    #: only replication - 1 copies cross the NIC; False is the socket path of today's
    #: client, where the first placement node is almost always remote: all copies cross.
    local_copy: bool = True
    #: Cold restores read all n fragments and keep the first k (n/k times the bytes).
    hedged_cold_reads: bool = False
    #: The central filesystem the job would use instead: aggregate GB/s...
    fs_gbps: float = 100.0
    #: ...and file creates (or opens) per second across the whole filesystem.
    fs_metadata_ops: float = 50_000.0
    #: Files one node writes per checkpoint (one per rank).
    files_per_node: int = 8

    def check(self) -> None:
        """``ValueError`` naming the first assumption that cannot be right."""
        positive = (
            "model_bytes",
            "nic_gbps",
            "pcie_gbps",
            "memory_bytes",
            "fs_gbps",
            "fs_metadata_ops",
        )
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("replicas", "cores", "gpus", "nvme_drives", "replication", "files_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 1 <= self.k < self.n:
            raise ValueError(f"erasure k={self.k} n={self.n}: need 1 <= k < n")


@dataclass(frozen=True)
class Rates:
    """Per-node rates measured on this machine, each with where it came from.

    CPU figures are per core (CPU seconds per GB, or GB/s on one core); disk figures are
    per drive; ``memcpy_gbps`` is one thread; link figures are ratios to a link's cap or
    bytes on the links per byte saved (``loadtest.fabric``: nodes on capped links), which
    the model applies to the assumed NIC.
    """

    #: CPU seconds of all storaged nodes per acknowledged GB (3 copies in RAM, ids checked).
    ack_node_cpu_s_per_gb: float = 12.95
    #: CPU seconds of the uploading client per acknowledged GB (chunk ids, sends).
    ack_client_cpu_s_per_gb: float = 0.357
    #: CPU seconds per GB restored, serving node and receiving client together.
    restore_cpu_s_per_gb: float = 1.10
    #: Host staging copy, one thread.
    memcpy_gbps: float = 3.4
    #: BLAKE3 on one core (the id check of nvme reads).
    hash_gbps: float = 4.5
    #: zfec through the codec wrapper on one core, at the assumed k, n.
    encode_gbps: float = 1.00
    decode_gbps: float = 2.66
    #: storaged's durable nvme write (temp file, fsync, rename), 4 in flight, one drive.
    nvme_write_gbps: float = 0.77
    #: Reading files back with a cold page cache, one drive.
    nvme_read_gbps: float = 0.62
    #: A restore's useful bytes per second over its links' caps, every holder's link
    #: serving (placement, hedged reads, headers): the NIC phases of restores divide by it.
    restore_link_efficiency: float = 1.0
    #: The ack's bytes saved per second over the writer's link cap (its latency and CPU:
    #: the writer's link is not full): the ack's NIC demand divides by it.
    ack_link_share: float = 1.0
    #: Bytes an entry node sends per byte saved at replication 3 (its fan-out of 2 copies,
    #: framing and resends included): per copy sent, half of it.
    ack_egress_copies: float = 2.0
    #: Bytes the nodes receive per byte saved at replication 3 (3 copies, the client's
    #: hop included): per copy received, a third of it.
    ack_ingress_copies: float = 3.0
    #: Rate name -> "measured: <file and field>" or "default: <why and provenance>".
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def check(self) -> None:
        for f in fields(self):
            if f.name == "sources":
                continue
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"rate {f.name} must be a positive number, got {value!r}")

    def values(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}


#: Where each default rate comes from, shown when a result file does not supply it.
DEFAULT_PROVENANCE = {
    "ack_node_cpu_s_per_gb": "loadtest.ack, storaged 4 nodes x3 c=8 (commit 3f398a9)",
    "ack_client_cpu_s_per_gb": "loadtest.ack, storaged 4 nodes x3 c=8 (commit 3f398a9)",
    "restore_cpu_s_per_gb": "stand-in: a one-copy aiohttp transfer, server + client "
    "(loadtest.ack baseline c=8, 0.773 + 0.330)",
    "memcpy_gbps": "numpy copyto of 256 MiB, best of 7, this machine",
    "hash_gbps": "BLAKE3 of 8 MiB, docs/BENCHMARKS.md (Codec)",
    "encode_gbps": "zfec wrapper encode, docs/BENCHMARKS.md (Codec)",
    "decode_gbps": "zfec wrapper decode from primaries, docs/BENCHMARKS.md (Codec)",
    "nvme_write_gbps": "loadtest.nvme --quick, tier x4 best",
    "nvme_read_gbps": "loadtest.nvme --quick, raw read with a cold page cache, best",
    "restore_link_efficiency": "assumed: restores fill the NIC",
    "ack_link_share": "assumed: the ack fills the writer's NIC",
    "ack_egress_copies": "assumed: replication - 1 = 2 copies, nothing more",
    "ack_ingress_copies": "assumed: replication = 3 copies, nothing more",
}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _rows(doc: Any, kind: str, section: str = "results") -> list[dict[str, Any]]:
    rows = doc.get(section, []) if isinstance(doc, dict) else []
    return [r for r in rows if isinstance(r, dict) and r.get("kind") == kind]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)


def _best_row(rows: Sequence[dict[str, Any]], *needed: str) -> dict[str, Any]:
    """The row with the highest throughput among those that carry every ``needed`` field."""
    usable = [r for r in rows if all(isinstance(r.get(f), int | float) for f in needed)]
    if not usable:
        raise KeyError(f"no row with {', '.join(needed)}")
    return max(usable, key=lambda r: float(r.get("gbps") or 0.0))


#: A reader takes a result document and returns (value, field it came from) per rate.
Reader = Callable[[Any], list[tuple[float, str]]]


def _ack_cpu(doc: Any) -> list[tuple[float, str]]:
    row = _best_row(_rows(doc, "storaged"), "server_cpu_s_per_gb", "client_cpu_s_per_gb")
    where = f"[{row.get('config')}]"
    return [
        (_number(row["server_cpu_s_per_gb"]), f"{where} server_cpu_s_per_gb"),
        (_number(row["client_cpu_s_per_gb"]), f"{where} client_cpu_s_per_gb"),
    ]


def _save_ack_cpu(doc: Any) -> list[tuple[float, str]]:
    row = _best_row(_rows(doc, "storaged", "runs"), "node_cpu_s_per_gb", "client_cpu_s_per_gb")
    where = f"runs[c={row.get('concurrency')}]"
    return [
        (_number(row["node_cpu_s_per_gb"]), f"{where} node_cpu_s_per_gb"),
        (_number(row["client_cpu_s_per_gb"]), f"{where} client_cpu_s_per_gb"),
    ]


def _restore_cpu(doc: Any) -> list[tuple[float, str]]:
    rows = _rows(doc, "storaged", "runs") or _rows(doc, "storaged")
    # The RAM tier's figure when the file has one per tier: the restore advised by default.
    in_ram = [r for r in rows if r.get("tier") in (None, "memory", "ram")]
    for server in ("node_cpu_s_per_gb", "server_cpu_s_per_gb"):
        usable = [r for r in in_ram if isinstance(r.get(server), int | float)]
        if usable:
            row = _best_row(usable, server, "client_cpu_s_per_gb")
            total = _number(row[server]) + _number(row["client_cpu_s_per_gb"])
            where = f"[c={row.get('concurrency')}, tier={row.get('tier', '-')}]"
            return [(total, f"{where} {server} + client_cpu_s_per_gb")]
    raise KeyError("no storaged row with node and client CPU per GB")


def _transfer_stand_in(doc: Any) -> list[tuple[float, str]]:
    row = _best_row(_rows(doc, "baseline"), "server_cpu_s_per_gb", "client_cpu_s_per_gb")
    total = _number(row["server_cpu_s_per_gb"]) + _number(row["client_cpu_s_per_gb"])
    return [(total, f"[{row.get('config')}] server + client, standing in for a restore")]


def _staging(doc: Any) -> list[tuple[float, str]]:
    """One rank's staging copy: its bytes over its stall, warm buffers preferred."""
    rows = [r for r in _rows(doc, "storaged", "runs") if isinstance(r.get("bytes"), int | float)]
    if not rows:
        raise KeyError("no storaged run with bytes")
    row = min(rows, key=lambda r: int(r.get("concurrency") or 1))
    per_rank = _number(row["bytes"]) / int(row.get("concurrency") or 1)
    for key in ("stall_warm_s", "stall_s"):
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value) and value > 0:
            where = f"runs[c={row.get('concurrency')}] bytes per rank / {key}"
            return [(per_rank / value / GB, where)]
    raise KeyError("no stall_warm_s or stall_s")


def _nvme(doc: Any) -> list[tuple[float, str]]:
    write = _number(doc["writes"]["tier x4"]["best_gbps"])
    read = _number(doc["reads"]["cold"]["raw"]["best_gbps"])
    return [(write, "writes[tier x4].best_gbps"), (read, "reads[cold][raw].best_gbps")]


def _fabric(doc: Any) -> list[tuple[float, str]]:
    """The ack's share of the writer's link and its bytes on the links per byte saved; the
    restore with the most readers' useful rate over the caps (``loadtest.fabric``)."""
    if doc.get("nodes", 0) < MEASURED_REPLICATION:
        raise ValueError(f"{doc.get('nodes')} nodes: too few for {MEASURED_REPLICATION} copies")
    ack = doc["ack"]
    saved_mb = _number(ack["bytes"]) / 1e6
    received = sum(_number(mb[1]) for link, mb in ack["links_mb"].items() if link[0] == "n")
    restores = [r for r in doc["restores"] if isinstance(r, dict)]
    widest = max(restores, key=lambda r: int(r["readers"]))
    caps = f"{doc['caps']['node']} links, client {doc['caps']['client']}"
    return [
        (_number(ack["ratio"]), f"ack.ratio ({caps})"),
        (_number(ack["node_copies_per_client_byte"]), "ack.node_copies_per_client_byte"),
        (received / saved_mb, "ack.links_mb: MB the nodes received / MB saved"),
        (_number(widest["ratio"]), f"restores[readers={widest['readers']}].ratio"),
    ]


def _save_disk_write(doc: Any) -> list[tuple[float, str]]:
    rows = [r for r in doc["baselines"]["disk_write"] if isinstance(r, dict)]
    row = _best_row(rows, "gbps")
    return [(_number(row["gbps"]), f"baselines.disk_write[c={row.get('concurrency')}].gbps")]


def _save_encode(k: int, n: int) -> Reader:
    def read(doc: Any) -> list[tuple[float, str]]:
        codec = doc["baselines"]["codec"]
        if (codec.get("k"), codec.get("n")) != (k, n):
            raise ValueError(f"measured at k={codec.get('k')} n={codec.get('n')}, not {k},{n}")
        return [(_number(codec["encode_wrapper_gbps"]), "baselines.codec.encode_wrapper_gbps")]

    return read


def result_files(results: Path | Mapping[str, Path] | None) -> dict[str, Path]:
    """Result kind (``RESULT_KINDS``) -> file: ``<kind>.json`` in a directory, or as given."""
    if results is None:
        return {}
    if isinstance(results, Path):
        return {kind: results / f"{kind}.json" for kind in RESULT_KINDS}
    unknown = sorted(set(results) - set(RESULT_KINDS))
    if unknown:
        raise ValueError(f"unknown result kinds {unknown}: known are {', '.join(RESULT_KINDS)}")
    return dict(results)


def load_rates(
    results: Path | Mapping[str, Path] | None = None, *, k: int = 4, n: int = 6
) -> Rates:
    """The rates from the load tests' result files, defaults where a file or field is missing.

    ``results``: a directory holding ``<kind>.json`` files, or a mapping of result kind
    (``RESULT_KINDS``) to file; None: no file, every rate its documented default. Never
    raises for a missing or malformed file: that rate keeps its default, and its source
    says why. Each group of rates is taken from the first file that has it.
    """
    files = result_files(results)
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    reasons: dict[str, list[str]] = {}

    def first_of(names: Sequence[str], *tries: tuple[str, Reader]) -> None:
        for kind, read in tries:
            path = files.get(kind)
            if path is None:
                reason = f"no {kind}.json given"
            else:
                try:
                    got = read(_read_json(path))
                except FileNotFoundError:
                    reason = f"{path.name} missing"
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                    reason = f"{path.name} unreadable ({type(exc).__name__}: {exc})"
                else:
                    before = "; ".join(reasons.get(names[0], []))
                    for name, (value, where) in zip(names, got, strict=True):
                        values[name] = value
                        sources[name] = f"measured: {path.name} {where}" + (
                            f" ({before})" if before else ""
                        )
                    return
            for name in names:
                reasons.setdefault(name, []).append(reason)

    cpu = ["ack_node_cpu_s_per_gb", "ack_client_cpu_s_per_gb"]
    first_of(cpu, ("ack", _ack_cpu), ("save", _save_ack_cpu))
    first_of(
        ["restore_cpu_s_per_gb"],
        ("restore", _restore_cpu),
        ("ack", _transfer_stand_in),
    )
    first_of(["memcpy_gbps"], ("save", _staging))
    first_of(["nvme_write_gbps", "nvme_read_gbps"], ("nvme", _nvme))
    if "nvme_write_gbps" not in values:
        first_of(["nvme_write_gbps"], ("save", _save_disk_write))
    first_of(["encode_gbps"], ("save", _save_encode(k, n)))
    links = ["ack_link_share", "ack_egress_copies", "ack_ingress_copies"]
    first_of([*links, "restore_link_efficiency"], ("fabric", _fabric))

    if (k, n) in ZFEC_RATES:
        encode, decode, _ = ZFEC_RATES[(k, n)]
        codec_note = f"zfec {k},{n}"
    else:
        # zfec's encode work grows with the parity blocks: 4,6 (2 parity) runs at 1.0 GB/s,
        # 8,12 and 10,14 (4 parity) at about half; decode from primaries is the BLAKE3 check.
        encode, decode, _ = ZFEC_RATES[(4, 6)]
        encode *= 2 / (n - k)
        codec_note = f"zfec {k},{n} scaled from 4,6 by 2/(n-k) parity blocks"
    values.setdefault("encode_gbps", encode)
    values.setdefault("decode_gbps", decode)
    reasons.setdefault("encode_gbps", []).append(codec_note)
    reasons.setdefault("decode_gbps", []).append(codec_note)

    defaults = Rates()
    for name in defaults.values():
        if name not in sources:
            why = "; ".join(reasons.get(name, ["no result file measures it"]))
            sources[name] = f"default ({why}): {DEFAULT_PROVENANCE[name]}"
    return replace(defaults, **values, sources=sources)


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Phase:
    """How long a phase takes on one node, and which resource bounds it."""

    seconds: float
    bound: str
    #: Resource -> seconds that phase needs of it alone.
    demands: dict[str, float]


def phase(demands: Mapping[str, float]) -> Phase:
    """The phase lasts as long as its largest demand; ties go to the first listed."""
    bound = max(demands, key=lambda r: demands[r])
    return Phase(demands[bound], bound, dict(demands))


def pipelined(*phases: Phase) -> Phase:
    """Phases running at once: each resource's demands add up, the busiest one bounds."""
    total: dict[str, float] = {}
    for p in phases:
        for resource, seconds in p.demands.items():
            total[resource] = total.get(resource, 0.0) + seconds
    return phase(total)


PHASES = (
    "stall",
    "ack",
    "drain",
    "encode",
    "durable_nvme",
    "durable_cold",
    "restore_ram",
    "restore_nvme",
    "restore_cold",
    "fs_save",
    "fs_restore",
)


def project(nodes: int, a: Assumptions, r: Rates) -> dict[str, Phase]:
    """Every phase of one checkpoint on ``nodes`` nodes (the slowest node's view)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    a.check()
    r.check()
    n = _PerNode.of(nodes, a, r)
    stall, ack, drain, encode = _save_phases(n, a, r)
    return {
        "stall": stall,
        "ack": ack,
        "drain": drain,
        "encode": encode,
        "durable_nvme": pipelined(ack, drain),
        "durable_cold": pipelined(ack, drain, encode),
        **_restore_phases(n, a, r),
        **_fs_phases(nodes, n, a),
    }


@dataclass(frozen=True)
class _PerNode:
    """What one node owns, holds and can move: GB of state and GB/s or cores."""

    unique: float  # GB of distinct state each node owns (placement)
    held: float  # GB of state each node holds, saves (if a writer), restores
    in_ram: float  # GB of RAM copies a node ends up holding
    remote_copies: int  # copies of a chunk on other nodes than its writer's
    nic: float
    cpu: float
    disk_write: float
    disk_read: float
    h2d: float  # host to GPUs

    @classmethod
    def of(cls, nodes: int, a: Assumptions, r: Rates) -> _PerNode:
        unique = a.model_bytes / nodes / GB
        held = unique * a.replicas
        remote_copies = a.replication - 1 if a.local_copy else a.replication
        # RAM copies a node ends up holding: its own chunks (local copy) and its share of
        # the remote copies that placement spreads over all nodes.
        in_ram = held + remote_copies * unique if a.local_copy else a.replication * unique
        return cls(
            unique=unique,
            held=held,
            in_ram=in_ram,
            remote_copies=remote_copies,
            nic=a.nic_gbps,
            cpu=float(a.cores),
            disk_write=r.nvme_write_gbps * a.nvme_drives,
            disk_read=r.nvme_read_gbps * a.nvme_drives,
            h2d=a.gpus * a.pcie_gbps,
        )


def _save_phases(n: _PerNode, a: Assumptions, r: Rates) -> tuple[Phase, Phase, Phase, Phase]:
    """The stall, the ack, the drain to nvme and the erasure coding into cold."""
    held, nic, cpu = n.held, n.nic, n.cpu
    stall = phase(
        {
            "memcpy": held / (a.gpus * r.memcpy_gbps),  # one staging thread per rank
            "PCIe": held / n.h2d,
        }
    )
    # Link bytes per copy sent and received (the fabric run's, per copy), and the share of
    # the link the ack reaches.
    sent = r.ack_egress_copies / (MEASURED_REPLICATION - 1)
    received = r.ack_ingress_copies / MEASURED_REPLICATION
    ack = phase(
        {
            # A writer sends every remote copy of its bytes and receives its share of the
            # others'; full duplex: the busier direction counts.
            "NIC": max(n.remote_copies * held * sent, n.remote_copies * n.unique * received)
            / (nic * r.ack_link_share),
            "CPU": (
                r.ack_node_cpu_s_per_gb / MEASURED_REPLICATION * n.in_ram
                + r.ack_client_cpu_s_per_gb * held
            )
            / cpu,
            # Past the memory tier's capacity the ack waits for the drain to free RAM.
            "RAM": max(0.0, n.in_ram - a.memory_bytes / GB) / n.disk_write,
        }
    )
    drain = phase({"disk": n.in_ram / n.disk_write})
    fragments = n.unique * a.n / a.k  # GB of fragments a node's owned chunks become
    encode = phase(
        {
            "CPU": n.unique / (r.encode_gbps * cpu),
            "NIC": fragments * (a.n - 1) / a.n / nic,  # one fragment may stay local
            "disk": fragments / n.disk_write,
        }
    )
    return stall, ack, drain, encode


def _restore_phases(n: _PerNode, a: Assumptions, r: Rates) -> dict[str, Phase]:
    """A restore from each tier."""
    held, cpu = n.held, n.cpu
    nic = n.nic * r.restore_link_efficiency  # useful bytes per second of the links
    cold_read = held * (a.n / a.k if a.hedged_cold_reads else 1.0)
    return {
        "restore_ram": phase(
            {
                "NIC": held / nic,
                "CPU": held * r.restore_cpu_s_per_gb / cpu,
                "PCIe": held / n.h2d,
            }
        ),
        "restore_nvme": phase(
            {
                "NIC": held / nic,
                "CPU": held * (r.restore_cpu_s_per_gb + 1 / r.hash_gbps) / cpu,
                "disk": held / n.disk_read,
                "PCIe": held / n.h2d,
            }
        ),
        "restore_cold": phase(
            {
                "NIC": cold_read / nic,  # fan-in: k (or n) sources per chunk
                "CPU": (held * r.restore_cpu_s_per_gb + held / r.decode_gbps) / cpu,
                "disk": cold_read / n.disk_read,
                "PCIe": held / n.h2d,
            }
        ),
    }


def _fs_phases(nodes: int, n: _PerNode, a: Assumptions) -> dict[str, Phase]:
    """The same save and restore through a shared filesystem, for comparison."""
    total = a.model_bytes / GB
    return {
        "fs_save": phase(
            {
                "FS": total / a.fs_gbps,  # one copy written, whatever the replicas
                "FS metadata": nodes / a.replicas * a.files_per_node / a.fs_metadata_ops,
                "NIC": n.held / n.nic,
            }
        ),
        "fs_restore": phase(
            {
                "FS": total * a.replicas / a.fs_gbps,  # every replica reads its copy
                "FS metadata": nodes * a.files_per_node / a.fs_metadata_ops,
                "NIC": n.held / n.nic,
            }
        ),
    }
