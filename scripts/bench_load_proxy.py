"""The CPU proxy of a GPU hit's load (``make bench``; docs/BENCHMARKS.md, "load proxy").

A GPU is rarely at hand here, and on a CPU the forward hides every load cost. What made a
hit slow on the H100 was the host side of the load: the load threads take the GIL back
after every foreign call (a copy, a checksum), and beside vLLM's forward, a Python thread
that keeps it, each take waits up to the switch interval (5 ms). This benchmark measures
that, with nothing of vLLM:

* a writer process stores ``--values`` values of ``--value-bytes`` (900 of 1 MiB: the
  0.94 GB the H100 run loaded; 36 rows of 25 chunks, as Qwen3-8B's 36 layers at an 80 %
  hit of 8K tokens) into a store built as the connector builds it (two tiers), and keeps
  its memory tier;
* a fresh reader process opens it and loads every row as the connector loads a step
  into a KV cache in host memory (``row_loads.StepLoad``): the rows dealt to the
  connector's default load threads (``--threads``), each thread's rows in one
  ``get_many_scattered`` call straight into their pages of a cache made before the first
  load (as vLLM's is at start), a mark per row: the first load (a new process: every
  segment mapped for the first time), then ``--repeat`` steady ones;
* the same loads beside a thread running Python in a loop (vLLM's forward), at the
  default switch interval;
* the floor: a memcpy of the same bytes and an XXH3 of them, side by side on two threads
  (the work a load must do), in the same process, timed after each steady load.

The same for dumps: a fresh process submits rows (a row's values, from buffers in memory)
to the dump scheduler on the forward's thread, as the connector's ``save_kv_layer`` does,
with the connector's default dump threads, into a store with room, and waits for them as
for a finished request; fresh keys each pass, ``--values`` of them (900 of 1 MiB, as a
load's: one memory tier holds every pass, 11 GB, made and mapped before the first). A
dump pass ends when its last value is stored (the last ``put_many`` returned), not when
the thread waiting for it gets the GIL back. In both roles every page of the memory tier
is read once after it is mapped, before the first pass (:func:`_read_every_page`: this
host loses the mapping of memory populated and left alone, which a GPU host does not).

Reported: GB/s alone and beside the Python thread, host CPU-seconds per GB loaded (the
load threads' own, from ``getrusage`` per thread), wall alone against the floor, GIL
waits per value (the load threads' voluntary context switches beside the Python thread:
each is a wait for the GIL, or for the store's lock), and the first load against the
steady ones. Readers and dumpers each run in ``--processes`` fresh processes, one after
the other: a first load is one sample per process, so its figure is their median, and
the other figures pool every process's samples.

    python scripts/bench_load_proxy.py [--values 900] [--value-bytes 1MiB] [--threads N]
        [--repeat 5] [--processes 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc

MiB = 1 << 20
ROW_VALUES = 25  # chunks per layer at an 80 % hit of 8K tokens (6400 / 256)


def _store(path: Path, nbytes: int, value_bytes: int, room: float = 2.0) -> Any:
    """The store as the connector builds it: a memory tier of ``room`` times the values'
    ``nbytes``, over a disk tier; the tier kept when the writer closes (a restarted server
    reads it warm)."""
    from ucm_patch.hooks.stores.local import LocalStore

    memory = max(int(room * nbytes), 256 * MiB)
    return LocalStore(
        path / "disk", 4 * memory, memory_bytes=memory, value_bytes=value_bytes,
        memory_keep_bytes=memory,
    )  # fmt: skip


def _keys(n: int) -> list[str]:
    return [f"proxy/{i}" for i in range(n)]


def write(path: Path, values: int, value_bytes: int) -> None:
    """The writer process: every value stored, the memory tier kept at close."""
    store = _store(path, values * value_bytes, value_bytes)
    data = [os.urandom(value_bytes) for _ in range(8)]
    keys = _keys(values)
    for i in range(0, values, 2):
        batch = [(k, data[j % 8]) for j, k in enumerate(keys[i : i + 2], start=i)]
        while not all(store.put_many(batch)):
            store.memory.cleaner.wait_idle(60)
    store.close()


class _Spinner:
    """A thread running Python in a loop (vLLM's forward holds the GIL so), which also
    runs what the forward runs at a step's start (:meth:`call`: ``start_load_kv``)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        stop, calls = self._stop, self._calls
        while not stop.is_set():
            n += 1
            if n % 1000 == 0 and not calls.empty():
                fn, done = calls.get()
                done.set_result(fn())

    def call(self, fn: Callable[[], Any]) -> Any:
        done: Future[Any] = Future()
        self._calls.put((fn, done))
        return done.result()

    def __enter__(self) -> _Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _Hog:
    """A process running Python in a loop: it takes a core as the forward's thread does,
    but none of this process's GIL. Beside it, a dump runs as fast as the host's cores
    let it with one of them taken: the ceiling of the "beside a Python thread" figure on
    this host (on 2 cores, the dump threads and the forward share them)."""

    def __enter__(self) -> _Hog:
        self._proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)  # running
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.kill()
        self._proc.wait()


