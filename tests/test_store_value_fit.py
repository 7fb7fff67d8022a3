"""A value that cannot fit is said once, loudly: at start, or once per cause.

The connector knows its largest value when it starts (``KVLayout.max_value_bytes``:
``chunk_tokens`` of one row's pages, or a state), and opens the store for it:

* a local store's segments are made to hold one (larger than ``local_segment_bytes``
  when need be), or the configuration is refused at start with a ``ValueSizeError`` that
  names ``local_capacity_bytes`` / ``local_memory_bytes`` / ``local_segment_bytes`` and the
  value size. Before, a 3.5 MiB store with ``local_memory_bytes: 0`` got segments of a
  quarter of that and skipped every 1 MiB value, counted in ``skipped_full`` only;
* a directory made for smaller values (its segment size is recorded) is refused the same
  way; a memory tier of that kind, or of a default size too small, is left out with a
  WARNING (values go to disk);
* a put that skips values anyway (a store opened without the connector's size, every
  segment being written by live processes, Mooncake without room, the dump queue full)
  logs one WARNING per cause, rate-limited: the same skip again within the interval
  logs nothing more.

The values are those of Qwen3-8B on a GPU: 8 KV heads of 128 in bf16, 16-token blocks,
a 64 KiB page, 256-token chunks: 1 MiB.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from tests.support.connector_harness import vllm_config
from tests.support.fakes_store import FakeStore
from tests.support.one_client import OneClientScheduler
from ucm_patch.connector import UCMPatchConnector
from ucm_patch.connector import kv_connector as connector
from ucm_patch.connector.layout import KVLayout
from ucm_patch.hooks.device import CpuDevice
from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores import StoreConfigError, ValueSizeError, make_store
from ucm_patch.hooks.stores.base import KVStore
from ucm_patch.hooks.stores.local import LocalStore, default_memory_bytes
from ucm_patch.hooks.stores.tier import MIN_SEGMENTS, segment_for

QWEN3_8B = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
VALUE = 1 << 20  # 16 pages of 64 KiB
NEED = segment_for(VALUE)  # a segment holding one: the record rounded up to whole pages
LOCAL_LOG = "ucm_patch.hooks.stores.local"


def qwen3_8b_cache(num_blocks: int = 32) -> KVCacheConfig:
    page = QWEN3_8B.page_size_bytes
    tensor = KVCacheTensor(
        size=num_blocks * page, layers=["l0"], layer_stride=num_blocks * page, block_stride=page
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], QWEN3_8B)],
    )


@pytest.fixture
def stores() -> Iterator[None]:
    """The connector's process-wide store cache, empty before and closed after."""
    connector._stores.clear()
    yield
    for store in list(connector._stores.values()):
        store.close()
    connector._stores.clear()


def start(store_keys: dict[str, Any], chunk_tokens: int = 256) -> UCMPatchConnector:
    """The scheduler-side connector of Qwen3-8B's GPU layout on ``store_keys``."""
    extra = {"chunk_tokens": chunk_tokens, "store": "local", **store_keys}
    cfg = vllm_config(extra, block_size=16)
    return UCMPatchConnector(cfg, KVConnectorRole.SCHEDULER, qwen3_8b_cache())


def warnings_of(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger and r.levelno == logging.WARNING and text in r.getMessage()
    ]


# -- sized at start --------------------------------------------------------------------------


def test_the_connectors_largest_value_is_its_chunk_of_pages() -> None:
    layout = KVLayout.from_vllm(vllm_config(block_size=16), qwen3_8b_cache(), None, 256)
    assert layout.max_value_bytes == VALUE == 16 * QWEN3_8B.page_size_bytes


def test_a_store_too_small_for_the_values_is_refused_at_start_naming_the_keys(
    tmp_path: Path, stores: None
) -> None:
    """3.5 MiB and no memory tier: fewer than four 1 MiB values fit. Refused when vLLM
    builds the connector, with the keys, the value size and what would work; nothing is
    created on disk."""
    kv = tmp_path / "kv"
    keys = {"local_path": str(kv), "local_capacity_bytes": "3584KiB", "local_memory_bytes": 0}
    with pytest.raises(ValueSizeError) as info:
        start(keys)
    msg = str(info.value)
    assert isinstance(info.value, StoreConfigError)
    for part in (
        "local_capacity_bytes 3670016",
        f"values of {VALUE} bytes",
        "local_memory_bytes 0",
        "local_segment_bytes",
        f"at least {MIN_SEGMENTS * NEED}",
        "chunk_tokens (256)",
    ):
        assert part in msg, (part, msg)
    assert not kv.exists()
    assert connector._stores == {}


