#!/usr/bin/env python3
"""Put/get throughput of the stores against the memory-copy ceiling of the same run.

usage: bench_stores.py [--stores local,mooncake] [--count 200] [--size 1MiB] [--batch 32]
                       [--repeat 3] [--out bench-results] [--local-dir DIR]

What is measured (MiB/s of payload, median and best of ``--repeat`` runs):

* ``memcpy``: slice-assigning every value into one preallocated bytearray (the ceiling
  for a copy), and ``bytes()`` copies kept alive (allocation + copy, which is what a get
  that returns ``bytes`` costs at least); ``crc32`` / ``xxh3``: the frame checksum before
  and now (every put computes it, every get verifies it).
* ``local``: put_many / get_many in batches of ``--batch`` on a fresh directory, without
  and with fsync; reads are hot (page cache), as right after a dump.
* ``file system (ceiling of local)``: what the kernel does for the local store's layout
  with nothing of ours around it: one new file per value (open, writev, close), then
  ``preadv`` back into buffers, in the same directory kind and run. A new file's pages
  are allocated in the page cache as they are written; that, not the store, is the limit
  of a put (``local`` is compared with it in docs/BENCHMARKS.md).
* ``mooncake``: the same through a Mooncake master + storage node on loopback. Mooncake
  clients listen on 0.0.0.0, so when ``MOONCAKE_MASTER`` is not set the whole benchmark
  re-runs itself under ``scripts/mooncake_netns.sh`` (private network namespace).
* ``mooncake client (ceiling)``: the client's own ``batch_put_from`` / ``batch_get_into``
  on one registered buffer already holding the values (no framing, no staging copy):
  Mooncake's TCP transfer alone, the ceiling of the ``mooncake`` row.

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
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ucm_patch.hooks.stores import framing

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
XXH3 = framing.ALGO_XXH3


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

    return {
        "memcpy into preallocated": [_rate(total, copy_into) for _ in range(repeat)],
        "memcpy alloc + copy (bytes)": [_rate(total, copy_alloc) for _ in range(repeat)],
        "crc32 (checksum, before)": [
            _rate(total, lambda: [zlib.crc32(v) for v in values]) for _ in range(repeat)
        ],
        "xxh3 (checksum written now)": [
            _rate(
                total, lambda: [framing.checksum(b"k", b"", v, framing.ALGO_XXH3) for v in values]
            )
            for _ in range(repeat)
        ],
    }


def _round(
    store: Any, items: list[tuple[str, bytes]], batch: int
) -> tuple[float, float, float, list]:
    """One put_many pass, one get_many pass and one get_many_into pass (into one
    preallocated buffer, as the connector's loads read) over ``items``: (put, get,
    get_into MiB/s, values read both ways)."""
    total = sum(len(v) for _, v in items)
    keys = [k for k, _ in items]
    got: list = []
    started = time.perf_counter()
    for chunk in _batches(items, batch):
        store.put_many(chunk)
    put = total / MiB / (time.perf_counter() - started)
    started = time.perf_counter()
    for chunk in _batches(keys, batch):
        got.extend(store.get_many(chunk))  # kept alive, as a caller would
    get = total / MiB / (time.perf_counter() - started)
    arena = memoryview(bytearray(total))
    bufs, off = [], 0
    for _, v in items:
        bufs.append(arena[off : off + len(v)])
        off += len(v)
    started = time.perf_counter()
    for i in range(0, len(keys), batch):
        if not all(store.get_many_into(keys[i : i + batch], bufs[i : i + batch])):
            raise SystemExit("bench: get_many_into missed a value it just stored")
    get_into = total / MiB / (time.perf_counter() - started)
    if [bytes(b) for b in bufs] != got:
        raise SystemExit("bench: get_many_into read other bytes than get_many")
    return put, get, get_into, got


def bench_files(base: Path, values: list[bytes], repeat: int) -> dict[str, list[float]]:
    """The local store's ceiling: a new file per value (open, writev, close), then
    ``preadv`` into one preallocated buffer; nothing else (no checksum, no ledger)."""
    total = sum(len(v) for v in values)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    header = bytes(framing.HEADER_SIZE)
    put, get_into = [], []
    for r in range(repeat):
        folder = base / f"files-{r}"
        folder.mkdir()
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
            keys = [[f"raw/{r}/{j}/{i}" for i in range(n)] for j in range(rounds)]

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
    put, get, get_into = [], [], []
    for r in range(repeat):
        store = make(r)
        put_rate, get_rate, into_rate, got = _round(
            store, [(f"bench/{r}/{i}", v) for i, v in enumerate(values)], batch
        )
        if got != values:
            raise SystemExit(f"bench: {type(store).__name__} returned wrong values (repeat {r})")
        put.append(put_rate)
        get.append(get_rate)
        get_into.append(into_rate)
        if close:
            store.close()
    return {"put": put, "get": get, "get_into": get_into}


def run(args: argparse.Namespace) -> dict:
    from ucm_patch.hooks.stores import parse_size
    from ucm_patch.hooks.stores.local import LocalStore

    size = parse_size("--size", args.size, minimum=1)
    values = [os.urandom(size) for _ in range(args.count)]
    results: dict[str, dict[str, list[float]]] = {"memcpy": bench_memcpy(values, args.repeat)}
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    capacity = 4 * args.count * (size + 64) * args.repeat
    if "local" in stores:
        base = (
            Path(args.local_dir) if args.local_dir else Path(tempfile.mkdtemp(prefix="bench-kv-"))
        )
        try:
            results["file system (ceiling of local)"] = bench_files(base, values, args.repeat)
            for fsync in (False, True):
                name = "local (fsync)" if fsync else "local"
                results[name] = bench_store(
                    lambda r, f=fsync: LocalStore(base / f"{int(f)}-{r}", capacity, fsync=f),
                    values,
                    args.batch,
                    args.repeat,
                )
        finally:
            if not args.local_dir:
                shutil.rmtree(base, ignore_errors=True)
    if "mooncake" in stores:
        from ucm_patch.hooks.stores.mooncake import MooncakeStore

        master = os.environ["MOONCAKE_MASTER"]
        store = MooncakeStore(master=master, global_segment_bytes=0, staging_bytes=64 * MiB)
        try:  # one client for all repeats: setup and close are not what is measured
            results["mooncake (TCP loopback, node)"] = bench_store(
                lambda r: store, values, args.batch, args.repeat, close=False
            )
            results["mooncake client (ceiling)"] = bench_mooncake_client(
                store, values, args.batch, args.repeat
            )
        finally:
            store.close()
    return {
        "params": {"count": args.count, "size": size, "batch": args.batch, "repeat": args.repeat},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "processor": platform.processor(),
        },
        "unit": "MiB/s",
        "results": results,
    }


def table(report: dict) -> str:
    def fmt(xs: list[float] | None) -> str:
        return f"{statistics.median(xs):8.0f} / {max(xs):6.0f}" if xs else " " * 17

    p = report["params"]
    lines = [
        f"{p['count']} values x {p['size']} bytes, batches of {p['batch']}, "
        f"{p['repeat']} repeats; MiB/s median / best",
        f"{'path':34} {'put / copy':>17}   {'get':>17}   {'get into buffers':>17}",
    ]
    for name, ops in report["results"].items():
        if name == "memcpy":
            for what, xs in ops.items():
                lines.append(f"{what:34} {fmt(xs)}")
        else:
            lines.append(
                f"{name:34} {fmt(ops.get('put'))}   {fmt(ops.get('get'))}"
                f"   {fmt(ops.get('get_into'))}"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stores", default="local,mooncake", help="comma list: local, mooncake")
    ap.add_argument("--count", type=int, default=200, help="values per repeat (default 200)")
    ap.add_argument("--size", default="1MiB", help="value size (default 1MiB)")
    ap.add_argument("--batch", type=int, default=32, help="keys per put_many/get_many call")
    ap.add_argument("--repeat", type=int, default=3, help="repeats (median and best shown)")
    ap.add_argument("--out", default=str(REPO / "bench-results"), help="JSON output folder")
    ap.add_argument("--local-dir", default=None, help="directory for the local store runs")
    args = ap.parse_args()
    for name in ("count", "batch", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    unknown = {s.strip() for s in args.stores.split(",")} - {"local", "mooncake", ""}
    if unknown:
        ap.error(f"--stores: unknown {sorted(unknown)}; accepted: local, mooncake")
    if "mooncake" in args.stores and "MOONCAKE_MASTER" not in os.environ:
        from ucm_patch.hooks.stores import parse_size

        stored = args.count * args.repeat * parse_size("--size", args.size, minimum=1)
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
