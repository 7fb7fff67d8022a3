"""docs/BENCHMARKS.md's section 5, store throughput (``bench_stores.py``), and the store
rows of its targets table: each tier against memcpy, the full two-tier store, Mooncake."""

from __future__ import annotations

import statistics
from typing import Any

import bench_common as bc

#: Store targets as shares of the memcpy ceiling of the same run (issue #27).
MEMORY_TARGET, DISK_TARGET = 0.60, 0.50


def _median(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


def _share(res: dict[str, Any], name: str, op: str) -> float | None:
    """A path's rate as a share of memcpy in the same run (paired per round where the
    bench measured it so: ``bench_common.memcpy_share``)."""
    mem = _median(res["memcpy"]["memcpy into preallocated"])
    return bc.memcpy_share(res.get(name, {}), op, mem)


#: The two-tier rows of bench_stores (spilling on, the store as the connector builds it).
FULL_STORE = "two tiers (as the connector builds them)"
#: A full store keeps this share of its put rate with room; no put call takes longer.
FULL_SHARE, FULL_SLOWEST_MS = 0.50, 10.0


def _stored_rate(row: dict[str, Any]) -> float:
    return row["stored"] / (1 << 20) / row["wall_s"]


def _on_cpu(row: dict[str, Any]) -> str:
    """The slowest call's own CPU time, where the bench measured it: "on a CPU x ms; "."""
    cpu = row.get("slowest_cpu_ms")
    return "" if cpu is None else f"on a CPU {cpu:.1f} ms of it; "


def full_store_targets(d: dict[str, Any] | None, label: str) -> list[tuple[str, str, str, str]]:
    """The full-store targets: a full two-tier store puts at >= 50 % of its rate with room
    and no put call takes over 10 ms; 2 and 4 writers at once store at least what one
    alone does."""
    if not d or "with room" not in d:
        return []
    room, one = _stored_rate(d["with room"]), d["full, 1 process"]
    share = _stored_rate(one) / room
    rows = [
        (f"full two-tier store, put rate vs with room, {label}", f">= {100 * FULL_SHARE:.0f} %",
         f"{100 * share:.0f} % ({_stored_rate(one):.0f} of {room:.0f} MiB/s)",
         bc.verdict(share >= FULL_SHARE)),
        (f"full two-tier store, slowest put call, {label}", f"<= {FULL_SLOWEST_MS:.0f} ms",
         f"{one['slowest_ms']:.1f} ms ({_on_cpu(one)}host jitter beside disk writes: "
         f"{d['host jitter']['beside_disk_writes_ms']:.1f} ms)",
         bc.verdict(one["slowest_ms"] <= FULL_SLOWEST_MS)),
    ]  # fmt: skip
    for n in (2, 4):
        row = d.get(f"full, {n} processes")
        if row is None:
            continue
        paired = d.get("together_vs_one", {}).get(str(n))
        if paired:  # the median of each round's own ratio (bench_stores.FULL_ROUNDS)
            ratio = statistics.median(paired)
            got = (f"{100 * ratio:.0f} % (median of {len(paired)} rounds: "
                   f"{', '.join(f'{100 * r:.0f}' for r in paired)} %)")  # fmt: skip
        else:
            ratio = _stored_rate(row) / _stored_rate(one)
            got = f"{100 * ratio:.0f} %"
        rows.append((f"full two-tier store, {n} processes at once vs one alone, {label}",
                     ">= 100 %", got, bc.verdict(ratio >= 1.0)))  # fmt: skip
    return rows


def full_store_table(d: dict[str, Any]) -> list[str]:
    """Section 5's table of the two-tier rows."""
    head = ("phase", "stored MiB/s", "offered MiB/s", "skipped", "written around",
            "median call", "p99.9", "slowest call", "rounds, MiB/s")  # fmt: skip
    rows = []
    for name, row in d.items():
        if not isinstance(row, dict) or "stored" not in row:
            continue
        skipped = 1 - row["stored"] / row["offered"] if row["offered"] else 0.0
        offered = row["offered"] / (1 << 20) / row["wall_s"]
        around = sum(e.get("around_bytes", 0) for e in row.get("each", [row]))
        around_share = f"{100 * around / row['stored']:.0f} %" if row["stored"] else "-"
        rounds = ", ".join(f"{r:.0f}" for r in row.get("rounds_mib_s", [])) or "-"
        rows.append((name, f"{_stored_rate(row):.0f}", f"{offered:.0f}",
                     f"{100 * skipped:.0f} %", around_share, f"{row['median_ms']:.2f} ms",
                     f"{row['p999_ms']:.1f} ms", f"{row['slowest_ms']:.1f} ms",
                     rounds))  # fmt: skip
    tiers = d["tiers"]
    jitter = d["host jitter"]
    return [
        f"**The store as the connector builds it** (spilling on): a {tiers['memory'] >> 20} MiB "
        f"memory tier of {tiers['segment'] >> 20} MiB segments over a {tiers['disk'] >> 30} GiB "
        "disk tier. `with room`: one process puts half the memory tier into a new store "
        f"(the median of {len(d['with room'].get('passes_mib_s', [0]))} such stores, "
        f"MiB/s {', '.join(f'{r:.0f}' for r in d['with room'].get('passes_mib_s', []))}). "
        f"`full`: {d['seconds']:g} s of puts by 1, 2 and 4 processes at once, once both tiers "
        "are full (each phase starts quiet: reserve refilled, dirty pages written back; "
        "before any Mooncake row, whose storage node keeps its values in memory), in "
        f"{d.get('rounds', 1)} rounds of the three phases: each row is the round of median "
        "rate (`rounds`: every round's MiB/s) with the slowest call of all rounds, and the "
        "targets' writers-vs-one figure is the median of each round's own ratio. "
        "`written around`: the share of the bytes stored that went around the dry memory "
        "tier into ready segments of the disk tier (one copy, not a put and a spill). "
        "A batch answered False (skipped: no segment ready in either tier) is followed "
        "by a pause as "
        f"long as a stored batch takes with room ({d['pace_ms']:.2f} ms), as a producer's "
        "next values come no sooner. Host jitter: the slowest pass of a loop of two 1 MiB "
        f"copies, {jitter['alone_ms']:.1f} ms alone and {jitter['beside_disk_writes_ms']:.1f} "
        "ms beside a process rewriting files as fast as it can (what the cleaner does).",
        "",
        bc.table(head, rows),
        "",
    ]


def store_targets(d: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    """Summary rows of the store targets (issue #27): each tier's put and get into buffers
    as a share of memcpy in the same run, per value size; fsync and several processes
    reported."""
    if not d or "sizes" not in d:
        return []
    rows: list[tuple[str, str, str, str]] = []
    for size_label, sd in d["sizes"].items():
        res = sd["results"]
        judged = sd.get("judged", True)  # False: a size the connector does not store
        label = f"{size_label} ({sd['what']})" if sd.get("what") else size_label

        def target(
            what: str,
            path: str,
            op: str,
            goal: float,
            res: dict = res,
            label: str = label,
            judged: bool = judged,
        ) -> None:
            got = _share(res, path, op)
            if got is None:
                return
            if not judged:
                rows.append((f"{what}, {label}", "report", f"{100 * got:.0f} %",
                             "(information: not a value the connector stores)"))  # fmt: skip
                return
            verdict = bc.verdict(got >= goal)
            if got < goal:
                verdict += ": where the time goes, section 5"
            rows.append((f"{what}, {label}", f">= {100 * goal:.0f} % of memcpy",
                         f"{100 * got:.0f} %", verdict))  # fmt: skip

        target("memory tier put", "memory tier", "put", MEMORY_TARGET)
        target("memory tier get into buffers", "memory tier", "get_into", MEMORY_TARGET)
        target("disk tier put (page cache)", "disk tier", "put", DISK_TARGET)
        target("disk tier get into buffers", "disk tier", "get_into", DISK_TARGET)
        for name, what in (
            ("disk tier (fsync)", "disk tier put with fsync"),
            ("memory tier, 2 processes", "memory tier put, 2 processes at once"),
            ("memory tier, 4 processes", "memory tier put, 4 processes at once"),
            ("disk tier, 2 processes", "disk tier put, 2 processes at once"),
            ("disk tier, 4 processes", "disk tier put, 4 processes at once"),
        ):
            got = _share(res, name, "put")
            if got is not None:
                rows.append((f"{what}, {label}", "report", f"{100 * got:.0f} %", "(information)"))
        rows.extend(full_store_targets(res.get(FULL_STORE), label))
        mcc = "mooncake client (ceiling)"
        for mc, how in (
            ("mooncake (TCP loopback, node)", ""),
            ("mooncake, values in registered memory (zero-copy put)", " (registered memory)"),
        ):
            for op, what in (("put", "put"), ("get_into", "get into buffers")):
                got, ceiling = _share(res, mc, op), _median(res.get(mcc, {}).get(op))
                raw = _median(res.get(mc, {}).get(op))
                if got is not None and raw is not None and ceiling:
                    rows.append((f"Mooncake {what}{how} vs its own batch calls, {label}",
                                 "report",
                                 f"{100 * raw / ceiling:.0f} % ({100 * got:.0f} % of memcpy)",
                                 "(information)"))  # fmt: skip
    return rows


def section_stores(data: dict[str, Any]) -> list[str]:
    d = data.get("stores")
    lines = ["## 5. Store throughput", ""]
    if not d or "sizes" not in d:
        return [*lines, "Not run.", ""]
    lines += [
        "Values of each size, in batches of 2 MiB of values, against the memory-copy ceiling "
        f"of the same run (`bench_stores.py --help`: what each row does); segments of "
        f"{d['params']['segment'] >> 20} MiB. MiB/s, median / best of "
        f"{d['params']['repeat']} rounds. Reads are hot (page cache), as right after a "
        "dump. `put (new segments)` is the first fill of an empty store: the kernel "
        "allocates and zeroes each segment's pages then, once for the life of the segment "
        "file; `put` writes into a full store, every segment reused (the steady state), "
        "and is what the targets use.",
        "",
    ]

    def cell(xs: list[float] | None) -> str:
        return f"{statistics.median(xs):.0f} / {max(xs):.0f}" if xs else ""

    for label, sd in d["sizes"].items():
        res = sd["results"]
        mem = statistics.median(res["memcpy"]["memcpy into preallocated"])
        rows = [(what, cell(xs), "", "", "") for what, xs in res["memcpy"].items()]
        for name, ops in res.items():
            if name == "memcpy":
                continue
            for put in [k for k in ops if k.startswith("put")]:
                first = put == "put"
                shares = " / ".join(
                    f"{100 * share:.0f} %"
                    if (share := bc.memcpy_share(ops, k, mem)) is not None
                    else "-"
                    for k in ((put, "get_into") if first else (put,))
                )
                rows.append((
                    name if first else f"{name}, {put[4:].strip('()')}",
                    cell(ops.get(put)),
                    cell(ops.get("get")) if first else "",
                    cell(ops.get("get_into")) if first else "",
                    shares,
                ))  # fmt: skip
        head = ("path", "put", "get (bytes)", "get into buffers", "put / get into vs memcpy")
        lines += [
            f"### {label} values"
            + (f": {sd['what']}" if sd.get("what") else "")
            + f" ({sd['count']} per round, {sd['batch']} per batch)",
            "",
            bc.table(head, rows),
            "",
        ]
        lines += _store_profile(label, sd)
        if FULL_STORE in res:
            lines += full_store_table(res[FULL_STORE])
    lines += [
        "Where a put's time goes (per value, from the rows above): the copy (`memcpy`), "
        "the frame checksum over data not yet in the cache (`xxh3`: the store computes it "
        "on its own copy, while the bytes are in the cache, so it costs less there: the "
        "memory tier copies and frames a batch in one native call, piece by piece; for "
        "a large value into the disk tier the copy runs on the calling thread's sidecar "
        "thread while the checksum runs on the caller, both without the GIL, so the two "
        "overlap and the rest is counted past the longer of them: "
        "hooks/stores/sidecar.py), and "
        "the rest: the index transaction (LMDB), the segment lease, emptying the least "
        "recently used segment (its stale index entries, deleted in the transaction that "
        "empties it) and the "
        "interpreter's work per value. The rest is fixed per value, so it weighs on 64 "
        "KiB values 32 times as much as on 2 MiB ones: that is why the connector does not "
        "store a GPU page per value but chunks of pages (docs/CONNECTOR.md#chunks-a-value-"
        "is-many-pages): the 1 MiB rows are 16 GPU pages of 64 KiB in one value, the "
        "64 KiB rows the page-per-value layout they replaced (reported, not a target). "
        "The `LMDB (values in LMDB)` rows "
        "are the candidate of docs/CONNECTOR.md#store with the same frame but no LRU "
        "bookkeeping and no eviction.",
        "",
        "![stores](img/stores.png)",
        "",
    ]
    return lines


def _store_profile(label: str, sd: dict[str, Any]) -> list[str]:
    """Microseconds per value of the memcpy, the checksum and each tier's put / get."""
    import statistics

    res, size = sd["results"], sd["size"]

    def us(xs: list[float] | None) -> float | None:
        return size / (statistics.median(xs) * (1 << 20)) * 1e6 if xs else None

    copy = us(res["memcpy"]["memcpy into preallocated"])
    xxh = us(res["memcpy"]["xxh3 (the frame checksum)"])
    rows = []
    for name in ("memory tier", "disk tier"):
        # the memory tier frames on its copy in one native call; the disk tier (a store
        # with no memory tier) hashes its batches on the process's checksum helper thread
        # while the put's thread writes them (rowcopy.c: ucm_framewrite)
        beside = name == "disk tier"
        for op in ("put", "get_into"):
            t = us(res.get(name, {}).get(op))
            if t is None or copy is None or xxh is None:
                continue
            if op != "put":
                # read_verified_many: each piece hashed as it is read, then streamed out
                hashed, rest = "(as it is read)", t - copy
            elif beside:
                hashed, rest = f"{xxh:.1f}, beside the copy", t - max(copy, xxh)
            else:
                hashed, rest = f"{xxh:.1f}", t - copy - xxh
            rows.append((f"{name} {op.replace('_', ' ')}", f"{t:.1f}", f"{copy:.1f}",
                         hashed, f"{rest:.1f}"))  # fmt: skip
    if not rows:
        return []
    head = ("per value, " + label, "µs", "of it: memcpy", "xxh3 (uncached)", "the rest")
    return [bc.table(head, rows), ""]