def test_the_smallest_store_that_works_stores_every_value(tmp_path: Path, stores: None) -> None:
    keys = {
        "local_path": str(tmp_path / "kv"),
        "local_capacity_bytes": MIN_SEGMENTS * NEED,
        "local_memory_bytes": 0,
    }
    store = start(keys).store
    assert isinstance(store, LocalStore) and store.max_value_bytes() >= VALUE
    values = [(f"k{i}", bytes([i]) * VALUE) for i in range(7)]
    assert store.put_many(values) == [True] * 7
    assert store.stats["skipped_full"] == 0
    assert store.get_many(["k6"]) == [values[6][1]]


def test_segments_smaller_than_a_value_grow_to_hold_one(
    tmp_path: Path, stores: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ucm_patch.hooks.stores.tier")
    keys = {
        "local_path": str(tmp_path / "kv"),
        "local_capacity_bytes": "64MiB",
        "local_memory_bytes": 0,
        "local_segment_bytes": "1MiB",  # a 1 MiB value's record is a little more
    }
    store = start(keys).store
    assert isinstance(store, LocalStore) and store.disk.segment_bytes == NEED
    assert store.put_many([(f"k{i}", b"v" * VALUE) for i in range(7)]) == [True] * 7
    assert any(f"segments of {NEED} bytes" in r.getMessage() for r in caplog.records)


def test_a_directory_made_for_smaller_values_is_refused(tmp_path: Path, stores: None) -> None:
    kv = tmp_path / "kv"
    LocalStore(kv, capacity_bytes=64 << 20, segment_bytes=512 << 10).close()
    keys = {"local_path": str(kv), "local_capacity_bytes": "64MiB", "local_memory_bytes": 0}
    with pytest.raises(ValueSizeError) as info:
        start(keys)
    msg = str(info.value)
    assert f"values of {VALUE} bytes" in msg and "segments of 524288 bytes" in msg, msg
    assert "local_path" in msg, msg
    # the directory is as it was: a store for small values still opens on it
    LocalStore(kv, capacity_bytes=64 << 20).close()


def test_a_memory_tier_set_too_small_is_refused(tmp_path: Path, stores: None) -> None:
    keys = {
        "local_path": str(tmp_path / "kv"),
        "local_capacity_bytes": "64MiB",
        "local_memory_bytes": "2MiB",
        "local_memory_path": str(tmp_path / "mem"),
    }
    with pytest.raises(ValueSizeError) as info:
        start(keys)
    msg = str(info.value)
    for part in ("local_memory_bytes 2097152", f"values of {VALUE} bytes", "or to 0"):
        assert part in msg, (part, msg)
    assert not (tmp_path / "mem").exists()


def test_a_memory_tier_of_an_older_layout_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process still uses the store's memory tier, made with 256 KiB segments (1 MiB of
    memory); a process for 1 MiB values starts on the same store: it runs without that
    tier, says so, and its values go to disk."""
    kv, mem = tmp_path / "kv", tmp_path / "mem"
    old = LocalStore(kv, 64 << 20, memory_bytes=1 << 20, memory_path=mem)
    assert old.memory is not None and old.memory.segment_bytes == 256 << 10
    caplog.set_level(logging.WARNING, logger=LOCAL_LOG)
    s = LocalStore(kv, 64 << 20, memory_bytes=8 << 20, memory_path=mem, value_bytes=VALUE)
    try:
        assert s.memory is None and s.tiers == (s.disk,)
        said = warnings_of(caplog, LOCAL_LOG, "running without it")
        assert len(said) == 1 and str(mem) in said[0] and str(VALUE) in said[0], said
        assert s.put_many([("k", b"v" * VALUE)]) == [True]
        assert s.where("k").tier == "disk"
    finally:
        s.close()
        old.close()


def test_a_default_memory_tier_too_small_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOCAL_LOG)
    huge = 1 << 30  # four of them exceed the default's 2 GiB cap on any tmpfs
    assert default_memory_bytes(str(tmp_path / "mem"), str(tmp_path / "kv"), huge) == 0
    said = warnings_of(caplog, LOCAL_LOG, "no memory tier")
    assert len(said) == 1 and "local_memory_bytes" in said[0], said
    assert default_memory_bytes(str(tmp_path / "mem"), str(tmp_path / "kv"), VALUE) > 0


def test_a_store_reused_in_the_process_for_larger_values_is_refused(
    tmp_path: Path, stores: None
) -> None:
    keys = {
        "local_path": str(tmp_path / "kv"),
        "local_capacity_bytes": "1MiB",
        "local_memory_bytes": 0,
    }
    small = start(keys, chunk_tokens=16)  # 64 KiB values: 256 KiB segments
    assert small.store.max_value_bytes() < VALUE
    with pytest.raises(ValueSizeError, match=f"values of {VALUE} bytes do not fit"):
        start(keys)


def test_make_store_sizes_the_segments_from_config(tmp_path: Path) -> None:
    config = {
        "local_path": str(tmp_path / "kv"),
        "local_capacity_bytes": "8MiB",
        "local_memory_bytes": 0,
        "local_segment_bytes": "512KiB",
    }
    store = make_store(config, value_bytes=VALUE)
    try:
        assert isinstance(store, LocalStore) and store.disk.segment_bytes == NEED
        assert store.disk.count == (8 << 20) // NEED
    finally:
        store.close()


# -- said once per cause when a put skips ----------------------------------------------------


def test_a_value_larger_than_a_segment_is_one_warning_per_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOCAL_LOG)
    s = LocalStore(tmp_path / "kv", capacity_bytes=4096)  # no value size given: 4 KiB segments
    try:
        assert s.put_many([("small", b"s" * 100), ("huge", b"h" * 5000)]) == [True, False]
        said = warnings_of(caplog, LOCAL_LOG, "larger than a segment")
        assert len(said) == 1, said
        assert "5000 bytes" in said[0] and "local_segment_bytes" in said[0], said
        assert s.put_many([("huge2", b"h" * 6000)]) == [False]  # the same cause, at once
        assert len(warnings_of(caplog, LOCAL_LOG, "larger than a segment")) == 1
        assert s.stats["skipped_full"] == 2
    finally:
        s.close()


def test_every_segment_busy_is_its_own_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every segment leased by another live process (the parent of this one stands in)."""
    caplog.set_level(logging.WARNING, logger=LOCAL_LOG)
    s = LocalStore(tmp_path / "kv", capacity_bytes=4 * (16 << 10), segment_bytes=16 << 10)
    try:
        other = os.getppid()
        for seg in range(s.disk.count):
            assert s.disk.index.claim(seg, None, other, empty=True) is not None
        assert s.put_many([("a", b"a" * 100)]) == [False]
        assert s.put_many([("b", b"b" * 100)]) == [False]
        said = warnings_of(caplog, LOCAL_LOG, "being written by live processes")
        assert len(said) == 1 and "local_capacity_bytes" in said[0], said
        assert warnings_of(caplog, LOCAL_LOG, "larger than a segment") == []
    finally:
        s.close()