def _read_every_page(tier: Any) -> float:
    """Read one byte of every page of ``tier``'s segments, the last segment first (the
    first puts take the first segments): the seconds it took.

    Why, on this host and not in the store: it is a virtual machine (KVM, nested, with
    free page reporting to its host) that loses the mapping of memory populated and then
    left alone, beyond a few GB. After a tier of 11 GB was populated, the first writes
    into its first segments ran at 1-8 GB/s, without a page fault the guest sees, and
    every later write at 23-27; a probe without the store (a 2.7 GB tmpfs file mapped
    with ``MAP_POPULATE``, then written) did the same, a tier of 2-4 GB never. The first
    dump pass of each process took 3x its steady ones. Any access before, a read of one
    byte per page included, took that away; ``MADV_POPULATE_WRITE`` did not. A GPU host
    does not do this (a VM with a GPU passed through has its memory pinned by its host),
    so both roles start from a tier whose pages this host has mapped, and the seconds it
    took are kept (near 0.04 s for 11 GB when nothing was lost)."""
    import mmap

    started = time.perf_counter()
    for seg in reversed(range(tier.count)):
        try:
            view = tier.files.mapping(seg, 0)
        except OSError:
            continue  # never allocated (the warmer leaves the last quarter of a tmpfs)
        bytes(view[:: mmap.PAGESIZE])
    return time.perf_counter() - started


def _used_since(before: Any) -> tuple[float, int]:
    """The calling thread's CPU seconds and voluntary context switches since ``before``
    (its ``getrusage(RUSAGE_THREAD)``)."""
    after = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return cpu, after.ru_nvcsw - before.ru_nvcsw


#: The pages of a value in the stand-in KV cache: a layer's 16-token block of Qwen3-8B's
#: shape (8 KV heads of 128 dims, bf16, K and V) is 64 KiB, a 1 MiB value 16 of them.
PAGE_BYTES = 64 << 10


class _Cache:
    """A KV cache in host memory for every value (made and touched before any load, as
    vLLM's is when it starts), and each value's target in it: its pages one span each
    (a block-major page: one run)."""

    def __init__(self, values: int, value_bytes: int) -> None:
        from ucm_patch.hooks.stores.memcopy import address
        from ucm_patch.hooks.stores.scatter import PagePlan, Scatter

        self.memory = memoryview(bytearray(values * value_bytes))
        self.memory[:] = bytes(len(self.memory))
        base = address(self.memory) or 0
        page = min(PAGE_BYTES, value_bytes)
        plan = PagePlan(page, ((0, 0, page),))
        per = value_bytes // page
        self.targets = [
            Scatter(plan, tuple(base + (i * per + j) * page for j in range(per)))
            for i in range(values)
        ]


def _load_all(store: Any, pool: Any, rows: list[list[str]], cache: _Cache,
              threads: int, forward: _Spinner | None = None) -> dict[str, float]:  # fmt: skip
    """A step's rows as the connector loads them into a cache in host memory
    (``row_loads.StepLoad``): the values looked up on the forward's thread
    (``start_load_kv``: ``forward`` when one runs), dealt to the load threads in forward
    order, each thread's rows in one ``get_many_scattered`` call with a mark per row.
    Wall seconds, and the load threads' CPU seconds and voluntary context switches."""
    import ctypes

    usage: list[tuple[float, int]] = []
    lock = threading.Lock()
    flags = (ctypes.c_uint8 * len(rows))()
    index = {k: i for i, k in enumerate(_keys(sum(len(r) for r in rows)))}

    dealt = [list(range(k, len(rows), threads)) for k in range(threads)]
    every = [k for mine in dealt for r in mine for k in rows[r]]

    def load_rows(work: tuple[list[int], Any]) -> bool:
        mine, located = work
        before = resource.getrusage(resource.RUSAGE_THREAD)
        keys = [k for r in mine for k in rows[r]]
        marks, end = [], 0
        for r in mine:
            end += len(rows[r])
            marks.append((end, r))
        to = [cache.targets[index[k]] for k in keys]
        ok = all(store.get_many_scattered(keys, to, marks, flags, located))
        with lock:
            usage.append(_used_since(before))
        return ok

    t0 = time.perf_counter()
    lookup = partial(store.lookup_for_load, every)
    located = forward.call(lookup) if forward is not None else lookup()
    work, at = [], 0
    for mine in dealt:
        n = sum(len(rows[r]) for r in mine)
        work.append((mine, located[at : at + n]))
        at += n
    ok = all([f.result() for f in [pool.submit(load_rows, w) for w in work]])
    wall = time.perf_counter() - t0
    if not ok or not all(flags):
        raise SystemExit("bench_load_proxy: a value was missing or corrupt")
    return {"wall_s": wall, "cpu_s": sum(u[0] for u in usage), "waits": sum(u[1] for u in usage)}


