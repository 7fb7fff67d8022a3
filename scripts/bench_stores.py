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
  ``scripts/mooncake_netns.sh`` (private network namespace). Mooncake's rows run after the
  local store's of every size: its storage node keeps the values in memory for the rest of
  the run, which lowers the kernel's dirty-page line the full-store rows meet.

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

from ucm_patch.connector.config import CHUNK_TOKENS
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


# -- the store as the connector builds it: two tiers, spilling on, full, 1/2/4 writers ---------

#: The two tiers of the full-store rows: a 512 MiB memory tier over a 4 GiB disk tier, the
#: connector's segment size (so a spill is a segment of the memory tier in one write).
TWO_TIERS = {"memory": 512 * MiB, "disk": 4 << 30, "segment": 64 * MiB}


def _two_tier_store(base: Path, size: int) -> Any:
    """The store in ``base`` (its disk tier) with its memory tier on /dev/shm, as the
    connector makes it (the tier's directory named after ``base``, like the default)."""
    from ucm_patch.hooks.stores.local import LocalStore

    memory = SHM / f"bench-two-tiers-{os.getuid()}-{base.name}"
    return LocalStore(
        base / "disk", TWO_TIERS["disk"], memory_bytes=TWO_TIERS["memory"],
        memory_path=memory, segment_bytes=TWO_TIERS["segment"], value_bytes=size,
    )  # fmt: skip


def _quiet(store: Any) -> None:
    """A timed phase starts on a quiet store: the warmer done, the reserve refilled, and the
    disk tier's dirty pages written back (the last phase's spills do not run into it)."""
    store.memory.wait_warm()
    store.memory.cleaner.wait_idle(120)
    os.sync()


