"""No one else's directory or file.

Another local user can make, beforehand, the directories and files a store will use:
``/dev/shm`` is writable by everyone and the memory tier's names are predictable, and a
``local_path`` may sit in a shared directory. Whoever owns a directory can replace what is
in it, so a store must not use it. Here such things are planted for real (as root, the way
CI runs: ``os.chown`` to uid 65534), and each test checks that the store refuses at start
with a message naming the path, its owner and its mode, and that nothing was read from or
written into what was planted (names, owners, modes, sizes, contents and mtimes are the
same before and after).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.local import LocalStore, default_memory_path

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting another uid's files needs root")

NOBODY = 65534
SEG = 1 << 20


def _open(kv: Path, memory: bool = True, **extra: object) -> LocalStore:
    more: dict = {"memory_bytes": 4 * SEG} if memory else {}
    return LocalStore(kv, 16 * SEG, segment_bytes=SEG, **more, **extra)


def plant_dir(path: Path, mode: int = 0o777, uid: int = NOBODY) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


def plant_file(path: Path, data: bytes, mode: int = 0o600, uid: int = NOBODY) -> Path:
    path.write_bytes(data)
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything about the tree at ``root`` a store could change by using it."""
    out: dict[str, tuple] = {}
    for path in [root, *(sorted(root.rglob("*")) if root.is_dir() else [])]:
        st = os.lstat(path)
        digest = ""
        if stat.S_ISREG(st.st_mode):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        key = str(path.relative_to(root))
        out[key] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, digest)
    return out


def refused(info: pytest.ExceptionInfo[StoreError], path: Path, owner: str, mode: str) -> None:
    """The message names the path, its owner and its mode (OpenSSH StrictModes' words)."""
    text = str(info.value)
    assert "bad ownership or modes" in text, text
    assert str(path) in text and owner in text and mode in text, text


