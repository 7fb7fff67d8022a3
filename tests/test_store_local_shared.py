"""Local store shared by several processes: the index is the truth, one capacity.

Each process here is a separate Python interpreter (``subprocess``) running a small driver
(this file as a script), so no state is shared except the directory itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ucm_patch.hooks.stores.framing import HEADER_SIZE
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.segment_cleaner import LEASE_IDLE_S
from ucm_patch.hooks.stores.tier import Tier

VALUE_MIN, VALUE_MAX = 2 << 10, 6 << 10
CAPACITY = 40 * (HEADER_SIZE + (4 << 10))  # about 40 values: constant eviction pressure
KEYS = [f"blk-{i}" for i in range(240)]


def value_of(key: str) -> bytes:
    """The only value ever stored under ``key``: its length and bytes follow from the key."""
    seed = hashlib.blake2b(key.encode(), digest_size=8).digest()
    size = VALUE_MIN + int.from_bytes(seed, "little") % (VALUE_MAX - VALUE_MIN)
    return hashlib.shake_256(key.encode()).digest(size)


def _stress(path: str, seconds: float, seed: int) -> dict[str, object]:
    """Random puts, gets and existence checks on shared keys for ``seconds``."""
    rng = random.Random(seed)
    s = LocalStore(path, capacity_bytes=CAPACITY)
    wrong = 0
    ops = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        keys = rng.sample(KEYS, 4)
        roll = rng.random()
        if roll < 0.5:
            assert s.put_many([(k, value_of(k)) for k in keys]) == [True] * 4
        elif roll < 0.9:
            for key, got in zip(keys, s.get_many(keys), strict=True):
                wrong += got is not None and got != value_of(key)
        else:
            s.exists_many(keys)
        ops += 1
    return {"ops": ops, "wrong": wrong, "stats": s.stats}


def _readable(path: str) -> list[str]:
    """Keys this process can read, each checked against its expected value."""
    s = LocalStore(path, capacity_bytes=CAPACITY)
    got = s.get_many(KEYS)
    assert all(v is None or v == value_of(k) for k, v in zip(KEYS, got, strict=True))
    present = s.exists_many(KEYS)
    readable = [k for k, v in zip(KEYS, got, strict=True) if v is not None]
    assert [k for k, p in zip(KEYS, present, strict=True) if p] == readable
    return readable


def _driver(argv: list[str]) -> None:
    """``stress PATH SECONDS SEED``, ``readable PATH`` or ``serve PATH CAPACITY``; prints JSON."""
    cmd, path = argv[0], argv[1]
    if cmd == "stress":
        print(json.dumps(_stress(path, float(argv[2]), int(argv[3]))))
    elif cmd == "readable":
        print(json.dumps(_readable(path)))
    elif cmd == "serve":  # one store kept alive between commands read from stdin
        s = LocalStore(path, capacity_bytes=int(argv[2]))
        for line in sys.stdin:
            op, key, size = json.loads(line)
            if op == "put":
                out: object = s.put_many([(key, b"v" * size)])
            elif op == "get":
                got = s.get_many([key])[0]
                out = None if got is None else len(got)
            else:
                out = s.exists_many([key])
            print(json.dumps(out), flush=True)


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--driver", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _segment_bytes(path: Path) -> int:
    """Bytes of every segment file (what the capacity bounds)."""
    return sum(p.stat().st_size for p in path.glob("seg-*"))


def test_processes_share_one_capacity_and_agree(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    LocalStore(path, capacity_bytes=CAPACITY).close()
    workers = [_spawn("stress", str(path), "3", str(seed)) for seed in range(4)]
    results = []
    for proc in workers:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert all(r["ops"] > 50 for r in results), results
    assert sum(r["wrong"] for r in results) == 0, results
    assert sum(r["stats"]["corrupt"] for r in results) == 0, results
    evictions = sum(r["stats"]["evictions"] for r in results)
    assert evictions > len(KEYS) // 2, results  # the capacity really was under pressure
    # one capacity for the directory, not one per process
    capacity = LocalStore(path, capacity_bytes=CAPACITY).capacity_bytes
    assert 0 < _segment_bytes(path) <= capacity <= CAPACITY
    assert len(list(path.glob("seg-*"))) <= 4  # 4 segments: CAPACITY // MIN_SEGMENTS each
    # every process sees the same keys, and exists agrees with get in each of them
    views = []
    for _ in range(3):
        proc = _spawn("readable", str(path))
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        views.append(json.loads(out))
    assert views[0], "nothing left readable"
    assert views[0] == views[1] == views[2] == _readable(str(path))


class _Peer:
    """A store in another process, driven one command at a time."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.proc = _spawn("serve", str(path), str(capacity))

    def __call__(self, op: str, key: str, size: int = 0) -> object:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([op, key, size]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else "peer died"
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


SEG = 4096
PEER_CAPACITY = 4 * SEG  # 4 segments of 3 values of 1000 bytes


@pytest.fixture
def peer(tmp_path: Path):  # type: ignore[no-untyped-def]
    p = _Peer(tmp_path / "kv", PEER_CAPACITY)
    yield p
    p.close()


def _wait_idle_lease_given_back(store: LocalStore) -> None:
    """Until the segment ``store`` kept leased between puts is given back by its cleaner
    thread (:data:`LEASE_IDLE_S` after the last put): only then can another process evict it."""
    deadline = time.monotonic() + 10 * LEASE_IDLE_S + 5
    while any(r.owner == os.getpid() for r in store.disk.index.segments().values()):
        assert time.monotonic() < deadline, "an idle lease was never given back"
        time.sleep(0.05)


def test_put_after_another_process_evicted_writes_it_again(tmp_path: Path, peer: _Peer) -> None:
    """A puts k; B evicts it; A puts k again: the value is back and both processes see it
    (A's memory of having stored k once must not answer for the index)."""
    a = LocalStore(tmp_path / "kv", capacity_bytes=PEER_CAPACITY)
    assert a.put_many([("k", b"v" * 1000)]) == [True]
    assert peer("exists", "k") == [True]
    _wait_idle_lease_given_back(a)
    for i in range(12):  # B fills the shared capacity: k's segment, the oldest, is emptied
        assert peer("put", f"other-{i}", 1000) == [True]
    assert a.exists_many(["k"]) == [False] and peer("exists", "k") == [False]
    assert a.get_many(["k"]) == [None]
    assert a.put_many([("k", b"v" * 1000)]) == [True]
    assert a.where("k") is not None
    assert a.exists_many(["k"]) == [True] and a.get_many(["k"]) == [b"v" * 1000]
    assert peer("exists", "k") == [True] and peer("get", "k") == 1000


def test_value_evicted_mid_read_is_a_miss(tmp_path: Path, monkeypatch) -> None:
    """A reader whose segment is emptied and rewritten while it copies answers as the
    index now does: a miss, not corrupt, not the new bytes."""
    s = LocalStore(tmp_path / "kv", capacity_bytes=4 * SEG, segment_bytes=SEG)
    assert s.put_many([("k", b"x" * 1000)]) == [True]
    other = LocalStore(tmp_path / "kv", capacity_bytes=4 * SEG, segment_bytes=SEG)
    real = Tier.read
    calls = []

    def read_then_evict(self: Tier, loc):  # type: ignore[no-untyped-def]
        data = real(self, loc)
        calls.append(loc)
        if len(calls) == 1:  # the bytes are copied: another process empties the segment
            row = self.index.segments()[loc.seg]
            assert self._empty(loc.seg, row, remove=False) is not None
            self.index.release(loc.seg, row.gen + 1, os.getpid())
        return data

    monkeypatch.setattr(Tier, "read", read_then_evict)
    assert s.get_many(["k"]) == [None]
    assert s.stats["misses"] == 1 and s.stats["corrupt"] == 0
    assert other.exists_many(["k"]) == [False]


def test_dead_writers_segment_is_taken_over(tmp_path: Path) -> None:
    """A process that dies holding a segment (killed between its lease and its release)
    does not keep it: once its pid is gone, the segment is another writer's to use."""
    path = tmp_path / "kv"
    code = (
        "import os, sys; from ucm_patch.hooks.stores.local import LocalStore\n"
        f"s = LocalStore({str(path)!r}, capacity_bytes={4 * SEG}, segment_bytes={SEG})\n"
        "assert s.put_many([('before', b'b' * 1000)]) == [True]\n"
        "s.disk._new_lease(1088)  # leased, never released: then the process dies\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    s = LocalStore(path, capacity_bytes=4 * SEG, segment_bytes=SEG)
    owners = {row.owner for row in s.disk.index.segments().values()}
    assert owners - {0}, "the dead process's lease should still be recorded"
    for i in range(12):  # more than the other three segments hold
        assert s.put_many([(f"n{i}", b"n" * 1000)]) == [True]
    dead = owners - {0}
    # the dead writer's segment was taken over; the only owner left is this process,
    # which keeps the segment it appends to between its puts
    assert not dead & {row.owner for row in s.disk.index.segments().values()}
    assert {row.owner for row in s.disk.index.segments().values()} <= {0, os.getpid()}
    assert s.get_many(["n11"]) == [b"n" * 1000]


def test_segment_deleted_behind_the_store_is_recreated(tmp_path: Path) -> None:
    """Another process (or a person) deleting a segment file does not leave this store
    writing into, or reading from, the deleted one."""
    s = LocalStore(tmp_path / "kv", capacity_bytes=4 * SEG, segment_bytes=SEG)
    assert s.put_many([("k", b"old")]) == [True]
    segment = s.where("k").file  # type: ignore[union-attr]
    os.unlink(segment)  # the segment s keeps leased between its puts
    assert s.get_many(["k"]) == [None] and s.exists_many(["k"]) == [False]
    other = LocalStore(tmp_path / "kv", capacity_bytes=4 * SEG, segment_bytes=SEG)
    assert other.put_many([("k", b"new")]) == [True]
    assert s.exists_many(["k"]) == [True] and s.get_many(["k"]) == [b"new"]
    os.unlink(other.where("k").file)  # type: ignore[union-attr]
    assert s.get_many(["k"]) == [None]
    assert s.put_many([("k2", b"again")]) == [True]  # into its leased segment: a new file
    assert os.path.isfile(s.where("k2").file) and other.get_many(["k2"]) == [b"again"]  # type: ignore[union-attr]


if __name__ == "__main__" and sys.argv[1:2] == ["--driver"]:
    _driver(sys.argv[2:])
