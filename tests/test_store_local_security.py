"""Local store hardening: owner-only modes, no symlink following, keyed integrity, and the
Mooncake warning for a reachable segment without a key."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from ucm_patch.hooks.stores import StoreConfigError, make_store
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import (
    KEY_ENV,
    KEY_FILE_ENV,
    load_store_key,
)
from ucm_patch.hooks.stores.local import LocalStore

SECRET = "k" * 32


@pytest.fixture(autouse=True)
def _no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _segment_of(store: LocalStore, key: str) -> str:
    at = store.where(key)
    assert at is not None, key
    return at.file


def _plant(path: Path, key: str, payload: bytes, secret: str | None) -> None:
    """Store a value as a writer outside this store would: another process sharing the
    directory, without the key (``secret`` None: checksum frame) or with another one."""
    env = {k: os.environ.pop(k) for k in (KEY_ENV, KEY_FILE_ENV) if k in os.environ}
    if secret is not None:
        os.environ[KEY_ENV] = secret
    try:
        writer = LocalStore(path, capacity_bytes=1 << 20)
        assert writer.put_many([(key, payload)]) == [True]
        writer.close()
    finally:
        os.environ.pop(KEY_ENV, None)
        os.environ.update(env)


# -- modes -----------------------------------------------------------------------------------


def test_new_directories_and_files_are_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a usual umask would leave 0755 / 0644
    try:
        s = LocalStore(tmp_path / "kv", 1 << 20, memory_bytes=1 << 20, memory_path=tmp_path / "m")
        assert s.put_many([("k", b"v" * 100)]) == [True]
        s.memory = None  # type: ignore[assignment]  (the next put goes to disk too)
        s.tiers = (s.disk,)
        assert s.put_many([("d", b"v" * 100)]) == [True]
    finally:
        os.umask(old)
    for tier in ("kv", "m"):
        root = tmp_path / tier
        assert _mode(root) == 0o700 and _mode(root / "index") == 0o700, tier
        files = [root / "lru", root / "seg-00000", root / "index" / "data.mdb"]
        files.append(root / "index" / "lock.mdb")
        assert {f.name: _mode(f) for f in files} == {f.name: 0o600 for f in files}, tier


def test_modes_are_configurable(tmp_path: Path) -> None:
    old = os.umask(0o077)  # modes asked for in config win over a stricter umask
    try:
        s = make_store(
            {"local_path": str(tmp_path / "kv"), "local_dir_mode": "0750"}
            | {"local_file_mode": 0o640, "local_memory_bytes": 0}
        )
        assert s.put_many([("k", b"v")]) == [True]
    finally:
        os.umask(old)
    assert isinstance(s, LocalStore)
    assert (_mode(tmp_path / "kv"), _mode(tmp_path / "kv" / "index")) == (0o750, 0o750)
    assert _mode(_segment_of(s, "k")) == 0o640
    assert _mode(tmp_path / "kv" / "index" / "data.mdb") == 0o640


@pytest.mark.parametrize(
    ("config", "named", "listed"),
    [
        ({"local_dir_mode": "0600"}, "local_dir_mode", "0700"),
        ({"local_file_mode": 0o400}, "local_file_mode", "0600"),
        ({"local_file_mode": "rw-"}, "local_file_mode", "octal"),
        ({"local_dir_mode": 0o1777}, "local_dir_mode", "0777"),
        ({"local_dir_mode": True}, "local_dir_mode", "octal"),
    ],
)
def test_bad_mode_names_key(tmp_path: Path, config: dict, named: str, listed: str) -> None:
    with pytest.raises(StoreConfigError) as info:
        make_store({"local_path": str(tmp_path / "kv"), **config})
    assert str(info.value).startswith(named + ":") and listed in str(info.value)


# -- symlinks --------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["disk", "memory"])
def test_symlink_in_place_of_a_segment_is_never_followed(tmp_path: Path, tier: str) -> None:
    """A segment replaced by a link to another store's segment (holding a valid frame for
    the same key at the same place): a miss, the link is not followed but removed by the
    next put, and the other store's file is never touched."""
    memory = {"memory_bytes": 1 << 20, "memory_path": tmp_path / "m"} if tier == "memory" else {}
    s = LocalStore(tmp_path / "kv", 1 << 20, **memory)
    victim = LocalStore(tmp_path / "victim", 1 << 20, **memory and {"memory_path": tmp_path / "v"})
    assert victim.put_many([("k", b"secret elsewhere")]) == [True]
    assert s.put_many([("k", b"secret elsewhere")]) == [True]
    target, link = _segment_of(victim, "k"), _segment_of(s, "k")
    assert s.where("k").offset == victim.where("k").offset  # type: ignore[union-attr]
    before = Path(target).read_bytes()
    os.unlink(link)
    os.symlink(target, link)
    assert s.get_many(["k"]) == [None]
    assert s.stats["corrupt"] == 1 and s.exists_many(["k"]) == [False]
    assert s.put_many([("k2", b"mine")]) == [True]  # the writer's segment: link replaced
    assert not os.path.islink(link) and s.get_many(["k2"]) == [b"mine"]
    assert Path(target).read_bytes() == before
    assert victim.get_many(["k"]) == [b"secret elsewhere"]