@pytest.fixture
def shm_uid(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """No ``XDG_RUNTIME_DIR``: the tiers go to ``/dev/shm/ucm_patch-<uid>``, as for a
    service or a container. The uid in that name is made unique for the test (this user
    stays root), so the host's own tier base is never touched."""
    fake = 2_000_000_000 + os.getpid()
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(os, "getuid", lambda: fake)
    yield fake
    base = Path(f"/dev/shm/ucm_patch-{fake}")
    if base.is_symlink():
        base.unlink()
    shutil.rmtree(base, ignore_errors=True)


# -- directories -----------------------------------------------------------------------------


def test_a_tier_base_made_by_another_user_in_dev_shm_is_refused(
    shm_uid: int, tmp_path: Path
) -> None:
    """The issue's case: ``/dev/shm/ucm_patch-<uid>`` and the tier directory made
    beforehand by uid 65534, mode 0777. The store refuses; it writes nothing there."""
    kv = tmp_path / "kv"
    base = Path(f"/dev/shm/ucm_patch-{shm_uid}")
    tier = Path(default_memory_path(kv))
    assert tier.parent == base
    plant_dir(base)
    plant_dir(tier)
    before = snapshot(base)
    with pytest.raises(StoreError) as info:
        _open(kv)
    refused(info, base, "65534", "drwxrwxrwx")
    assert "0777" in str(info.value)
    assert snapshot(base) == before


def test_a_tier_made_by_another_user_is_refused(shm_uid: int, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    tier = Path(default_memory_path(kv))
    tier.parent.mkdir(mode=0o700)
    plant_dir(tier, mode=0o700)
    before = snapshot(tier)
    with pytest.raises(StoreError) as info:
        _open(kv)
    refused(info, tier, "65534", "drwx------")
    assert snapshot(tier) == before


def test_a_symbolic_link_planted_as_the_tier_base_is_not_followed(
    shm_uid: int, tmp_path: Path
) -> None:
    """Another user's link in /dev/shm, pointing at a directory of this user: never
    followed, so nothing lands in the directory it points at."""
    target = tmp_path / "mine"
    target.mkdir(mode=0o700)
    base = Path(f"/dev/shm/ucm_patch-{shm_uid}")
    base.symlink_to(target)
    os.lchown(base, NOBODY, NOBODY)
    with pytest.raises(StoreError, match="not a directory"):
        _open(tmp_path / "kv")
    assert list(target.iterdir()) == []


def test_a_tier_writable_by_others_is_refused(tmp_path: Path) -> None:
    """This user's own directory, but any user may write it: refused all the same."""
    kv = tmp_path / "kv"
    tier = Path(default_memory_path(kv))
    tier.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    plant_dir(tier, mode=0o777, uid=0)
    before = snapshot(tier)
    with pytest.raises(StoreError) as info:
        _open(kv)
    refused(info, tier, "0 (root)", "drwxrwxrwx")
    assert "writable by group and others beyond local_dir_mode 0700" in str(info.value)
    assert snapshot(tier) == before


@pytest.mark.parametrize("mode", [0o755, 0o777])
def test_a_local_path_of_another_user_is_refused(tmp_path: Path, mode: int) -> None:
    kv = plant_dir(tmp_path / "kv", mode=mode)
    before = snapshot(kv)
    with pytest.raises(StoreError) as info:
        _open(kv, memory=False)
    refused(info, kv, "65534", stat.filemode(stat.S_IFDIR | mode))
    assert snapshot(kv) == before


def test_a_group_writable_local_path_is_accepted_when_configured(tmp_path: Path) -> None:
    """ "Beyond the configured modes": with local_dir_mode 0770 a group-writable directory
    of this user is the store's; 0777 is still refused."""
    kv = plant_dir(tmp_path / "kv", mode=0o770, uid=0)
    _open(kv, memory=False, dir_mode=0o770).close()
    os.chmod(kv, 0o777)
    with pytest.raises(StoreError, match="writable by others beyond local_dir_mode 0770"):
        _open(kv, memory=False, dir_mode=0o770)


@pytest.mark.parametrize("tier", ["disk", "memory"])
def test_an_index_directory_of_another_user_is_refused(tmp_path: Path, tier: str) -> None:
    kv = tmp_path / "kv"
    root = kv if tier == "disk" else Path(default_memory_path(kv))
    root.mkdir(mode=0o700, parents=True)
    if tier == "memory":
        os.chmod(root.parent, 0o700)
    index = plant_dir(root / "index", mode=0o700)
    plant_file(index / "data.mdb", b"\0" * 8192)
    before = snapshot(index)
    with pytest.raises(StoreError) as info:
        _open(kv)
    refused(info, index, "65534", "drwx------")
    assert snapshot(index) == before


def test_a_foreign_base_is_left_alone_by_a_store_without_memory_tier(
    shm_uid: int, tmp_path: Path
) -> None:
    """A disk-only store opens, and its sweep of the memory tiers never enters a base
    that is not this user's."""
    base = plant_dir(Path(f"/dev/shm/ucm_patch-{shm_uid}"))
    plant_dir(base / "0123456789abcdef")
    before = snapshot(base)
    store = _open(tmp_path / "kv", memory=False)
    assert store.put_many([("k", b"v")]) == [True]
    store.close()
    assert snapshot(base) == before


# -- files -----------------------------------------------------------------------------------

PLANTED_FILES = [
    ("disk", "lru"),
    ("disk", "seg-00000"),
    ("disk", "index/data.mdb"),
    ("disk", "index/lock.mdb"),
    ("disk", "store.id"),
    ("memory", "lru"),
    ("memory", "seg-00000"),
    ("memory", "index/data.mdb"),
    ("memory", "tier.json"),
]


@pytest.mark.parametrize(("tier", "name"), PLANTED_FILES)
def test_a_file_of_another_user_is_refused(tmp_path: Path, tier: str, name: str) -> None:
    """A file made beforehand by uid 65534 where the store keeps one of its own: refused at
    start (owner and mode named), never read, never written."""
    kv = tmp_path / "kv"
    root = kv if tier == "disk" else Path(default_memory_path(kv))
    (root / "index").mkdir(mode=0o700, parents=True)
    if tier == "memory":
        os.chmod(root.parent, 0o700)
    planted = plant_file(root / name, b"planted \x01" * 4000, mode=0o644)
    before = snapshot(planted)
    with pytest.raises(StoreError) as info:
        _open(kv)
    refused(info, planted, "65534", "-rw-r--r--")
    assert snapshot(planted) == before


@pytest.mark.parametrize("name", ["seg-00000", "lru", "index/lock.mdb"])
def test_a_file_open_to_others_is_refused(tmp_path: Path, name: str) -> None:
    """This user's file, but others may write it (mode 0666): refused as well."""
    kv = tmp_path / "kv"
    (kv / "index").mkdir(mode=0o700, parents=True)
    planted = plant_file(kv / name, b"\0" * 4096, mode=0o666, uid=0)
    before = snapshot(planted)
    with pytest.raises(StoreError) as info:
        _open(kv, memory=False)
    refused(info, planted, "0 (root)", "-rw-rw-rw-")
    assert "open to group/others beyond local_file_mode 0600" in str(info.value)
    assert snapshot(planted) == before


def test_a_segment_replaced_by_another_users_file_is_never_read_or_written(
    tmp_path: Path,
) -> None:
    """While the store runs: a segment replaced by another user's file (a faithful copy,
    so that only its owner tells it apart) is a miss; the next writer of that segment
    puts a file of its own in its place, and the planted one is never written."""
    kv = tmp_path / "kv"
    store = _open(kv, memory=False)
    try:
        assert store.put_many([("k", b"v" * 1000)]) == [True]
        at = store.where("k")
        assert at is not None
        seg = Path(at.file)
        data = seg.read_bytes()
        seg.unlink()
        plant_file(seg, data)
        held = tmp_path / "planted"  # the planted file, whatever its name becomes
        os.link(seg, held)
        before = snapshot(held)
        assert store.get_many(["k"]) == [None]
        assert store.put_many([("k2", b"w" * 1000)]) == [True]
        assert store.get_many(["k2"]) == [b"w" * 1000]
        assert os.stat(seg).st_uid == 0 and not os.path.samefile(seg, held)
        assert snapshot(held) == before
    finally:
        store.close()
