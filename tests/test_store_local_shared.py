"""Local store shared by several processes: the directory is the truth, one capacity.

Each process here is a separate Python interpreter (``subprocess``) running a small driver
(this file as a script), so no state is shared except the directory itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ucm_patch.hooks.stores.framing import HEADER_SIZE
from ucm_patch.hooks.stores.local import LocalStore

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


def _disk_bytes(path: Path) -> int:
    """Bytes of every value and temp file (the ledger excluded)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name != ".ucm_ledger")


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
    # one capacity for the directory, not one per process (4 x CAPACITY before)
    assert _disk_bytes(path) <= CAPACITY + HEADER_SIZE + VALUE_MAX
    assert not [p for p in path.rglob("*.tmp")]
    # the shared ledger tracks the disk: never below it, above only by values whose temp
    # file a scan counted before their writer reserved them (at most one per writer)
    ledger = int.from_bytes((path / ".ucm_ledger").read_bytes()[8:16], "little")
    assert _disk_bytes(path) <= ledger <= _disk_bytes(path) + 4 * (HEADER_SIZE + VALUE_MAX)
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


@pytest.fixture
def peer(tmp_path: Path):  # type: ignore[no-untyped-def]
    p = _Peer(tmp_path / "kv", 4 * (HEADER_SIZE + 1000))
    yield p
    p.close()


def test_put_after_another_process_evicted_writes_the_file(tmp_path: Path, peer: _Peer) -> None:
    """A puts k; B evicts it; A puts k again: the file is back and both processes see it
    (A's memory of having stored k once must not answer for the disk)."""
    a = LocalStore(tmp_path / "kv", capacity_bytes=4 * (HEADER_SIZE + 1000))
    assert a.put_many([("k", b"v" * 1000)]) == [True]
    assert peer("exists", "k") == [True]
    for i in range(4):  # B fills the shared capacity: k, the oldest, is evicted
        assert peer("put", f"other-{i}", 1000) == [True]
    assert a.exists_many(["k"]) == [False] and peer("exists", "k") == [False]
    assert a.get_many(["k"]) == [None]
    assert a.put_many([("k", b"v" * 1000)]) == [True]
    assert os.path.isfile(a._file(a._digest(b"k")))
    assert a.exists_many(["k"]) == [True] and a.get_many(["k"]) == [b"v" * 1000]
    assert peer("exists", "k") == [True] and peer("get", "k") == 1000


def test_value_evicted_mid_read_is_a_miss(tmp_path: Path, monkeypatch) -> None:
    """A reader whose file is unlinked while it reads answers as the disk now does."""
    s = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    assert s.put_many([("k", b"x" * 5000)]) == [True]
    path = s._file(s._digest(b"k"))
    import ucm_patch.hooks.stores.local as local

    real = local._read_exact
    calls = []

    def read_then_evict(fd: int, n: int) -> bytes:
        data = real(fd, n)
        calls.append(n)
        if len(calls) == 2:  # the payload has been read: another process evicts now
            os.unlink(path)
        return data

    monkeypatch.setattr(local, "_read_exact", read_then_evict)
    assert s.get_many(["k"]) == [None]
    assert s.stats["misses"] == 1 and s.stats["corrupt"] == 0


def test_ledger_drift_is_healed_without_evicting(tmp_path: Path, caplog) -> None:
    """A ledger left wrong (a crash between write and accounting) is corrected by the next
    scan; a high one does not make the store evict what still fits."""
    unit = HEADER_SIZE + 1000
    s = LocalStore(tmp_path / "kv", capacity_bytes=10 * unit)
    assert s.put_many([(f"k{i}", b"v" * 1000) for i in range(5)]) == [True] * 5
    ledger = tmp_path / "kv" / ".ucm_ledger"
    raw = bytearray(ledger.read_bytes())
    raw[8:16] = (10 * unit).to_bytes(8, "little")  # claims full; 5 units really
    ledger.write_bytes(bytes(raw))
    assert s.put_many([("more", b"m" * 1000)]) == [True]
    assert s.stats["evictions"] == 0 and s.used_bytes == 6 * unit
    with caplog.at_level("WARNING", logger="ucm_patch.hooks.stores.local"):
        smaller = LocalStore(tmp_path / "kv", capacity_bytes=5 * unit)  # a restart, smaller
    assert any("used capacity" in r.getMessage() for r in caplog.records)
    assert smaller.used_bytes <= int(5 * unit * 0.9) and len(smaller) == 4


def test_shard_deleted_behind_the_store_is_recreated(tmp_path: Path) -> None:
    """Another process (or a person) removing a shard directory does not leave this store
    writing into, or reading from, the deleted one."""
    s = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    assert s.put_many([("k", b"old")]) == [True]
    shard = os.path.dirname(s._file(s._digest(b"k")))
    shutil.rmtree(shard)
    assert s.exists_many(["k"]) == [False] and s.get_many(["k"]) == [None]
    other = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    assert other.put_many([("k", b"new")]) == [True]  # a new shard of the same name
    assert s.exists_many(["k"]) == [True] and s.get_many(["k"]) == [b"new"]
    shutil.rmtree(shard)
    assert s.put_many([("k", b"again")]) == [True]
    assert os.path.isfile(s._file(s._digest(b"k"))) and other.get_many(["k"]) == [b"again"]


if __name__ == "__main__" and sys.argv[1:2] == ["--driver"]:
    _driver(sys.argv[2:])