def test_mooncake_without_room_is_one_warning_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """NO_AVAILABLE_HANDLE (the cluster has no room): said, once per interval. A stand-in
    for the client's transfers; the real full store runs in tests/test_store_mooncake.py."""
    from ucm_patch.hooks.stores import mooncake as mc

    store = object.__new__(mc.MooncakeStore)
    KVStore.__init__(store)
    store.master = "127.0.0.1:50051"
    store._closed = False
    store._stats_lock = threading.Lock()
    store._warn = RateLimitedLog(mc.log, 30.0)

    def no_room(unique: list[Any], codes: list[int]) -> None:
        codes[:] = [mc.NO_AVAILABLE_HANDLE] * len(unique)

    store._put_unique = no_room  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger=mc.log.name)
    assert store.put_many([("a", b"a" * 300), ("b", b"b" * 700)]) == [False, False]
    assert store.put_many([("c", b"c" * 300)]) == [False]
    said = warnings_of(caplog, mc.log.name, "NO_AVAILABLE_HANDLE")
    assert len(said) == 1 and "2 value(s) of up to 700 bytes" in said[0], said
    assert store.stats["skipped_full"] == 3


def test_a_dump_skipped_by_a_full_queue_is_one_warning_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = "ucm_patch.hooks.dump.scheduler"
    caplog.set_level(logging.WARNING, logger=name)
    store = FakeStore()
    store.hold()
    sched = OneClientScheduler(CpuDevice(), workers=1, capacity=1, on_full="skip")
    try:
        batch = sched.open_batch(["r"], store)
        assert sched.submit(batch, 0, ["k0"], [b"v" * 8])
        assert sched.submit(batch, 1, ["k1"], [b"v" * 8]) is False
        assert sched.submit(batch, 2, ["k2"], [b"v" * 8]) is False
        said = warnings_of(caplog, name, "dump queue full")
        assert len(said) == 1 and "dump_queue_capacity" in said[0], said
        assert sched.metrics.dumps_skipped == 2
    finally:
        store.release()
        sched.seal(batch)
        deadline = time.monotonic() + 5.0
        while sched.has_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        sched.shutdown(timeout=2.0)
