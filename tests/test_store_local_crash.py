"""A writer killed mid-write (SIGKILL) leaves a store that opens, serves every value it
had stored, and never serves a torn one.

Each round starts a writer process that puts batches forever and prints the number of
every batch whose ``put_many`` returned; the test kills it with SIGKILL at a random moment
(most of a writer's time is spent copying values into a segment or in the index's
transaction), then opens the store in this process and checks every key written so far.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.segment_index import SegmentIndex

BATCH = 8
SMALL, LARGE = 192 << 10, 384 << 10  # LARGE > framing.PIECE: a disk batch's headers go in last
CAPACITY = 512 << 20  # nothing is evicted: every value stored must still be there
ROUNDS = 8


def value_of(key: str, size: int) -> bytes:
    """The only value ever stored under ``key`` (cheap to make: the writer's time goes
    into the store, where the kill should land)."""
    return hashlib.blake2b(key.encode()).digest() * (size // 64)


def _store(path: str, memory: str) -> LocalStore:
    extra = {"memory_bytes": 128 << 20, "memory_path": memory} if memory else {}
    return LocalStore(path, capacity_bytes=CAPACITY, segment_bytes=8 << 20, **extra)


def _writer(path: str, memory: str, tag: str, size: int) -> None:
    s = _store(path, memory)
    n = 0
    while True:
        keys = [f"{tag}-{n}-{j}" for j in range(BATCH)]
        assert s.put_many([(k, value_of(k, size)) for k in keys]) == [True] * BATCH
        print(n, flush=True)
        n += 1


@pytest.mark.parametrize(
    ("tiers", "size"), [("disk", SMALL), ("memory+disk", SMALL), ("disk", LARGE)]
)
def test_sigkill_mid_write_loses_nothing_stored(tmp_path: Path, tiers: str, size: int) -> None:
    path = str(tmp_path / "kv")
    memory = str(tmp_path / "shm") if "memory" in tiers else ""
    rng = random.Random(20261125)
    done: list[str] = []  # keys whose put returned before the kill
    torn: list[str] = []  # keys of the batch in flight when the writer died
    for r in range(ROUNDS):
        tag = f"r{r}"
        proc = subprocess.Popen(
            [sys.executable, __file__, "--writer", path, memory, tag, str(size)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        target = rng.randint(2, 12)
        last = -1
        while last + 1 < target:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else "writer died"
            last = int(line)
        time.sleep(rng.uniform(0, 0.002))  # somewhere inside the next batch
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        for line in proc.stdout:  # batches that returned before the kill landed
            last = int(line)
        done += [f"{tag}-{n}-{j}" for n in range(last + 1) for j in range(BATCH)]
        torn += [f"{tag}-{last + 1}-{j}" for j in range(BATCH)]

        s = _store(path, memory)  # opens after the kill
        got = s.get_many(done)
        missing = [k for k, v in zip(done, got, strict=True) if v != value_of(k, size)]
        assert not missing, f"round {r}: {len(missing)} stored values lost, e.g. {missing[:3]}"
        for k, v in zip(torn, s.get_many(torn), strict=True):
            assert v is None or v == value_of(k, size), f"round {r}: torn value served for {k}"
        assert s.stats["corrupt"] == 0, s.stats
        s.close()

    # the dead writers' segments are taken over: a new writer fills the store past them
    s = _store(path, memory)
    extra = [f"after-{i}" for i in range(64)]
    for i in range(0, len(extra), BATCH):
        chunk = extra[i : i + BATCH]
        assert s.put_many([(k, value_of(k, size)) for k in chunk]) == [True] * len(chunk)
    assert s.get_many(extra) == [value_of(k, size) for k in extra]
    assert s.get_many(done) == [value_of(k, size) for k in done]
    s.close()
    s = _store(path, memory)  # reopened: what the closed one left in the index
    owners = {row.owner for tier in s.tiers for row in tier.index.segments().values()}
    assert os.getpid() not in owners  # close gave back every segment it kept leased
    s.close()


if __name__ == "__main__" and sys.argv[1:2] == ["--writer"]:
    _writer(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))


def test_a_reader_killed_mid_transaction_does_not_fill_the_index(tmp_path: Path) -> None:
    """A process killed inside an LMDB read transaction (a cleaner or a writer, SIGKILL)
    leaves its reader slot behind, and no page freed after its snapshot can be reused:
    the index's map fills with dead pages and every write fails (MDB_MAP_FULL), which
    the stores took for a full disk. The index clears dead readers' slots when its map
    is full and runs the transaction again: thousands of transactions later it still
    writes."""
    index = SegmentIndex(str(tmp_path), 0o700, 0o600, False, 0)
    reader = subprocess.Popen(
        [sys.executable, "-c", (
            "import lmdb, sys, time; e = lmdb.open(sys.argv[1], max_dbs=5, map_size="
            f"{index.map_bytes}); t = e.begin(); t.stat(); print('ready', flush=True); "
            "time.sleep(600)"
        ), index.path],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
    reader.send_signal(signal.SIGKILL)
    reader.wait(10)
    pid = os.getpid()
    # every claim and release rewrites pages: far more than the map holds without reuse
    transactions = 4 * index.map_bytes // 4096
    for i in range(transactions // 2):
        seg = i % 64
        gen = index.claim(seg, index.segments().get(seg), pid, empty=False)
        assert gen is not None
        index.release(seg, gen, pid)
    index.close()