def _timed_puts(
    store: Any, tag: str, values: list[bytes], seconds: float, pace_s: float
) -> dict[str, float]:
    """Put fresh keys in batches of 2 MiB of values for ``seconds``, as fast as the store
    answers: bytes stored and offered, and each call's wall time. A batch answered False
    (skipped: the reserve ran dry) is followed by a pause of ``pace_s``, the time a stored
    batch takes with room: a producer's next values come no sooner for its last ones
    being dropped (a dump thread moves on to the next layer's), and a loop spinning on
    skipped puts would only take the CPU the cleaner spills with."""
    batch = max(1, BATCH_BYTES // len(values[0]))
    before = store.stats["bytes_written"]
    calls: list[tuple[float, float]] = []  # (wall, this thread's CPU time) per call
    n = 0
    clock, cpu = time.perf_counter, time.thread_time
    started = clock()
    while clock() - started < seconds:
        items = [(f"{tag}/{n + j}", values[(n + j) % len(values)]) for j in range(batch)]
        t, c = clock(), cpu()
        ok = store.put_many(items)
        calls.append((clock() - t, cpu() - c))
        n += batch
        if not all(ok):
            time.sleep(pace_s)
    wall = clock() - started
    calls.sort()
    return {
        "wall_s": wall,
        "stored": store.stats["bytes_written"] - before,
        "offered": n * len(values[0]),
        "slowest_ms": calls[-1][0] * 1e3,
        # the slowest call's time on a CPU: far below its wall time, the thread waited
        # (for a core, on a 2-core host beside the cleaner's disk writes), not the store
        "slowest_cpu_ms": calls[-1][1] * 1e3,
        "p999_ms": calls[int(len(calls) * 0.999)][0] * 1e3,
        "median_ms": statistics.median(w for w, _ in calls) * 1e3,
    }


def _full_worker(path: str, size: int, seconds: float, pace_s: float, tag: str) -> None:
    """One writer of ``bench_full_store``: opens the store as the connector does, waits
    until told, puts for ``seconds``, prints its figures as JSON."""
    store = _two_tier_store(Path(path), size)
    values = [os.urandom(size) for _ in range(64)]
    _quiet(store)
    print("ready", flush=True)
    sys.stdin.readline()
    around = store.stats["written_around"]
    out = _timed_puts(store, tag, values, seconds, pace_s)
    out["dry"] = store.stats["reserve_dry"]
    out["around_bytes"] = (store.stats["written_around"] - around) * size
    print(json.dumps(out), flush=True)
    store.close()


def _fill(store: Any, values: list[bytes], nbytes: int) -> None:
    """Put until ``nbytes`` were spilled to disk (both tiers full, every disk segment
    written once), backing off whenever the reserve is dry."""
    per = max(1, BATCH_BYTES // len(values[0]))
    n = 0
    while store.stats["spilled"] * len(values[0]) < nbytes:
        items = [(f"fill/{n + j}", values[(n + j) % len(values)]) for j in range(per)]
        if not all(store.put_many(items)):
            time.sleep(0.005)
        n += per


def bench_full_store(base: Path, size: int, seconds: float) -> dict[str, Any]:
    """The store as users get it: two tiers, spilling on. ``with room``: one process puts
    half the memory tier into a new store. ``full``: 1, 2 and 4 processes put at once
    into the store once both tiers are full (every later put needs a segment the cleaner
    emptied); MiB/s stored (values answered True) over the wall time, the share skipped
    (the reserve ran dry: answered False at once), and the slowest call. ``with room`` is
    the median of :data:`ROOM_PASSES` passes, each into a new store."""
    shutil.rmtree(base, ignore_errors=True)
    store = _two_tier_store(base, size)
    values = [os.urandom(size) for _ in range(64)]
    try:
        _quiet(store)
        _timed_puts_bytes(store, "warm", values, 8 * MiB)  # the code paths, once
        room = _with_room(base, size, values)
        _fill(store, values, TWO_TIERS["disk"] + TWO_TIERS["memory"])
        pace = room["wall_s"] / max(1, room["stored"] // BATCH_BYTES)
        out: dict[str, Any] = {
            "with room": room,
            "tiers": dict(TWO_TIERS),
            "seconds": seconds,
            "pace_ms": pace * 1e3,
        }
        rounds: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 4: []}
        for _round in range(FULL_ROUNDS):
            for n in rounds:
                _quiet(store)
                rounds[n].append(_processes(base, size, seconds, pace, n))
        for n, rows in rounds.items():
            out[f"full, {n} process" + ("es" if n > 1 else "")] = _median_round(rows)
        # each round's writers against the one writer of the same round: the host's disk
        # and memory bandwidth drift between rounds more than between the phases of one
        out["together_vs_one"] = {
            str(n): [_stored(r) / _stored(one) for r, one in zip(rows, rounds[1], strict=True)]
            for n, rows in rounds.items() if n > 1
        }  # fmt: skip
        out["rounds"] = FULL_ROUNDS
        out["host jitter"] = _host_jitter(base, seconds)
    finally:
        memory = store.memory.path
        store.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return out


#: Rounds of the full-store phases (1, 2 and 4 writers, one after the other in each): a
#: phase is one 3 s sample, and one writer's rate alone moved by a fifth between runs on
#: a 2-core host, so a row is the median round and the writers-vs-one ratio the median of
#: the rounds' own ratios.
FULL_ROUNDS = 3


def _stored(row: dict[str, Any]) -> float:
    return row["stored"] / row["wall_s"]


def _median_round(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median stored rate, with every round's MiB/s, and the slowest call of
    all of them (the target: no put call over 10 ms, in any round)."""
    ranked = sorted(rows, key=_stored)
    median = ranked[len(ranked) // 2]
    slowest = max(rows, key=lambda r: r["slowest_ms"])
    return {**median, "rounds_mib_s": [_stored(r) / MiB for r in rows],
            "slowest_ms": slowest["slowest_ms"],
            "slowest_cpu_ms": slowest.get("slowest_cpu_ms")}  # fmt: skip


#: Passes of the rate with room; the row is the median one (a pass is 24 ms here: one
#: alone moved from 5.7 to 12.2 GB/s between runs).
ROOM_PASSES = 5


def _with_room(base: Path, size: int, values: list[bytes]) -> dict[str, Any]:
    """The rate with room: half the memory tier put into a new, warmed store, in
    :data:`ROOM_PASSES` stores one after the other; the median pass by rate, with every
    pass's MiB/s."""
    passes = []
    for i in range(ROOM_PASSES):
        store = _two_tier_store(base.parent / f"{base.name}-room{i}", size)
        try:
            _quiet(store)
            _timed_puts_bytes(store, "warm", values, 8 * MiB)
            passes.append(_timed_puts_bytes(store, "room", values, TWO_TIERS["memory"] // 2))
        finally:
            memory = store.memory.path
            store.close()
            shutil.rmtree(base.parent / f"{base.name}-room{i}", ignore_errors=True)
            shutil.rmtree(memory, ignore_errors=True)
    rates = sorted(p["stored"] / p["wall_s"] for p in passes)
    median = next(p for p in passes if p["stored"] / p["wall_s"] == rates[len(rates) // 2])
    return {**median, "passes_mib_s": [r / MiB for r in rates]}


def _timed_puts_bytes(store: Any, tag: str, values: list[bytes], nbytes: int) -> dict[str, float]:
    """``_timed_puts`` for a volume, not a duration (the store with room: it must not fill)."""
    batch = max(1, BATCH_BYTES // len(values[0]))
    before = store.stats["bytes_written"]
    calls: list[float] = []
    clock = time.perf_counter
    started = clock()
    for n in range(0, nbytes // len(values[0]), batch):
        items = [(f"{tag}/{n + j}", values[(n + j) % len(values)]) for j in range(batch)]
        t = clock()
        store.put_many(items)
        calls.append(clock() - t)
    wall = clock() - started
    calls.sort()
    stored = store.stats["bytes_written"] - before
    return {
        "wall_s": wall, "stored": stored, "offered": stored, "slowest_ms": calls[-1] * 1e3,
        "p999_ms": calls[int(len(calls) * 0.999)] * 1e3,
        "median_ms": statistics.median(calls) * 1e3,
    }  # fmt: skip


def _processes(base: Path, size: int, seconds: float, pace_s: float, n: int) -> dict[str, Any]:
    worker = [sys.executable, __file__, "--full-worker", str(base), str(size), str(seconds)]
    worker.append(str(pace_s))
    pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    procs = [subprocess.Popen([*worker, f"w{n}-{i}"], text=True, **pipes) for i in range(n)]
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise SystemExit("bench: a full-store writer did not start")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    each = []
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if p.wait(timeout=600) or not line:
            raise SystemExit("bench: a full-store writer failed")
        each.append(json.loads(line))
    wall = max(e["wall_s"] for e in each)
    stored, offered = sum(e["stored"] for e in each), sum(e["offered"] for e in each)
    slowest = max(each, key=lambda e: e["slowest_ms"])
    return {
        "wall_s": wall, "stored": stored, "offered": offered,
        "slowest_ms": slowest["slowest_ms"], "slowest_cpu_ms": slowest["slowest_cpu_ms"],
        "p999_ms": max(e["p999_ms"] for e in each),
        "median_ms": max(e["median_ms"] for e in each), "each": each,
    }  # fmt: skip


def _host_jitter(base: Path, seconds: float) -> dict[str, float]:
    """The host's own floor for a slowest call: a loop of two 1 MiB copies (no system
    call, no lock, nothing of the store) timed per pass, alone, then beside a process
    rewriting a 1 GiB file in the page cache as fast as it can (what the cleaner does
    while a full store takes puts)."""
    src, dst = os.urandom(MiB), memoryview(bytearray(MiB))

    def loop() -> float:
        slowest, clock = 0.0, time.perf_counter
        started = clock()
        while clock() - started < seconds:
            t = clock()
            dst[:] = src
            dst[:] = src
            slowest = max(slowest, clock() - t)
        return slowest * 1e3

    alone = loop()
    writer = subprocess.Popen(
        [sys.executable, __file__, "--disk-writer", str(base / "jitter"), str(seconds + 5)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert writer.stdout is not None
    writer.stdout.readline()
    beside = loop()
    writer.kill()
    writer.wait()
    return {"alone_ms": alone, "beside_disk_writes_ms": beside}


def _disk_writer(path: str, seconds: float) -> None:
    import mmap

    os.makedirs(path, exist_ok=True)
    chunk = mmap.mmap(-1, 64 * MiB)
    chunk.write(os.urandom(64 * MiB))
    fds = [os.open(os.path.join(path, f"f{i}"), os.O_RDWR | os.O_CREAT, 0o600) for i in range(16)]
    for fd in fds:
        os.pwritev(fd, [chunk], 0)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for fd in fds:
            os.pwritev(fd, [chunk], 0)


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
    client = store.client
    with store.registered_buffer(n * size) as buf:
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
                    if any(rc < 0 for rc in client.batch_put_from(chunk, ptrs, sizes)):
                        raise SystemExit("bench: mooncake batch_put_from failed")

            def do_get(keys: list[list[str]] = keys) -> None:
                for chunk in keys:
                    if any(rc < 0 for rc in client.batch_get_into(chunk, ptrs, sizes)):
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


def run_size(
    args: argparse.Namespace, size: int, base: Path, mooncake: Any, local: bool = True
) -> dict:
    """Every path for values of ``size`` bytes: the memory copies and the local store's
    (``local``), then Mooncake's (``mooncake``, when given)."""
    count = max(4, args.total // size)
    batch = max(1, BATCH_BYTES // size)
    values = [os.urandom(size) for _ in range(count)]
    results: dict[str, Any] = {}
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if local:
        results["memcpy"] = bench_memcpy(values, args.repeat)
    if local and "local" in stores:
        memory = Path(tempfile.mkdtemp(prefix="bench-kv-", dir=SHM if SHM.is_dir() else None))
        try:
            results["memory tier"] = bench_tier(memory, "memory", values, batch, args.repeat)
            results["disk tier"] = bench_tier(base / "disk", "disk", values, batch, args.repeat)
            results["disk tier (fsync)"] = bench_tier(
                base / "fsync", "disk", values, batch, args.repeat, fsync=True
            )
            if size >= GPU_CHUNK:  # the values the connector stores
                results["two tiers (as the connector builds them)"] = bench_full_store(
                    base / "two-tiers", size, args.full_seconds
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
        # The local store's rows of every size before any of Mooncake's: a Mooncake storage
        # node keeps what it was given in its memory for the rest of the run (2.9 GB after
        # the 64 KiB rows), and the kernel's dirty-page line, which bounds the full-store
        # rows, falls with the host's free memory.
        by_size = {_label(size): run_size(args, size, base, None) for size in sizes}
        if mooncake is not None:
            for size in sizes:
                late = run_size(args, size, base, mooncake, local=False)
                by_size[_label(size)]["results"].update(late["results"])
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
        full = d["results"].get("two tiers (as the connector builds them)")
        for name, row in (full or {}).items():
            if isinstance(row, dict) and "stored" in row:
                rate = row["stored"] / MiB / row["wall_s"]
                lines.append(f"two tiers, {name:30} {rate:8.0f} MiB/s stored, slowest put "
                             f"{row['slowest_ms']:.1f} ms")  # fmt: skip
        for name, ops in d["results"].items():
            if name == "two tiers (as the connector builds them)":
                continue  # its lines are above
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
    ap.add_argument(
        "--full-seconds", type=float, default=3.0, help="seconds of puts per full-store phase"
    )
    ap.add_argument("--put-worker", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--full-worker", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--disk-writer", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.full_worker:
        path, size, seconds, pace, tag = args.full_worker
        _full_worker(path, int(size), float(seconds), float(pace), tag)
        return 0
    if args.disk_writer:
        _disk_writer(args.disk_writer[0], float(args.disk_writer[1]))
        return 0
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
