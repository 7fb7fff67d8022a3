"""Local store: the shared contract, LRU capacity, restarts, config, and real disk errors.

Disk-full (ENOSPC) and read-only (EROFS) are produced for real, not monkeypatched: tests
run as root, where chmod does not stop writes, so the test starts a child in a private
mount namespace (``unshare -m``; ``unshare -rm`` when not root) that mounts a 256 KiB tmpfs,
fills it, then remounts it read-only. The child is this file run as a script
(``--fs-driver``); it writes its findings as JSON and any failure there fails the test.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Run as a script (the child driver) too: the repository root makes tests.support importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.store_contract import CASES, Harness
from ucm_patch.hooks.stores import (
    StoreConfigError,
    make_store,
    parse_size,
    split_store_config,
)
from ucm_patch.hooks.stores.base import KVStore, StoreError
from ucm_patch.hooks.stores.framing import HEADER_SIZE
from ucm_patch.hooks.stores.local import LocalStore

REPO = Path(__file__).resolve().parent.parent


def _path_of(store: LocalStore, key: str) -> str:
    return store._file(store._digest(key.encode()))


def tamper_local(store: KVStore, key: str, mode: object) -> None:
    """Damage a stored file in place (same inode), as bit rot or a torn write would."""
    assert isinstance(store, LocalStore)
    path = _path_of(store, key)
    size = os.path.getsize(path)
    if mode == "flip":
        with open(path, "r+b") as f:
            f.seek(HEADER_SIZE + (size - HEADER_SIZE) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    elif mode == "truncate":
        os.truncate(path, size - 7)
    elif isinstance(mode, tuple) and mode[0] == "swap":
        data = Path(_path_of(store, mode[1])).read_bytes()
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate(len(data))
    else:
        raise ValueError(f"unknown tamper mode {mode!r}")


@pytest.fixture
def kv_dir(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.mark.parametrize("case", sorted(CASES))
def test_contract(case: str, kv_dir: Path) -> None:
    harness = Harness(make=lambda: LocalStore(kv_dir, 256 << 20), tamper=tamper_local)
    CASES[case](harness)


# -- capacity and LRU ------------------------------------------------------------------------


def test_lru_eviction_keeps_recently_used(kv_dir: Path) -> None:
    """A put that does not fit evicts the least recently used values down to 90 %."""
    unit = HEADER_SIZE + 1000
    s = LocalStore(kv_dir, capacity_bytes=10 * unit)
    keys = [f"k{i}" for i in range(10)]
    assert s.put_many([(k, k.encode().ljust(1000, b".")) for k in keys]) == [True] * 10
    assert s.used_bytes == 10 * unit and s.stats["evictions"] == 0
    assert s.get_many(["k0"]) == [b"k0".ljust(1000, b".")]  # k0 becomes most recently used
    assert s.put_many([("new", b"n" * 1000)]) == [True]
    # 11 units do not fit in 10: the two oldest (k1, k2) go, leaving 9 = the low-water mark
    assert s.exists_many([*keys, "new"]) == [True, False, False] + [True] * 8
    assert not os.path.exists(_path_of(s, "k1"))
    assert s.stats["evictions"] == 2
    assert s.used_bytes == 9 * unit


def test_value_larger_than_capacity_is_skipped(kv_dir: Path) -> None:
    s = LocalStore(kv_dir, capacity_bytes=4096)
    assert s.put_many([("small", b"s" * 100), ("huge", b"h" * 5000)]) == [True, False]
    assert s.stats["skipped_full"] == 1
    assert s.get_many(["small", "huge"]) == [b"s" * 100, None]
    assert not os.path.exists(_path_of(s, "huge"))


def test_restart_sees_values_and_keeps_lru_order(kv_dir: Path) -> None:
    unit = HEADER_SIZE + 500
    s1 = LocalStore(kv_dir, capacity_bytes=1 << 20)
    s1.put_many([(k, k.encode() * 500) for k in "abc"])
    now = time.time()
    for age, key in ((300, "a"), (100, "b"), (200, "c")):  # LRU order on disk: a, c, b
        os.utime(_path_of(s1, key), (now - age, now - age))
    assert s1.get_many(["a"]) == [b"a" * 500]  # a hit refreshes the mtime: order c, b, a
    assert os.path.getmtime(_path_of(s1, "a")) > now - 10

    s2 = LocalStore(kv_dir, capacity_bytes=10 * unit)
    assert len(s2) == 3 and s2.used_bytes == 3 * unit
    fill = [f"f{i}" for i in range(7)]
    assert s2.put_many([(k, k.encode().ljust(500, b".")) for k in fill]) == [True] * 7
    assert s2.put_many([("d", b"d" * 500)]) == [True]  # 11 > 10 units: the 2 oldest go
    assert s2.exists_many(["a", "b", "c", "d"]) == [True, False, False, True]
    assert s2.stats["evictions"] == 2


def test_lower_capacity_on_restart_evicts_oldest(kv_dir: Path) -> None:
    s1 = LocalStore(kv_dir, capacity_bytes=1 << 20)
    s1.put_many([(f"k{i}", bytes([i]) * 1000) for i in range(5)])
    now = time.time()
    for i in range(5):
        os.utime(_path_of(s1, f"k{i}"), (now - 100 + i, now - 100 + i))
    s2 = LocalStore(kv_dir, capacity_bytes=3 * (HEADER_SIZE + 1000))  # low water: 2.7 values
    assert len(s2) == 2 and s2.stats["evictions"] == 3
    assert s2.exists_many([f"k{i}" for i in range(5)]) == [False, False, False, True, True]
    assert sum(len(files) for _, _, files in os.walk(kv_dir)) == 2 + 1  # and the ledger


def test_startup_removes_stale_temp_files_only(kv_dir: Path) -> None:
    s = LocalStore(kv_dir, capacity_bytes=1 << 20)
    s.put_many([("x", b"x")])
    shard = Path(_path_of(s, "x")).parent
    stale = shard / f".{'ab' * 16}.1.2.3.tmp"  # a writer that died long ago
    fresh = shard / f".{'cd' * 16}.1.2.4.tmp"  # a writer still at work
    foreign = shard / "notes.tmp"  # not ours: never touched
    for path in (stale, fresh, foreign):
        path.write_bytes(b"half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    os.utime(foreign, (old, old))
    (kv_dir / "README").write_text("not ours")
    again = LocalStore(kv_dir, capacity_bytes=1 << 20)
    assert not stale.exists() and fresh.exists() and foreign.exists()
    assert (kv_dir / "README").exists() and len(again) == 1


def test_empty_file_from_a_crash_is_corrupt(kv_dir: Path) -> None:
    s = LocalStore(kv_dir, capacity_bytes=1 << 20)
    s.put_many([("k", b"value")])
    Path(_path_of(s, "k")).write_bytes(b"")  # what a crash without fsync can leave
    assert s.get_many(["k"]) == [None]
    assert s.stats["corrupt"] == 1 and not os.path.exists(_path_of(s, "k"))


def test_other_process_writes_are_visible_and_first_wins(kv_dir: Path) -> None:
    mine = LocalStore(kv_dir, capacity_bytes=1 << 20)
    code = textwrap.dedent(
        f"""
        from ucm_patch.hooks.stores.local import LocalStore
        s = LocalStore({str(kv_dir)!r}, capacity_bytes=1 << 20)
        assert s.put_many([("shared", b"from-child")]) == [True]
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert mine.exists_many(["shared"]) == [True]
    assert mine.put_many([("shared", b"from-parent")]) == [True]
    assert mine.get_many(["shared"]) == [b"from-child"]
    assert len(mine) == 1