class _Floor:
    """A memcpy and an XXH3 of ``nbytes``, side by side on two threads (the work a load
    or a dump must do), timed after each steady pass (:meth:`sample`: the faster of two
    runs, the first with buffers a pass left idle): the floor is the median of those, as
    the pass's figure is of the passes, so that both meet the same moments of the host
    (a floor timed apart, at its best of three, ran 1.1x to 1.4x off the passes from run
    to run on the same code).

    Made before the store opens, never between its start and the first pass: filling
    its source (``nbytes`` from ``os.urandom``, 900 MiB) right before the first load
    made that pass 1.06-1.30x its process's steady ones (median 1.11x, 5 processes), and
    made first, 0.98-1.06x (median 1.03x). A connector has no such work between its
    start and its first hit."""

    def __init__(self, nbytes: int) -> None:
        from ucm_patch.hooks.stores.memcopy import copy_bytes

        self._copy = copy_bytes
        self._src = memoryview(os.urandom(nbytes))
        self._dst = memoryview(bytearray(nbytes))
        copy_bytes(self._dst, self._src)  # pages touched once
        self.samples: list[float] = []

    def sample(self) -> None:
        import xxhash

        best = float("inf")
        for _ in range(2):
            hasher = threading.Thread(target=xxhash.xxh3_64_intdigest, args=(self._src,))
            t0 = time.perf_counter()
            hasher.start()
            self._copy(self._dst, self._src)
            hasher.join()
            best = min(best, time.perf_counter() - t0)
        self.samples.append(best)

    def seconds(self) -> float:
        return statistics.median(self.samples)


def read(
    path: Path, values: int, value_bytes: int, threads: int, repeat: int, per_value: bool
) -> dict[str, Any]:
    """The reader process: first load, steady loads alone, loads beside a Python thread;
    ``per_value``: without the row helper (:mod:`ucm_patch.hooks.stores.rowcopy`), as the
    store reads where it cannot be built."""
    from ucm_patch.hooks.stores import rowcopy

    if per_value:
        rowcopy.disable()
    nbytes = values * value_bytes
    floor = _Floor(nbytes)  # first: see _Floor
    store = _store(path, nbytes, value_bytes)
    pages_read_s = 0.0
    if store.memory is not None:
        store.memory.wait_warm()
        pages_read_s = _read_every_page(store.memory)  # see there: this host, not the store
    keys = _keys(values)
    rows = [keys[i : i + ROW_VALUES] for i in range(0, values, ROW_VALUES)]
    out: dict[str, Any] = {"values": values, "value_bytes": value_bytes, "threads": threads,
                           "switch_interval_s": sys.getswitchinterval(),
                           "row_helper": rowcopy.available(),
                           "pages_read_s": pages_read_s}  # fmt: skip
    # the connector's own load threads (``LoadThreads``), started with it, long before any
    # load: a ``ThreadPoolExecutor`` starts its threads at the first submit, and its
    # second thread began the first pass 7-10 ms after the first (1-4 ms in a steady one)
    from ucm_patch.connector.load_threads import LoadThreads

    pool = LoadThreads(threads, name="ucm-load")
    try:
        cache = _Cache(values, value_bytes)  # meanwhile (900 MiB written): the threads are up
        out["first"] = _load_all(store, pool, rows, cache, threads)
        out["alone"] = []
        for _ in range(repeat):
            out["alone"].append(_load_all(store, pool, rows, cache, threads))
            floor.sample()
        with _Spinner() as forward:
            out["beside_python"] = [
                _load_all(store, pool, rows, cache, threads, forward) for _ in range(2)
            ]
    finally:
        pool.shutdown(10.0)
    out["floor_s"], out["floor_samples"] = floor.seconds(), floor.samples
    store.close()
    return out


