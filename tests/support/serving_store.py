"""A small two-tier local store whose memory tier's cleaner process serves its publish
channels (hooks/stores/publish_channel.py): what the tests of the channel and of the
beside-forward put path start from."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.publish_channel import PublishChannels

SEG = 64 << 10
VALUE = 8 << 10


def value(key: str) -> bytes:
    """The ``VALUE`` bytes stored under ``key``."""
    return hashlib.blake2b(key.encode()).digest() * (VALUE // 64)


def open_store(tmp_path: Path) -> LocalStore:
    """16 memory segments of ``SEG`` bytes over 64 on disk, under ``tmp_path``."""
    return LocalStore(
        tmp_path / "kv", capacity_bytes=64 * SEG, memory_bytes=16 * SEG,
        memory_path=tmp_path / "shm", segment_bytes=SEG,
    )  # fmt: skip


def wait_serving(channels: PublishChannels, timeout: float = 30.0) -> None:
    """Until the cleaner process answered every channel's first request (number 0)."""
    deadline = time.monotonic() + timeout
    while True:
        for client in channels.clients:
            with client._lock:
                client._catch_up()
        if all(client._owed is None for client in channels.clients):
            return
        assert time.monotonic() < deadline, "the cleaner process never served"
        time.sleep(0.01)


def serving(s: LocalStore) -> PublishChannels:
    """The memory tier's cleaner process started by a put from this thread (not beside a
    forward: it leaves a lease kept) and serving every channel."""
    assert s.memory is not None
    assert all(s.put_many([("start", value("start"))]))
    deadline = time.monotonic() + 30
    while (channels := s.memory.cleaner.publishers) is None:
        assert time.monotonic() < deadline, "the cleaner process never started"
        time.sleep(0.01)
    wait_serving(channels)
    return channels
