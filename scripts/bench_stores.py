"""Put/get throughput of the stores against the memory-copy ceiling of the same run.

usage: bench_stores.py [--stores local,mooncake] [--sizes 64KiB,1MiB,2MiB] [--total 128MiB]
                       [--repeat 7] [--out bench-results] [--local-dir DIR] [--quick]

The values the connector stores (docs/CONNECTOR.md#chunks): 1 MiB, a GPU chunk (16 pages
of 64 KiB: Qwen3-8B's 16-token blocks, the default 256-token chunk), and 2 MiB (a CPU
hybrid page); and 64 KiB, one GPU page per value (the layout before chunks: reported,
not a target). ``--total`` bytes of distinct random values each, in batches of 2 MiB of
values (what one dump batch of a layer writes). MiB/s of payload, median and best of
``--repeat`` rounds:

* ``memcpy``: slice-assigning every value into one preallocated bytearray (the ceiling
  of a copy), ``bytes()`` copies kept alive, and the XXH3 checksum every put and get
  computes.
* ``memory tier`` / ``disk tier``: the local store's tiers alone (the memory tier's
  values leaving it are dropped, not spilled, so its rows hold nothing of the disk's).
  ``put (new segments)`` fills an empty store right after it opened: on disk each
  segment is created then; the memory tier's warmer allocates and maps its segments in
  the background from the open on (docs/CONNECTOR.md), racing the puts here, while a
  server has them ready before its first dump. ``put`` (the target) writes into a full store: every
  segment is reused, the least recently used one emptied first, as in a store that has
  been serving for a while. Reads are hot (page cache), as right after a dump.
* ``disk tier (fsync)``: the same with ``local_fsync``.
* ``N processes``: N processes putting at once into one directory (aggregate MiB/s).
* ``LMDB (values in LMDB)`` and ``file per value (old design)``: the candidates the
  design was compared with (docs/CONNECTOR.md#store): py-lmdb holding the values (pages
  changed in place, no sync) and one file per value (open, writev, close; preadv back),
  nothing else around them.
* ``mooncake``: through a Mooncake master + storage node on loopback, values in ordinary
  memory (staged: copied into the store's registered buffer); ``values in registered
  memory``: the values lie in a buffer registered with the client, as the connector's
  staging buffers are (puts zero-copy, ``batch_put_from_multi_buffers``); ``mooncake
  client (ceiling)``: the client's own ``batch_put_from`` / ``batch_get_into`` on a
  registered buffer already holding the values. Mooncake clients listen on 0.0.0.0, so when
  ``MOONCAKE_MASTER`` is not set the whole benchmark re-runs itself under
  ``scripts/mooncake_netns.sh`` (private network namespace).

A table is printed and the numbers are written as JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ucm_patch.connector.layout import CHUNK_TOKENS
from ucm_patch.hooks.stores import framing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import memcpy_share  # scripts/ is not a package

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
# A GPU page: Qwen3-8B's 16-token block of one layer (8 KV heads of 128, bf16, K and V),
# and the value the connector makes of them (CHUNK_TOKENS of pages back to back).
GPU_PAGE = 16 * 8 * 128 * 2 * 2
GPU_CHUNK = CHUNK_TOKENS // 16 * GPU_PAGE
BATCH_BYTES = 2 * MiB
SEGMENT = 16 * MiB
SHM = Path("/dev/shm")


def _rate(nbytes: int, fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return nbytes / MiB / (time.perf_counter() - started)


def _batches(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), n)]


def bench_memcpy(values: list[bytes], repeat: int) -> dict[str, list[float]]:
    total = sum(len(v) for v in values)
    arena = bytearray(total)
    view = memoryview(arena)

    def copy_into() -> None:
        off = 0
        for v in values:
            view[off : off + len(v)] = v
            off += len(v)

    def copy_alloc() -> list[bytes]:
        return [bytes(memoryview(v)) for v in values]  # bytes(bytes) would not copy

    def xxh3() -> None:
        for v in values:
            framing.checksum(b"k", b"", v, framing.ALGO_XXH3)

    copy_into()  # the arena's pages are the kernel's to allocate once, not per round
    return {
        "memcpy into preallocated": [_rate(total, copy_into) for _ in range(repeat)],
        "memcpy alloc + copy (bytes)": [_rate(total, copy_alloc) for _ in range(repeat)],
        "xxh3 (the frame checksum)": [_rate(total, xxh3) for _ in range(repeat)],
    }


def _round(store: Any, items: list[tuple[str, bytes]], batch: int, arena: memoryview) -> dict:
    """One put_many pass, one get_many pass (bytes kept alive) and one get_many_into pass
    into ``arena``; every value read back is checked."""
    total = sum(len(v) for _, v in items)
    keys = [k for k, _ in items]
    got: list = []
    out: dict[str, float] = {}

    def memcpy() -> None:  # the ceiling, measured right before each timed pass (paired)
        off = 0
        for _, v in items:
            arena[off : off + len(v)] = v
            off += len(v)

    out["memcpy_put"] = _rate(total, memcpy)
    out["put"] = _rate(total, lambda: [store.put_many(c) for c in _batches(items, batch)])
    out["get"] = _rate(
        total, lambda: [got.extend(store.get_many(c)) for c in _batches(keys, batch)]
    )
    bufs, off = [], 0
    for _, v in items:
        bufs.append(arena[off : off + len(v)])
        off += len(v)

    def into() -> None:
        for i in range(0, len(keys), batch):
            if not all(store.get_many_into(keys[i : i + batch], bufs[i : i + batch])):
                raise SystemExit("bench: get_many_into missed a value it just stored")

    out["memcpy_get_into"] = _rate(total, memcpy)
    out["get_into"] = _rate(total, into)
    if got != [v for _, v in items] or [bytes(b) for b in bufs] != got:
        raise SystemExit(f"bench: {type(store).__name__} read other bytes than it stored")
    return out


def bench_tier(
    base: Path, tier: str, values: list[bytes], batch: int, repeat: int, fsync: bool = False
) -> dict[str, list[float]]:
    """A tier of the local store alone: round 0 fills it (new segments), rounds 1.. put
    new keys into the full store (segments reused, least recently used emptied first)."""
    from ucm_patch.hooks.stores.local import LocalStore

    total = sum(len(v) for v in values)
    # each round's keys fit, with two segments to spare: the next round evicts them
    capacity = total + total // 4 + 2 * SEGMENT
    shutil.rmtree(base, ignore_errors=True)
    if tier == "memory":
        store = LocalStore(base / "disk", capacity, memory_bytes=capacity,
                           memory_path=base / "memory", segment_bytes=SEGMENT)  # fmt: skip
        store.memory.spill = None  # type: ignore[union-attr]  (the tier alone: see --help)
    else:
        store = LocalStore(base / "disk", capacity, fsync=fsync, segment_bytes=SEGMENT)
    arena = memoryview(bytearray(total))
    arena[:] = bytes(total)  # its pages are allocated before anything is timed
    rounds = [_round(store, [(f"b/{r}/{i}", v) for i, v in enumerate(values)], batch, arena)
              for r in range(repeat + 1)]  # fmt: skip
    store.close()
    shutil.rmtree(base, ignore_errors=True)
    warm = rounds[1:]
    return {
        "put (new segments)": [rounds[0]["put"]],
        "put": [r["put"] for r in warm],
        "get": [r["get"] for r in warm],
        "get_into": [r["get_into"] for r in warm],
        "memcpy_put": [r["memcpy_put"] for r in warm],
        "memcpy_get_into": [r["memcpy_get_into"] for r in warm],
    }


def bench_processes(base: Path, tier: str, size: int, total: int, n: int) -> float:
    """``n`` processes put ``total`` bytes of ``size``-byte values at once into one tier
    directory (after a fill that makes every segment a reused one): aggregate MiB/s."""
    shutil.rmtree(base, ignore_errors=True)
    count = max(n, total // size) // n
    args = [str(base), tier, str(size), str(count)]
    worker = [sys.executable, __file__, "--put-worker", *args]
    fill = subprocess.run([*worker, "fill", str(n)], capture_output=True, text=True, check=False)
    if fill.returncode:
        raise SystemExit(f"bench: fill worker failed:\n{fill.stderr}")
    pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    procs = [subprocess.Popen([*worker, f"p{i}", str(n)], text=True, **pipes) for i in range(n)]
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise SystemExit("bench: a put worker did not start")
    started = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "done" or p.wait(timeout=600):
            raise SystemExit("bench: a put worker failed")
    wall = time.perf_counter() - started
    shutil.rmtree(base, ignore_errors=True)
    return n * count * size / MiB / wall


def _put_worker(path: str, tier: str, size: int, count: int, tag: str, share: int) -> None:
    """One of ``share`` writers (``bench_processes``): capacity for every writer's values
    plus a reused segment each; puts when told."""
    from ucm_patch.hooks.stores.local import LocalStore

    capacity = (share * count * size) * 5 // 4 + (share + 2) * SEGMENT
    if tier == "memory":
        store = LocalStore(Path(path) / "disk", capacity, memory_bytes=capacity,
                           memory_path=Path(path) / "memory", segment_bytes=SEGMENT)  # fmt: skip
        store.memory.spill = None  # type: ignore[union-attr]
    else:
        store = LocalStore(Path(path) / "disk", capacity, segment_bytes=SEGMENT)
    values = [os.urandom(size) for _ in range(count * (share if tag == "fill" else 1))]
    items = [(f"{tag}/{i}", v) for i, v in enumerate(values)]
    batch = max(1, BATCH_BYTES // size)
    if tag != "fill":
        # a serving process has mapped the segments long before: so has this one
        for chunk in _batches([(f"{tag}-warm/{i}", v) for i, v in enumerate(values)], batch):
            store.put_many(chunk)
        print("ready", flush=True)
        sys.stdin.readline()
    for chunk in _batches(items, batch):
        if not all(store.put_many(chunk)):
            raise SystemExit("bench: a put was refused")
    print("done", flush=True)


def bench_lmdb(base: Path, values: list[bytes], batch: int, repeat: int) -> dict:
    """The candidate of keeping the values themselves in LMDB (py-lmdb, pages changed in
    place, no sync), with the same integrity frame as the local store (its header in a
    second table, checked on every read): one transaction per batch, reads copied out of
    the map. Each round's keys are deleted before the next (not timed), so later rounds
    reuse freed pages; there is no LRU bookkeeping, which the store would also need."""
    import lmdb

    total = sum(len(v) for v in values)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    env = lmdb.open(str(base), map_size=4 * total + 64 * MiB, writemap=True, sync=False,
                    metasync=False, readahead=False, max_dbs=2)  # fmt: skip
    data, frames = env.open_db(b"data"), env.open_db(b"frames")
    arena = memoryview(bytearray(total))
    put, get_into = [], []
    for r in range(repeat + 1):
        keys = [f"b/{r}/{i}".encode() for i in range(len(values))]

        def do_put(keys: list[bytes] = keys) -> None:
            for i in range(0, len(keys), batch):
                with env.begin(write=True) as txn:
                    for k, v in zip(keys[i : i + batch], values[i : i + batch], strict=True):
                        txn.put(k, framing.make_header(k, memoryview(v)), db=frames)
                        txn.put(k, v, db=data)

        def do_get(keys: list[bytes] = keys) -> None:
            off = 0
            for i in range(0, len(keys), batch):
                with env.begin(buffers=True) as txn:
                    for k in keys[i : i + batch]:
                        v = txn.get(k, db=data)
                        out = arena[off : off + len(v)]
                        out[:] = v
                        framing.verify(k, txn.get(k, db=frames), out)
                        off += len(v)

        rates = (_rate(total, do_put), _rate(total, do_get))
        if r:  # round 0 allocates the file's pages
            put.append(rates[0])
            get_into.append(rates[1])
        with env.begin(write=True) as txn:
            for k in keys:
                txn.delete(k, db=data)
                txn.delete(k, db=frames)
    env.close()
    shutil.rmtree(base, ignore_errors=True)
    return {"put": put, "get_into": get_into}


def bench_files(base: Path, values: list[bytes], repeat: int) -> dict[str, list[float]]:
    """The old design's ceiling: a new file per value (open, writev, close), then
    ``preadv`` into one preallocated buffer; nothing else (no checksum, no index)."""
    total = sum(len(v) for v in values)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    header = bytes(framing.HEADER_SIZE)
    put, get_into = [], []
    for r in range(repeat):
        folder = base / f"files-{r}"
        folder.mkdir(parents=True)
        names = [str(folder / f"v{i}") for i in range(len(values))]

        def write(names: list[str] = names) -> None:
            for name, value in zip(names, values, strict=True):
                fd = os.open(name, flags, 0o600)
                try:
                    os.writev(fd, [header, value])
                finally:
                    os.close(fd)

        arena = memoryview(bytearray(total))

        def read(names: list[str] = names, arena: memoryview = arena) -> None:
            off = 0
            for name, value in zip(names, values, strict=True):
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.preadv(fd, [arena[off : off + len(value)]], len(header))
                finally:
                    os.close(fd)
                off += len(value)

        put.append(_rate(total, write))
        get_into.append(_rate(total, read))
        shutil.rmtree(folder, ignore_errors=True)
    return {"put": put, "get_into": get_into}


def bench_mooncake_client(store: Any, values: list[bytes], batch: int, repeat: int) -> dict:
    """Mooncake's own batch calls on one registered buffer that already holds the values:
    the transport's ceiling, without this store's framing or staging copy."""
    size = len(values[0])
    n = min(len(values), batch)
    with store._oversize(n * size) as buf:
        for i in range(n):
            buf.view[i * size : (i + 1) * size] = values[i]
        ptrs = [buf.addr + i * size for i in range(n)]
        sizes = [size] * n
        put, get_into = [], []
        rounds = max(1, len(values) // n)
        for r in range(repeat):
            keys = [[f"raw/{size}/{r}/{j}/{i}" for i in range(n)] for j in range(rounds)]

            def do_put(keys: list[list[str]] = keys) -> None:
                for chunk in keys:
                    if any(rc < 0 for rc in store._client.batch_put_from(chunk, ptrs, sizes)):
                        raise SystemExit("bench: mooncake batch_put_from failed")

            def do_get(keys: list[list[str]] = keys) -> None:
                for chunk in keys:
                    if any(rc < 0 for rc in store._client.batch_get_into(chunk, ptrs, sizes)):
                        raise SystemExit("bench: mooncake batch_get_into failed")

            put.append(_rate(rounds * n * size, do_put))
            get_into.append(_rate(rounds * n * size, do_get))
        if bytes(buf.view[:size]) != values[0]:
            raise SystemExit("bench: mooncake batch_get_into read other bytes")
    return {"put": put, "get_into": get_into}


def bench_store(
    make: Callable[[int], Any], values: list[bytes], batch: int, repeat: int, close: bool = True
) -> dict[str, list[float]]:
    """put_many then get_many of fresh keys per repeat; every value read back is checked."""
    out: dict[str, list[float]] = {"put": [], "get": [], "get_into": []}
    arena = memoryview(bytearray(sum(len(v) for v in values)))
    for r in range(repeat):
        store = make(r)
        # keys name the size: the store outlives a size, and a key stored before keeps its
        # first value (Mooncake answers "already exists")
        tag = f"bench/{len(values[0])}/{r}"
        rates = _round(store, [(f"{tag}/{i}", v) for i, v in enumerate(values)], batch, arena)
        for op, rate in rates.items():
            out.setdefault(op, []).append(rate)
        if close:
            store.close()
    return out


def bench_mooncake_registered(store: Any, values: list[bytes], batch: int, repeat: int) -> dict:
    """The store's put_many / get_many_into with the values inside memory registered with
    the client (what the connector's staging buffers are): puts are zero-copy."""
    import ctypes

    total = sum(len(v) for v in values)
    region = bytearray(total)
    view = memoryview(region)
    spans, off = [], 0
    for v in values:
        view[off : off + len(v)] = v
        spans.append(view[off : off + len(v)])
        off += len(v)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if not store.register_host_memory(addr, total):
        raise SystemExit("bench: mooncake refused to register the values' buffer")
    out: dict[str, list[float]] = {}
    arena = memoryview(bytearray(total))
    before = store.stats["zero_copy_puts"]
    try:
        for r in range(repeat):
            tag = f"bench-zc/{len(values[0])}/{r}"
            rates = _round(store, [(f"{tag}/{i}", s) for i, s in enumerate(spans)], batch, arena)
            for op, rate in rates.items():
                out.setdefault(op, []).append(rate)
    finally:
        store.unregister_host_memory(addr)
    if store.stats["zero_copy_puts"] - before != repeat * len(values):
        raise SystemExit("bench: a put from registered memory was not zero-copy")
    return out


def run_size(args: argparse.Namespace, size: int, base: Path, mooncake: Any) -> dict:
    """Every path for values of ``size`` bytes."""
    count = max(4, args.total // size)
    batch = max(1, BATCH_BYTES // size)
    values = [os.urandom(size) for _ in range(count)]
    results: dict[str, Any] = {"memcpy": bench_memcpy(values, args.repeat)}
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if "local" in stores:
        memory = Path(tempfile.mkdtemp(prefix="bench-kv-", dir=SHM if SHM.is_dir() else None))
        try:
            results["memory tier"] = bench_tier(memory, "memory", values, batch, args.repeat)
            results["disk tier"] = bench_tier(base / "disk", "disk", values, batch, args.repeat)
            results["disk tier (fsync)"] = bench_tier(
                base / "fsync", "disk", values, batch, args.repeat, fsync=True
            )
            for n in (2, 4):
                results[f"memory tier, {n} processes"] = {
                    "put": [bench_processes(memory / "procs", "memory", size, count * size, n)]
                }
                results[f"disk tier, {n} processes"] = {
                    "put": [bench_processes(base / "procs", "disk", size, count * size, n)]
                }
            results["LMDB (values in LMDB), /dev/shm"] = bench_lmdb(
                memory / "lmdb", values, batch, args.repeat
            )
            results["LMDB (values in LMDB), disk"] = bench_lmdb(
                base / "lmdb", values, batch, args.repeat
            )
            results["file per value (old design)"] = bench_files(
                base / "files", values, args.repeat
            )
        finally:
            shutil.rmtree(memory, ignore_errors=True)
    if mooncake is not None:
        results["mooncake (TCP loopback, node)"] = bench_store(
            lambda r: mooncake, values, batch, args.repeat, close=False
        )
        results["mooncake, values in registered memory (zero-copy put)"] = (
            bench_mooncake_registered(mooncake, values, batch, args.repeat)
        )
        results["mooncake client (ceiling)"] = bench_mooncake_client(
            mooncake, values, batch, args.repeat
        )
    return {
        "count": count,
        "size": size,
        "batch": batch,
        "what": _what(size),
        # the targets hold for what the connector stores: chunks and hybrid pages
        "judged": size >= GPU_CHUNK,
        "results": results,
    }


def _what(size: int) -> str:
    if size == GPU_PAGE:
        return "one GPU page per value (before chunks)"
    if size == GPU_CHUNK:
        return f"a GPU chunk: {GPU_CHUNK // GPU_PAGE} pages of {GPU_PAGE >> 10} KiB"
    if size == 2 * MiB:
        return "a CPU hybrid page"
    return "values"


def run(args: argparse.Namespace) -> dict:
    from ucm_patch.hooks.stores import parse_size

    sizes = [parse_size("--sizes", x.strip(), minimum=1) for x in args.sizes.split(",")]
    args.total = parse_size("--total", args.total, minimum=1)
    base = Path(args.local_dir) if args.local_dir else Path(tempfile.mkdtemp(prefix="bench-kv-"))
    mooncake = None
    if "mooncake" in args.stores:
        from ucm_patch.hooks.stores.mooncake import MooncakeStore

        master = os.environ["MOONCAKE_MASTER"]
        mooncake = MooncakeStore(master=master, global_segment_bytes=0, staging_bytes=64 * MiB)
    try:
        by_size = {_label(size): run_size(args, size, base, mooncake) for size in sizes}
    finally:
        if mooncake is not None:
            mooncake.close()
        if not args.local_dir:
            shutil.rmtree(base, ignore_errors=True)
    return {
        "params": {"total": args.total, "repeat": args.repeat, "segment": SEGMENT},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "processor": platform.processor(),
        },
        "unit": "MiB/s",
        "sizes": by_size,
    }


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size % MiB == 0 else f"{size // 1024} KiB"


def table(report: dict) -> str:
    def fmt(xs: list[float] | None) -> str:
        return f"{statistics.median(xs):8.0f} / {max(xs):6.0f}" if xs else " " * 17

    lines = []
    for label, d in report["sizes"].items():
        mem = statistics.median(d["results"]["memcpy"]["memcpy into preallocated"])
        lines += [
            f"{d['count']} values x {label}, batches of {d['batch']}; MiB/s median / best, "
            "and % of memcpy",
            f"{'path':36} {'put':>17} {'get':>17} {'get into buffers':>17}",
        ]
        for name, ops in d["results"].items():
            if name == "memcpy":
                for what, xs in ops.items():
                    lines.append(f"{what:36} {fmt(xs)}")
                continue
            for put in [k for k in ops if k.startswith("put")]:
                pct = " ".join(
                    f"{100 * share:3.0f}%"
                    for k in (put, "get_into")
                    if (share := memcpy_share(ops, k, mem)) is not None
                )
                tag = name if put == "put" else f"{name} {put[3:].strip()}"
                lines.append(
                    f"{tag:36} {fmt(ops.get(put))} {fmt(ops.get('get') if put == 'put' else None)}"
                    f" {fmt(ops.get('get_into') if put == 'put' else None)}  {pct}"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stores", default="local,mooncake", help="comma list: local, mooncake")
    ap.add_argument(
        "--sizes", default="64KiB,1MiB,2MiB", help="value sizes (default 64KiB,1MiB,2MiB)"
    )
    ap.add_argument("--total", default="128MiB", help="bytes of values per size and round")
    ap.add_argument("--repeat", type=int, default=7, help="rounds (median and best shown)")
    ap.add_argument("--out", default=str(REPO / "bench-results"), help="JSON output folder")
    ap.add_argument("--local-dir", default=None, help="directory for the disk-tier runs")
    ap.add_argument("--put-worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.put_worker:
        path, tier, size, count, tag, share = args.put_worker
        _put_worker(path, tier, int(size), int(count), tag, int(share))
        return 0
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    unknown = {s.strip() for s in args.stores.split(",")} - {"local", "mooncake", ""}
    if unknown:
        ap.error(f"--stores: unknown {sorted(unknown)}; accepted: local, mooncake")
    if "mooncake" in args.stores and "MOONCAKE_MASTER" not in os.environ:
        from ucm_patch.hooks.stores import parse_size

        stored = 2 * (args.repeat + 1) * parse_size("--total", args.total, minimum=1)
        node = f"{2 * stored // (1 << 30) + 1}GB"  # room above Mooncake's 90 % watermark
        cmd = [str(REPO / "scripts" / "mooncake_netns.sh"), "--node", node, "--"]
        env = {**os.environ, "MOONCAKE_BIN_DIR": str(Path(sys.executable).parent)}
        return subprocess.call([*cmd, sys.executable, *sys.argv], env=env)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"stores-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