def _task_usage(tids: list[int]) -> tuple[float, int]:
    """CPU seconds and voluntary context switches of this process's threads ``tids`` so
    far (``/proc/self/task``: the dump scheduler's threads are not ours to wrap)."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu, waits = 0.0, 0
    for tid in tids:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu += (int(fields[11]) + int(fields[12])) / tick
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    waits += int(line.split()[1])
    return cpu, waits


class _Stamped:
    """The store as the dump threads see it, each ``put_many`` stamped when it returns:
    a pass ends when its last value is stored, not when a thread that waits for it gets
    the GIL back (beside the forward, up to the switch interval later; in vLLM the
    forward's own thread asks ``get_finished`` at its next step, and waits for no GIL)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()  # the dump threads stamp it, each its own puts
        self.last = 0.0

    def put_many(self, items: Any) -> list[bool]:
        out = self._store.put_many(items)
        with self._lock:
            self.last = max(self.last, time.perf_counter())
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _dump_all(sched: Any, client: Any, store: Any, rows: list[list[str]],
              data: list[memoryview], tag: str,
              forward: _Spinner | None = None) -> dict[str, float]:  # fmt: skip
    """A step's rows dumped as the connector dumps them: submitted to the dump scheduler
    one row at a time on the forward's thread (``save_kv_layer``: ``forward`` when one
    runs), host data (no event to wait for), then waited for as a finished request is
    (``get_finished``, blocking). Fresh keys: wall seconds from the first submit on the
    forward's thread to the last value stored (:class:`_Stamped`), the dump threads' CPU
    seconds and voluntary context switches."""
    tids = [t.native_id for t in threading.enumerate() if t.name.startswith("ucm-proxy-dump")]
    before = _task_usage([t for t in tids if t is not None])
    stamped = _Stamped(store)
    started: list[float] = []

    def submit() -> None:
        started.append(time.perf_counter())
        # as the connector's bind does (WorkerSide._open_dumps): the step's dumps told to
        # the store as it starts, which asks for their leases without waiting
        count = sum(len(keys) for keys in rows)
        store.expect_puts(count, count * len(data[0]), sched.config["workers"])
        batch = client.open_batch([tag], stamped)
        for r, keys in enumerate(rows):
            values = [data[i % len(data)] for i in range(len(keys))]
            if not sched.submit(batch, r, [f"{tag}/{k}" for k in keys], values):
                raise SystemExit("bench_load_proxy: a dump was skipped (no task slot)")
        sched.seal(batch)

    if forward is not None:
        forward.call(submit)
    else:
        submit()
    done = client.get_finished([tag], timeout=120)
    wall = stamped.last - started[0]
    if done.sending != {tag} or done.failed:
        raise SystemExit("bench_load_proxy: a dump failed or was skipped (the store is full)")
    cpu, waits = _task_usage([t for t in tids if t is not None])
    return {"wall_s": wall, "cpu_s": cpu - before[0], "waits": waits - before[1]}


def dump(path: Path, values: int, value_bytes: int, threads: int, repeat: int) -> dict[str, Any]:
    """The dump process: a fresh process dumps ``values`` values in rows through the dump
    scheduler, as the connector does, into a store with room for every pass (the first
    dump, ``repeat`` steady ones, two beside a Python thread, two beside a process that
    takes a core: :class:`_Hog`), fresh keys each pass (a
    store in use takes new values into segments it already has). Its tier's pages are
    read once before the first dump (:func:`_read_every_page`: this host, not the store)."""
    from ucm_patch.hooks.device import CpuDevice
    from ucm_patch.hooks.dump.scheduler import DumpScheduler

    passes = 1 + repeat + 2 + 2
    floor = _Floor(values * value_bytes)  # first: see _Floor
    # the connector's dump threads start with it, long before its first dump: started
    # right before the first pass, they were still starting while it ran
    sched = DumpScheduler(CpuDevice(), workers=threads, blocking_finish=True,
                          name="ucm-proxy-dump")  # fmt: skip
    store = None
    try:
        # room for every pass and the segments a pass leaves part-filled, and no more:
        # the whole tier is allocated and mapped before the first dump (9 GB for 900 values)
        store = _store(path, passes * values * value_bytes, value_bytes, room=1.25)
        out = _dumps(sched, store, floor, values, value_bytes, threads, repeat)
    finally:
        sched.shutdown()
        if store is not None:
            store.close()
    out["floor_s"], out["floor_samples"] = floor.seconds(), floor.samples
    return out


def _dumps(sched: Any, store: Any, floor: _Floor, values: int, value_bytes: int, threads: int,
           repeat: int) -> dict[str, Any]:  # fmt: skip
    """:func:`dump`'s passes, on ``sched`` into ``store``, just opened."""
    started = time.perf_counter()
    store.prepare_writes()  # as the connector's worker does at start
    if store.memory is not None:
        store.memory.wait_warm()  # the connector's store opens at start, before any dump
    # In vLLM, loading the model separates the connector's start from its first dump by
    # seconds: by then the store's cleaner process serves. Here the first pass would
    # otherwise share the 2 cores with that process's start (its interpreter and imports).
    if not store.wait_writes_ready(30):
        raise SystemExit("bench_load_proxy: the store's cleaner process never served")
    start_s = time.perf_counter() - started
    pages_read_s = _read_every_page(store.memory) if store.memory is not None else 0.0
    keys = _keys(values)
    rows = [keys[i : i + ROW_VALUES] for i in range(0, values, ROW_VALUES)]
    data = [memoryview(bytearray(os.urandom(value_bytes))) for _ in range(8)]  # staging
    out: dict[str, Any] = {"values": values, "value_bytes": value_bytes, "threads": threads,
                           "switch_interval_s": sys.getswitchinterval(),
                           "start_s": start_s, "pages_read_s": pages_read_s}  # fmt: skip
    client = sched.client("proxy")
    out["first"] = _dump_all(sched, client, store, rows, data, "first")
    out["alone"] = []
    for i in range(repeat):
        out["alone"].append(_dump_all(sched, client, store, rows, data, f"alone{i}"))
        floor.sample()
    with _Spinner() as forward:
        out["beside_python"] = [
            _dump_all(sched, client, store, rows, data, f"beside{i}", forward) for i in range(2)
        ]
    with _Hog():
        out["beside_hog"] = [
            _dump_all(sched, client, store, rows, data, f"hog{i}") for i in range(2)
        ]
    return out


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one role in fresh processes as one: ``first`` the run whose first pass
    took the median wall time (``firsts``: every one), the other passes pooled, the floor
    the median of theirs. ``first_ratios``: each process's first pass against the median
    of its own steady passes (what ``first_vs_steady`` reads, see :func:`summarize`)."""
    out = dict(runs[0])
    firsts = sorted((r["first"] for r in runs), key=lambda f: f["wall_s"])
    out["firsts"], out["first"] = firsts, firsts[len(firsts) // 2]
    out["first_ratios"] = [
        r["first"]["wall_s"] / statistics.median(p["wall_s"] for p in r["alone"]) for r in runs
    ]
    for key in ("alone", "beside_python", "beside_hog"):
        if key in out:
            out[key] = [p for r in runs for p in r[key]]
    out["pages_read_s"] = [r.get("pages_read_s", 0.0) for r in runs]
    out["floor_samples"] = [t for r in runs for t in r["floor_samples"]]
    out["floor_s"] = statistics.median(out["floor_samples"])
    out["processes"] = len(runs)
    return out


def summarize(d: dict[str, Any]) -> dict[str, float]:
    """The figures the targets read (docs/BENCHMARKS.md)."""
    nbytes = d["values"] * d["value_bytes"]
    alone = statistics.median(r["wall_s"] for r in d["alone"])
    beside = statistics.median(r["wall_s"] for r in d["beside_python"])
    cpu = statistics.median(r["cpu_s"] for r in d["alone"])
    waits = statistics.median(r["waits"] for r in d["beside_python"])
    return {
        "alone_gbps": nbytes / alone / 1e9,
        "beside_python_gbps": nbytes / beside / 1e9,
        "beside_share": alone / beside,
        "cpu_s_per_gb": cpu / (nbytes / 1e9),
        "wall_vs_floor": alone / d["floor_s"],
        # Each process's first pass against its own steady passes, the median over the
        # processes: a first pass is a property of its process, and the steady passes of
        # one process moved by up to 1.7x between processes on this 2-core host (44-73 ms
        # for the same 900 MiB), so against the pooled median a first pass measured which
        # process it ran in as much as being first.
        "first_vs_steady": statistics.median(d["first_ratios"])
        if d.get("first_ratios")
        else d["first"]["wall_s"] / alone,
        "gil_waits_per_value": waits / d["values"],
        **_ceiling(d, alone, beside),
    }


def _ceiling(d: dict[str, Any], alone: float, beside: float) -> dict[str, float]:
    """Beside a process that takes a core and no GIL of ours (dumps only): that share,
    the ceiling the host's cores set, and the Python thread's share of it."""
    if "beside_hog" not in d:
        return {}
    hog = statistics.median(r["wall_s"] for r in d["beside_hog"])
    return {"beside_hog_share": alone / hog, "beside_python_vs_hog": hog / beside}


def _role(cmd: list[str]) -> dict[str, Any]:
    """One role run in a fresh process: the JSON it printed last."""
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _dump_process(dumper: list[str], path: Path) -> dict[str, Any]:
    """One dump process's run, its memory tier removed after it: each keeps its tier at
    close (``memory_keep_bytes``, as a server does), and five of them left behind held
    16 GB of this host's 23 GB in /dev/shm while the later ones and the rest of
    ``make bench`` ran."""
    from ucm_patch.hooks.stores.local import default_memory_path

    try:
        return _role([*dumper, f"--path={path}"])
    finally:
        shutil.rmtree(default_memory_path(path / "disk"), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=900)
    ap.add_argument("--value-bytes", default="1MiB")
    ap.add_argument("--threads", type=int, default=0, help="load threads (0: the connector's)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--processes", type=int, default=5, help="fresh processes per role")
    ap.add_argument("--json", default=str(bc.RESULTS / "load_proxy.json"))
    ap.add_argument("--role", choices=["write", "read", "dump"], help=argparse.SUPPRESS)
    ap.add_argument("--per-value", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    value_bytes = int(args.value_bytes.removesuffix("MiB")) * MiB
    if args.role == "write":
        write(Path(args.path), args.values, value_bytes)
        return 0
    from ucm_patch.connector.config import copy_threads

    threads = args.threads or copy_threads()  # the connector's default load_workers
    dump_threads = args.threads or copy_threads()  # and dump_workers
    if args.role == "read":
        got = read(Path(args.path), args.values, value_bytes, threads, args.repeat, args.per_value)
        print(json.dumps(got))
        return 0
    if args.role == "dump":
        print(json.dumps(dump(Path(args.path), args.values, value_bytes, threads, args.repeat)))
        return 0
    base = Path(tempfile.mkdtemp(prefix="ucm-load-proxy-"))
    common = [f"--values={args.values}", f"--value-bytes={args.value_bytes}"]
    me = [sys.executable, __file__, *common, f"--path={base}"]
    processes = max(1, args.processes)
    dump_dirs = [base / f"dumps{i}" for i in range(processes)]
    try:
        subprocess.run([*me, "--role=write"], check=True)
        reader = [*me, "--role=read", f"--threads={threads}", f"--repeat={args.repeat}"]
        runs = {
            "per_value": _role([*reader, "--per-value"]),  # information: one process
            "row": merged([_role(reader) for _ in range(processes)]),
        }
        # as many values per pass as a load's (a shorter pass, 300 values in 15 ms, was
        # as long as two of the host's scheduler ticks and its figures moved by a third
        # between processes); a store of its own per process, so that each first dump
        # finds one as at start
        dumper = [sys.executable, __file__, f"--values={args.values}",
                  f"--value-bytes={args.value_bytes}", "--role=dump",
                  f"--threads={dump_threads}", f"--repeat={args.repeat}"]  # fmt: skip
        runs["dumps"] = merged([_dump_process(dumper, d) for d in dump_dirs])
    finally:
        from ucm_patch.hooks.stores.local import default_memory_path

        for d in (base, *dump_dirs):
            shutil.rmtree(default_memory_path(d / "disk"), ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    # the targets read the store as it reads (the row helper where it builds); the
    # value-by-value reads (no compiler) as information, from the same run
    data = {**runs["row"], "summary": summarize(runs["row"])}
    data["per_value"] = {**runs["per_value"], "summary": summarize(runs["per_value"])}
    data["dumps"] = {**runs["dumps"], "summary": summarize(runs["dumps"])}
    data["machine"] = bc.machine()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1))
    print(f"{'':24s} {'row helper':>12s} {'per value':>12s} {'dumps':>12s}")
    for k, v in data["summary"].items():
        per_value, dumps = data["per_value"]["summary"][k], data["dumps"]["summary"][k]
        print(f"{k:24s} {v:12.3f} {per_value:12.3f} {dumps:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
