"""Memory tiers never stay behind in the tmpfs.

A memory tier is RAM (a tmpfs directory, allocated in full when it opens). These tests put
the default tier base on the real ``/dev/shm`` (``XDG_RUNTIME_DIR`` pointed at a fresh
directory there) and measure what the tmpfs really holds: the allocated blocks of every
file under the base (``st_blocks``), not what the store says.

* Stores opened on temporary directories, used, closed and their directories removed, in
  turn, leave at most one tier's footprint behind: none when closed (the last user spills
  and removes its tier), one when the processes were killed (each open removes the
  orphans of gone directories; the CLI removes the last).
* The last user's close spills what the tier holds to the disk tier first, and keeps at
  most ``local_memory_keep_bytes`` when the tier is kept.
* A tier a live process uses is never removed: not by another store's close, not by a
  sweep, not by the CLI.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env
from ucm_patch.hooks.stores import make_store, parse_store_config
from ucm_patch.hooks.stores.local import LocalStore, default_memory_path

SEG = 1 << 20
MEMORY = 16 * SEG  # a tier's capacity in these tests
CLI = str(Path(sys.executable).with_name("ucm-patch"))


@pytest.fixture
def shm_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The default tier base on the real tmpfs: ``$XDG_RUNTIME_DIR/ucm_patch`` with
    ``XDG_RUNTIME_DIR`` a fresh directory in /dev/shm (removed afterwards)."""
    runtime = Path(tempfile.mkdtemp(prefix="ucm_patch-tiers-test-", dir="/dev/shm"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    yield runtime / "ucm_patch"
    shutil.rmtree(runtime, ignore_errors=True)


def tmpfs_held(base: Path) -> int:
    """Bytes the tmpfs holds for the files under ``base``: their allocated blocks."""
    total = 0
    for root, _dirs, files in os.walk(base):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            total += st.st_blocks * 512
    return total


def _open(kv: Path, **extra: object) -> LocalStore:
    return LocalStore(kv, 64 * SEG, memory_bytes=MEMORY, segment_bytes=SEG, **extra)


def _warmed(store: LocalStore) -> None:
    assert store.memory is not None and store.memory._warmer is not None  # on the tmpfs
    store.memory._warmer.join(30)


def _values(tag: str, n: int = 12, size: int = 200 << 10) -> list[tuple[str, bytes]]:
    return [(f"{tag}-{i}", bytes([i + 1]) * size) for i in range(n)]


def test_twenty_temporary_stores_leave_no_tier_behind(shm_base: Path, tmp_path: Path) -> None:
    """The issue's run: twenty stores opened on temporary directories, used, closed and
    their directories removed, in turn. Each tier really held its capacity in the tmpfs
    while open; afterwards the tmpfs holds nothing of them."""
    one_tier = 0  # the most one tier held in the tmpfs while open (segments and index)
    for i in range(20):
        work = Path(tempfile.mkdtemp(dir=tmp_path))
        store = _open(work / "kv")
        try:
            _warmed(store)
            values = _values(f"run{i}")
            assert store.put_many(values) == [True] * len(values)
            assert store.get_many([k for k, _ in values]) == [v for _, v in values]
            held = tmpfs_held(Path(store.memory.path))
            assert held >= MEMORY  # allocated in full: the tmpfs held a whole tier
            one_tier = max(one_tier, held)
        finally:
            store.close()
        shutil.rmtree(work)
        assert tmpfs_held(shm_base) <= one_tier, i  # never more than one tier's
    assert tmpfs_held(shm_base) == 0
    assert list(shm_base.iterdir()) == []


def _killed_store(kv: Path) -> None:
    """A process that opens a store, fills its memory tier and dies without closing it
    (SIGKILL: no exit handler runs)."""
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        from ucm_patch.hooks.stores.local import LocalStore
        s = LocalStore({str(kv)!r}, {64 * SEG}, memory_bytes={MEMORY}, segment_bytes={SEG})
        s.memory._warmer.join(30)
        assert all(s.put_many([(f"k{{i}}", bytes(200 << 10)) for i in range(12)]))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = clean_env({"PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def test_killed_processes_leave_at_most_one_tier(shm_base: Path, tmp_path: Path) -> None:
    """Twenty processes killed with their stores open, their directories removed, in turn:
    no close ran, so each tier stays until the next store opens, which removes it (its
    local_path is gone). At most one tier is ever left: the last, which the CLI removes."""
    footprint = 0
    for i in range(20):
        work = Path(tempfile.mkdtemp(dir=tmp_path))
        _killed_store(work / "kv")
        held = tmpfs_held(shm_base)
        footprint = max(footprint, held)
        assert MEMORY <= held <= footprint, i  # this one's tier, never an older one
        assert len(list(shm_base.iterdir())) == 1, i
        shutil.rmtree(work)
    proc = subprocess.run(
        [CLI, "tiers", "--remove-orphans"], env=clean_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "orphan (removed)" in proc.stdout and "is gone" in proc.stdout
    assert tmpfs_held(shm_base) == 0 and list(shm_base.iterdir()) == []


def test_the_last_close_spills_to_disk_then_removes_the_tier(shm_base: Path, tmp_path: Path):
    store = _open(tmp_path / "kv")
    values = _values("v")
    assert store.put_many(values) == [True] * len(values)
    assert store.disk.stats()[0] == 0  # every value is in the memory tier only
    tier = Path(store.memory.path)
    store.close()
    assert not tier.exists() and store.stats["spilled"] == len(values)
    again = LocalStore(tmp_path / "kv", 64 * SEG, memory_bytes=0, segment_bytes=SEG)
    try:
        assert again.get_many([k for k, _ in values]) == [v for _, v in values]
        assert again.stats["disk_hits"] == len(values)
    finally:
        again.close()


def test_a_kept_tier_is_bounded_and_read_warm(shm_base: Path, tmp_path: Path) -> None:
    """``local_memory_keep_bytes``: the tier outlives its last process holding at most
    that many bytes of segments (the most recently used); every value is still served,
    from memory (kept) or from disk (spilled)."""
    keep = 3 * SEG
    store = _open(tmp_path / "kv", memory_keep_bytes=keep)
    _warmed(store)
    tier = Path(store.memory.path)
    old, new = _values("old", 20), _values("new", 10)  # 5 segments in all
    assert store.put_many(old) == [True] * 20
    assert store.put_many(new) == [True] * 10
    assert tmpfs_held(tier) >= MEMORY
    store.close()
    segments = sum(p.stat().st_blocks * 512 for p in tier.glob("seg-*"))
    assert 0 < segments <= keep
    index = (tier / "index" / "data.mdb").stat().st_blocks * 512
    assert tmpfs_held(tier) <= keep + index + 64 * 1024  # the segments kept, index, lru
    again = _open(tmp_path / "kv")
    try:
        assert again.get_many([k for k, _ in new]) == [v for _, v in new]
        assert again.stats["memory_hits"] == len(new)  # the most recent: read warm
        assert again.get_many([k for k, _ in old]) == [v for _, v in old]
    finally:
        again.close()
    assert not tier.exists()  # that store keeps nothing


def test_a_tier_in_use_is_never_removed(shm_base: Path, tmp_path: Path) -> None:
    """Two users of one tier: the first close leaves it (the other still uses it), a
    sweep by another store leaves it even with its local_path gone, and the last close
    removes it."""
    kv = tmp_path / "kv"
    first, second = _open(kv), _open(kv)
    tier = Path(first.memory.path)
    assert first.put_many([("a", b"x" * 1000)]) == [True]
    first.close()
    assert tier.exists() and second.get_many(["a"]) == [b"x" * 1000]
    assert second.stats["memory_hits"] == 1
    shutil.rmtree(kv)  # gone, but a process still uses the tier
    other = _open(tmp_path / "other")
    assert tier.exists()
    from ucm_patch.hooks.stores.memory_tiers import survey

    assert {t.path: t.state for t in survey()}[str(tier)] == "in use"
    second.close()  # its disk tier was deleted under it: the tier goes anyway
    assert not tier.exists()
    other.close()
    assert list(shm_base.iterdir()) == []


def test_a_local_path_made_again_gets_a_new_tier(shm_base: Path, tmp_path: Path) -> None:
    """``local_path`` removed and made again is another directory: the tier of the old
    one (kept, nobody using it) is removed when a store opens, not read for the new one."""
    kv = tmp_path / "kv"
    store = _open(kv, memory_keep_bytes=MEMORY)
    assert store.put_many([("a", b"x" * 1000)]) == [True]
    tier = Path(store.memory.path)
    store.close()
    assert tier.exists()
    marker = json.loads((tier / "tier.json").read_text())
    shutil.rmtree(kv)
    kv.mkdir()
    again = _open(kv)  # (the file system may give the new directory the old inode number)
    try:
        assert again.get_many(["a"]) == [None]
        fresh = json.loads((tier / "tier.json").read_text())
        assert (fresh["dev"], fresh["ino"]) == (os.stat(kv).st_dev, os.stat(kv).st_ino)
        assert fresh["token"] == (kv / "store.id").read_text() != marker["token"]
        assert fresh["created"] > marker["created"]
    finally:
        again.close()


def test_the_spill_at_close_is_bounded(shm_base: Path, tmp_path: Path, caplog) -> None:
    """No time left for the spill: the values are dropped (counted, said), the tier goes."""
    store = _open(tmp_path / "kv")
    assert store.put_many(_values("v", 6)) == [True] * 6
    tier = Path(store.memory.path)
    with caplog.at_level(logging.WARNING, logger="ucm_patch.hooks.stores.local"):
        store.close(spill_s=0)
    assert not tier.exists()
    assert store.stats["evictions"] == 6 and store.stats["spilled"] == 0
    assert any("6 values of the memory tier" in r.getMessage() for r in caplog.records)


def test_a_forked_child_keeps_no_tier_alive(shm_base: Path, tmp_path: Path) -> None:
    """A child forked while the store is open (a store is not usable across a fork) holds
    no lock of the tier, however long it runs: the parent's close is the last user's, and
    the tier goes (its values to disk) while the child still runs."""
    store = _open(tmp_path / "kv")
    _warmed(store)  # no thread of the store runs when it forks
    assert store.put_many([("v", b"v" * 5000)]) == [True]
    tier = Path(store.memory.path)
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait for the parent, then leave without a word
        try:
            signal.alarm(60)
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        store.close()
        assert not tier.exists()
    finally:
        os.write(go_w, b"1")
        os.waitpid(pid, 0)
    disk = LocalStore(tmp_path / "kv", 64 * SEG, segment_bytes=SEG)
    try:
        assert disk.get_many(["v"]) == [b"v" * 5000]
    finally:
        disk.close()


def test_keep_is_a_store_setting(shm_base: Path, tmp_path: Path) -> None:
    config = parse_store_config({"local_path": str(tmp_path / "kv")})
    assert config.values["local_memory_keep_bytes"] == 0
    store = make_store(
        {"local_path": str(tmp_path / "kv"), "local_memory_bytes": "4MiB"}
        | {"local_memory_keep_bytes": "1MiB", "local_segment_bytes": "1MiB"}
    )
    assert isinstance(store, LocalStore) and store.memory_keep_bytes == 1 << 20
    assert store.memory is not None
    assert store.memory.path == default_memory_path(tmp_path / "kv")
    assert Path(store.memory.path).parent == shm_base
    store.close()


# -- the CLI -----------------------------------------------------------------------------------


def _tiers(*args: str) -> dict:
    proc = subprocess.run(
        [CLI, "tiers", "--json", *args], env=clean_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_cli_lists_tiers_and_removes_only_orphans(shm_base: Path, tmp_path: Path) -> None:
    """``ucm-patch tiers``: each tier with its state, tmpfs bytes, last use, processes and
    local_path. ``--remove-orphans`` removes a tier whose local_path is gone once no
    process uses it, and never an idle tier of a directory that is still there."""
    holder_code = textwrap.dedent(
        f"""
        import sys
        from ucm_patch.hooks.stores.local import LocalStore
        s = LocalStore(sys.argv[1], {64 * SEG}, memory_bytes={MEMORY}, segment_bytes={SEG})
        s.memory._warmer.join(30)
        assert all(s.put_many([("k", bytes(1000))]))
        print("open", flush=True)
        sys.stdin.read()
        """
    )
    env = clean_env({"PYTHONPATH": str(REPO)})
    live_kv, idle_kv = tmp_path / "live", tmp_path / "idle"
    idle = _open(idle_kv, memory_keep_bytes=MEMORY)
    assert idle.put_many([("i", b"i" * 1000)]) == [True]
    idle_tier = idle.memory.path
    idle.close()
    holder = subprocess.Popen(
        [sys.executable, "-c", holder_code, str(live_kv)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        live_tier = default_memory_path(live_kv)
        before = time.time()
        listing = _tiers()
        assert listing["base"] == str(shm_base)
        rows = {t["path"]: t for t in listing["tiers"]}
        assert set(rows) == {live_tier, idle_tier}
        live = rows[live_tier]
        assert live["state"] == "in use" and live["pids"] == [holder.pid]
        assert live["local_path"] == str(live_kv) and live["size_bytes"] >= MEMORY
        assert live["last_use"] is not None and live["last_use"] <= before + 1
        assert rows[idle_tier]["state"] == "idle" and rows[idle_tier]["pids"] == []
        shutil.rmtree(live_kv)  # gone, but its process still runs
        listing = _tiers("--remove-orphans")
        assert {t["path"]: t["state"] for t in listing["tiers"]} == {
            live_tier: "in use",
            idle_tier: "idle",
        }
        assert os.path.isdir(live_tier)
        holder.kill()
        holder.wait()
        listing = _tiers("--remove-orphans")
        rows = {t["path"]: t for t in listing["tiers"]}
        assert rows[live_tier]["state"] == "orphan" and rows[live_tier]["removed"]
        assert "is gone" in rows[live_tier]["reason"]
        assert rows[live_tier]["size_bytes"] >= MEMORY  # what was freed
        assert not rows[idle_tier]["removed"] and os.path.isdir(idle_tier)
        assert not os.path.exists(live_tier)
        text = subprocess.run(
            [CLI, "tiers"], env=clean_env(), capture_output=True, text=True, check=True
        ).stdout
        assert idle_tier in text and "idle" in text and str(idle_kv) in text
    finally:
        holder.kill()
        holder.wait()


def test_cli_removes_unowned_tiers_only_when_asked(shm_base: Path) -> None:
    """A tier an earlier version made (no tier.json) is listed as unowned; it goes with
    ``--remove-unowned`` once no process maps it."""
    old = shm_base / "0123456789abcdef"
    (old / "index").mkdir(parents=True, mode=0o700)
    shm_base.chmod(0o700)
    (old / "seg-00000").write_bytes(b"\1" * SEG)
    rows = _tiers("--remove-orphans")["tiers"]
    assert [(t["path"], t["state"], t["removed"]) for t in rows] == [(str(old), "unowned", False)]
    assert rows[0]["size_bytes"] >= SEG
    rows = _tiers("--remove-unowned")["tiers"]
    assert rows[0]["removed"] and not old.exists()
