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
    HEADER_SIZE,
    KEY_ENV,
    KEY_FILE_ENV,
    as_bytes_view,
    load_store_key,
    make_header,
)
from ucm_patch.hooks.stores.local import LocalStore

SECRET = "k" * 32


@pytest.fixture(autouse=True)
def _no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _path_of(store: LocalStore, key: str) -> str:
    return store._file(store._digest(key.encode()))


def _plant(store: LocalStore, key: str, payload: bytes, secret: bytes | None = None) -> None:
    """Write a value file as a writer outside the store would (CRC frame unless keyed)."""
    path = _path_of(store, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    view = as_bytes_view(payload)
    Path(path).write_bytes(make_header(key.encode(), view, secret) + payload)


# -- modes -----------------------------------------------------------------------------------


def test_new_directories_and_files_are_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a usual umask would leave 0755 / 0644
    try:
        s = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
        assert s.put_many([("k", b"v" * 100)]) == [True]
    finally:
        os.umask(old)
    value = _path_of(s, "k")
    assert _mode(tmp_path / "kv") == 0o700
    assert _mode(os.path.dirname(value)) == 0o700
    assert _mode(value) == 0o600
    assert _mode(tmp_path / "kv" / ".ucm_ledger") == 0o600


def test_modes_are_configurable(tmp_path: Path) -> None:
    old = os.umask(0o077)  # modes asked for in config win over a stricter umask
    try:
        s = make_store(
            {"local_path": str(tmp_path / "kv"), "local_dir_mode": "0750"}
            | {"local_file_mode": 0o640}
        )
        assert s.put_many([("k", b"v")]) == [True]
    finally:
        os.umask(old)
    assert isinstance(s, LocalStore)
    value = _path_of(s, "k")
    assert (_mode(tmp_path / "kv"), _mode(os.path.dirname(value))) == (0o750, 0o750)
    assert _mode(value) == 0o640


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


def test_symlink_in_place_of_a_value_is_a_miss(tmp_path: Path) -> None:
    s = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    outside = tmp_path / "outside"
    s2 = LocalStore(outside, capacity_bytes=1 << 20)
    assert s2.put_many([("k", b"secret elsewhere")]) == [True]
    target = _path_of(s2, "k")  # a valid frame for "k", outside the store
    link = _path_of(s, "k")
    os.makedirs(os.path.dirname(link))
    os.symlink(target, link)
    assert s.exists_many(["k"]) == [False]
    assert s.get_many(["k"]) == [None]
    assert s.stats["corrupt"] == 1 and not os.path.lexists(link)
    assert Path(target).exists()  # the link was removed, not what it pointed to
    os.symlink(target, link)  # a put replaces a planted link with a real file
    assert s.put_many([("k", b"mine")]) == [True]
    assert not os.path.islink(link) and s.get_many(["k"]) == [b"mine"]
    assert s2.get_many(["k"]) == [b"secret elsewhere"]


def test_symlinked_shard_directory_is_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    s = LocalStore(root, capacity_bytes=4 * (HEADER_SIZE + 100))
    elsewhere = tmp_path / "victim"
    victim = LocalStore(elsewhere, capacity_bytes=1 << 20)
    assert victim.put_many([("k", b"v" * 100)]) == [True]
    shard = os.path.basename(os.path.dirname(_path_of(s, "k")))
    os.symlink(elsewhere / shard, root / shard)  # root/<shard> -> victim's shard
    assert s.exists_many(["k"]) == [False] and s.get_many(["k"]) == [None]
    with pytest.raises(StoreError, match="not a directory"):
        s.put_many([("k", b"w" * 100)])
    # fill the store so it evicts: nothing in the victim's directory is touched
    others = [f"o{i}" for i in range(40)]
    for key in others:
        if os.path.basename(os.path.dirname(_path_of(s, key))) != shard:
            assert s.put_many([(key, b"o" * 100)]) == [True]
    assert s.stats["evictions"] > 0
    assert victim.get_many(["k"]) == [b"v" * 100]
    assert len(s) <= 4


# -- keyed integrity -------------------------------------------------------------------------


def test_forged_value_is_a_miss_with_a_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    s = LocalStore(tmp_path / "kv", capacity_bytes=1 << 20)
    assert s.put_many([("mine", b"good")]) == [True]
    assert s.get_many(["mine"]) == [b"good"]
    _plant(s, "crc-only", b"forged")  # a writer without the key: CRC frame
    _plant(s, "other-key", b"forged", secret=b"x" * 32)  # a writer with another key
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