def test_symlinked_index_is_refused_at_start(tmp_path: Path) -> None:
    victim = LocalStore(tmp_path / "victim", capacity_bytes=1 << 20)
    assert victim.put_many([("k", b"v" * 100)]) == [True]
    root = tmp_path / "kv"
    root.mkdir()
    os.symlink(tmp_path / "victim" / "index", root / "index")
    with pytest.raises(StoreError, match="not a directory"):
        LocalStore(root, capacity_bytes=1 << 20)
    (tmp_path / "kv2" / "index").mkdir(parents=True)
    os.symlink(tmp_path / "victim" / "index" / "data.mdb", tmp_path / "kv2" / "index" / "data.mdb")
    fresh = LocalStore(tmp_path / "kv2", capacity_bytes=1 << 20)  # the link removed, not used
    assert fresh.exists_many(["k"]) == [False] and len(fresh) == 0
    assert not os.path.islink(tmp_path / "kv2" / "index" / "data.mdb")
    assert victim.get_many(["k"]) == [b"v" * 100]


# -- keyed integrity -------------------------------------------------------------------------


def test_forged_value_is_a_miss_with_a_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    s = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    assert s.put_many([("mine", b"good")]) == [True]
    assert s.get_many(["mine"]) == [b"good"]
    _plant(tmp_path / "kv", "crc-only", b"forged", None)  # a writer without the key
    _plant(tmp_path / "kv", "other-key", b"forged", "x" * 32)  # a writer with another key
    assert s.exists_many(["crc-only", "other-key"]) == [True, True]  # present, not served
    assert s.get_many(["crc-only", "other-key"]) == [None, None]
    assert s.stats["corrupt"] == 2
    assert s.exists_many(["crc-only", "other-key"]) == [False, False]  # removed
    # a store without the key cannot read keyed values either (it could not check them)
    monkeypatch.delenv(KEY_ENV)
    plain = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    assert plain.get_many(["mine"]) == [None] and plain.stats["corrupt"] == 1


def test_key_file_and_bad_keys(tmp_path: Path, monkeypatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(SECRET + "\n")
    key_file.chmod(0o600)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    assert load_store_key() == SECRET.encode()
    s = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    assert s.put_many([("k", b"v")]) == [True] and s.get_many(["k"]) == [b"v"]
    monkeypatch.setenv(KEY_ENV, SECRET)
    with pytest.raises(StoreError, match="only one of"):
        LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    monkeypatch.delenv(KEY_FILE_ENV)
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(StoreError, match=f"{KEY_ENV}: the key must be at least 16 bytes"):
        LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)


def test_mooncake_warns_when_reachable_without_key(caplog, monkeypatch) -> None:
    """The warning is logged before setup, so no master is needed to see it."""
    from ucm_patch.hooks.stores.mooncake import MooncakeStore, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("10.0.0.5") and not is_loopback("node-3")
    monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    messages = []
    for host, key in (("10.0.0.5", None), ("127.0.0.1", None), ("10.0.0.5", SECRET)):
        if key:
            monkeypatch.setenv(KEY_ENV, key)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ucm_patch.hooks.stores.mooncake"):
            with pytest.raises(StoreError):  # nothing listens on port 1
                MooncakeStore(master="127.0.0.1:1", local_hostname=host, setup_retries=1)
        messages.append([r.getMessage() for r in caplog.records if "no store key" in r.message])
    assert len(messages[0]) == 1 and "10.0.0.5" in messages[0][0]
    assert messages[1] == [] and messages[2] == []


def test_key_file_readable_by_others_is_warned(tmp_path: Path, monkeypatch, caplog) -> None:
    """A key file group/others can read still works, but says so once, naming the file."""
    key_file = tmp_path / "key"
    key_file.write_text(SECRET)
    key_file.chmod(0o644)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    with caplog.at_level(logging.WARNING, logger="ucm_patch.hooks.stores.framing"):
        assert load_store_key() == SECRET.encode()
    warned = [r.getMessage() for r in caplog.records if "readable by group/others" in r.message]
    assert len(warned) == 1 and str(key_file) in warned[0] and "644" in warned[0]
    key_file.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucm_patch.hooks.stores.framing"):
        assert load_store_key() == SECRET.encode()
    assert not caplog.records