def test_fsync_mode_round_trips(kv_dir: Path) -> None:
    s = LocalStore(kv_dir, capacity_bytes=1 << 20, fsync=True)
    assert s.put_many([("k", b"durable")]) == [True]
    assert LocalStore(kv_dir, capacity_bytes=1 << 20).get_many(["k"]) == [b"durable"]


# -- real disk errors ------------------------------------------------------------------------


def test_directory_under_a_regular_file_fails_at_start(tmp_path: Path) -> None:
    """A path whose parent is a file cannot be created, even by root (ENOTDIR)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match=str(blocker / "kv")) as info:
        make_store({"local_path": str(blocker / "kv")})
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOTDIR


def _fs_driver(mount: str, out: str) -> None:
    """Inside a private mount namespace with a 256 KiB tmpfs at ``mount``: fill it with a
    file the store does not own, so that evicting cannot make room, then remount it
    read-only; record what the store does. Run by the test below."""
    report: dict[str, object] = {}
    blocker = os.path.join(mount, "blocker")
    fd = os.open(blocker, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"b" * 4096):
            pass
    except OSError:
        pass
    os.close(fd)
    os.truncate(blocker, os.path.getsize(blocker) - (40 << 10))  # 40 KiB free
    s = LocalStore(os.path.join(mount, "kv"), capacity_bytes=64 << 20)
    stored = [f"small-{i}" for i in range(2)]
    report["small_puts"] = s.put_many([(k, os.urandom(8 << 10)) for k in stored])
    key = "too-big"
    try:
        s.put_many([(key, os.urandom(64 << 10))])  # more than the free space + ours
        report["enospc_errno"] = None
    except StoreError as exc:
        report["enospc_errno"] = getattr(exc.__cause__, "errno", None)
        report["enospc_message"] = str(exc)
    report["failed_key_visible"] = s.exists_many([key]) == [True]
    report["failed_key_get"] = s.get_many([key]) == [None]
    report["errors_counted"] = s.stats["errors"]
    report["disk_full"] = s.stats["disk_full"]
    report["evicted_to_make_room"] = s.stats["evictions"]
    report["tmp_left"] = [n for _, _, fs in os.walk(mount) for n in fs if n.endswith(".tmp")]
    report["ro_put"] = s.put_many([("ro-key", b"r" * 1000)])
    s.close()  # its ledger is open for writing, which makes the remount busy
    subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
    s = LocalStore(os.path.join(mount, "kv"), capacity_bytes=64 << 20)
    try:
        s.put_many([("after-ro", b"x" * 100)])
        report["erofs_errno"] = None
    except StoreError as exc:
        report["erofs_errno"] = getattr(exc.__cause__, "errno", None)
    report["ro_read_ok"] = s.get_many(["ro-key"]) == [b"r" * 1000]
    report["ro_restart_ok"] = len(LocalStore(os.path.join(mount, "kv"), 64 << 20)) >= 1
    tiny = LocalStore(os.path.join(mount, "kv"), capacity_bytes=1)  # eviction cannot unlink
    report["ro_tiny_capacity_read_ok"] = tiny.get_many(["ro-key"]) == [b"r" * 1000]
    Path(out).write_text(json.dumps(report))


def test_disk_full_and_read_only_raise_store_error(tmp_path: Path) -> None:
    mount, out = tmp_path / "mnt", tmp_path / "report.json"
    mount.mkdir()
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = (
        f"mount -t tmpfs -o size=256k tmpfs {mount} && "
        f"exec {sys.executable} {Path(__file__).resolve()} --fs-driver {mount} {out}"
    )
    assert shutil.which("unshare"), "util-linux 'unshare' is required for this test"
    proc = subprocess.run(
        [*unshare, "sh", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout}\n{proc.stderr}"
    r = json.loads(out.read_text())
    assert r["small_puts"] == [True, True], r
    # ENOSPC: the store evicted its own two values, retried once, then gave up
    assert r["enospc_errno"] == errno.ENOSPC, r
    assert "No space left" in r["enospc_message"], r
    assert r["disk_full"] == 1 and r["evicted_to_make_room"] == 2, r
    assert r["errors_counted"] == 1, r
    assert r["failed_key_visible"] is False and r["failed_key_get"] is True, r
    assert r["tmp_left"] == [], r
    assert r["ro_put"] == [True], r
    assert r["erofs_errno"] == errno.EROFS, r
    assert r["ro_read_ok"] is True and r["ro_restart_ok"] is True, r
    assert r["ro_tiny_capacity_read_ok"] is True, r


# -- config ----------------------------------------------------------------------------------


def test_default_store_is_local_under_xdg_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # Free space moves while other processes write the same disk (a CI run failed on a
    # 4 KiB difference between the store's statvfs and a second one here), so the expected
    # cap is derived from the very statvfs result the store saw, still the real call.
    seen: list[os.statvfs_result] = []
    real_statvfs = os.statvfs

    def recording_statvfs(path: str) -> os.statvfs_result:
        seen.append(real_statvfs(path))
        return seen[-1]

    monkeypatch.setattr(os, "statvfs", recording_statvfs)
    s = make_store()
    assert isinstance(s, LocalStore)
    assert s.path == str(tmp_path / "xdg" / "ucm_patch" / "kv") and os.path.isdir(s.path)
    assert len(seen) == 1, seen
    free = seen[0].f_bavail * seen[0].f_frsize
    assert s.capacity_bytes == min(10 << 30, free) and s.fsync is False


def test_default_store_falls_back_to_home_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = make_store({"store": "local"})
    assert s.path == str(tmp_path / "home" / ".cache" / "ucm_patch" / "kv")


def test_explicit_local_config(tmp_path: Path) -> None:
    s = make_store(
        {"store": "local", "local_path": str(tmp_path / "d"), "local_capacity_bytes": "2MiB"}
        | {"local_fsync": True}
    )
    assert isinstance(s, LocalStore)
    assert (s.capacity_bytes, s.fsync) == (2 << 20, True)


@pytest.mark.parametrize(
    ("config", "named", "listed"),
    [
        ({"store": "redis"}, "store", "mooncake"),
        ({"local_capcity_bytes": 5}, "local_capcity_bytes", "local_capacity_bytes"),
        ({"mooncake_master": "h:1"}, "mooncake_master", "belongs to store 'mooncake'"),
        ({"store": "mooncake", "local_path": "/x"}, "local_path", "mooncake_master"),
        ({"local_capacity_bytes": 0}, "local_capacity_bytes", "at least 1"),
        ({"local_capacity_bytes": -5}, "local_capacity_bytes", "at least 1"),
        ({"local_capacity_bytes": "10GB"}, "local_capacity_bytes", "GiB"),
        ({"local_capacity_bytes": True}, "local_capacity_bytes", "bool"),
        ({"local_capacity_bytes": [1]}, "local_capacity_bytes", "512MiB"),
        ({"local_fsync": "yes"}, "local_fsync", "true or false"),
        ({"local_path": ""}, "local_path", "non-empty"),
        ({"store": "mooncake", "mooncake_master": "nohost"}, "mooncake_master", "host:port"),
        ({"store": "mooncake", "mooncake_master": "h:70000"}, "mooncake_master", "65535"),
        ({"store": "mooncake", "mooncake_protocol": "udp"}, "mooncake_protocol", "'tcp'"),
        ({"store": "mooncake", "mooncake_staging_buffers": 0}, "mooncake_staging_buffers", "64"),
        ({"store": "mooncake", "mooncake_staging_bytes": 1}, "mooncake_staging_bytes", "65536"),
        ({"store": "mooncake", "mooncake_setup_retries": 0}, "mooncake_setup_retries", "1000"),
    ],
)
def test_bad_config_names_key(config: dict, named: str, listed: str) -> None:
    with pytest.raises(StoreConfigError) as info:
        make_store(config)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(named + ":"), message
    assert listed in message, message


def test_split_store_config_by_prefix() -> None:
    store, rest = split_store_config(
        {"store": "local", "local_path": "/p", "mooncake_x": 1, "dump_threads": 4}
    )
    assert store == {"store": "local", "local_path": "/p", "mooncake_x": 1}
    assert rest == {"dump_threads": 4}


@pytest.mark.parametrize(
    ("value", "expected"),
    [(123, 123), ("64KiB", 64 << 10), ("512 MiB", 512 << 20), ("1.5GiB", 3 << 29), ("7", 7)],
)
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size("k", value) == expected


if __name__ == "__main__" and sys.argv[1:2] == ["--fs-driver"]:
    _fs_driver(sys.argv[2], sys.argv[3])
