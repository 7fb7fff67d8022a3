"""Event-source resolution, ownership and counters (the review comments of UCM #1025 as tests).

Also the Device interface: CPU events, pooled owned events, and the NPU module driven by
stand-in ``torch_npu`` / ``acl`` modules (the only stand-ins the project allows: no NPU
here). The CUDA device needs a GPU and is covered by the benchmark's device mode only.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import types
from typing import Any

import pytest

from ucm_patch.hooks import layerwise
from ucm_patch.hooks.device import CpuDevice, CpuEvent, EventHandleError, FakeEvent
from ucm_patch.hooks.device_choice import make_device
from ucm_patch.hooks.events import EventLedger, EventSource
from ucm_patch.hooks.metrics import EVENT_SOURCE_NAMES, DumpMetrics, export


class Md:
    """An attention-metadata object with vLLM-Ascend's ``reshape_cache_event`` attribute."""

    def __init__(self, event: Any = None) -> None:
        if event is not None:
            self.reshape_cache_event = event


class BrokenEvent(CpuEvent):
    def record(self, stream: Any = None) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class NoRecordDevice(CpuDevice):
    """A device whose current-stream event cannot be recorded (as a broken CUDA context)."""

    def _new_event(self) -> CpuEvent:
        return BrokenEvent(1)


@pytest.fixture
def table() -> dict[str, Any]:
    return {}


def ledger_for(table: dict[str, Any], device: CpuDevice | None = None, **kw: Any) -> EventLedger:
    return EventLedger(device or CpuDevice(), DumpMetrics(), kv_ready_table=table, **kw)


def acquire_release(ledger: EventLedger, layer: str, md: Any) -> tuple[Any, bool, int]:
    out = ledger.acquire(layer, md)
    ledger.release(out[0], out[1])
    return out


# ---------------------------------------------------------------------------------------
# Resolution order
# ---------------------------------------------------------------------------------------


def test_per_layer_metadata_event_wins_over_every_other_source(table) -> None:
    layer_ev, direct_ev, table_ev = CpuEvent(1), CpuEvent(2), CpuEvent(3)
    table["L"] = table_ev
    ledger = ledger_for(table)
    forward_md = {"L": Md(layer_ev)}  # forward_context.attn_metadata: dict by layer name
    event, owned, source = acquire_release(ledger, "L", forward_md)
    assert (event, owned, source) == (layer_ev, False, EventSource.LAYER)
    assert "L" not in table, "the table entry must be consumed even when not used"
    # direct attribute (the per-layer object vLLM passes to save_kv_layer)
    table["L"] = table_ev
    assert acquire_release(ledger, "L", Md(direct_ev)) == (direct_ev, False, EventSource.DIRECT)
    # list of dicts (ubatching): element 0
    assert acquire_release(ledger, "L", [{"L": Md(layer_ev)}])[2] == EventSource.LAYER
    # table only
    table["L"] = table_ev
    assert acquire_release(ledger, "L", Md()) == (table_ev, False, EventSource.KV_READY_TABLE)
    counts = dict(zip(EVENT_SOURCE_NAMES, ledger.metrics.event_sources, strict=True))
    assert counts["reshape_cache_layer"] == 2
    assert counts["reshape_cache_direct"] == 1
    assert counts["kv_ready_table"] == 1


def test_dict_metadata_without_the_layer_falls_through_to_the_table(table) -> None:
    table["L"] = ev = CpuEvent(9)
    ledger = ledger_for(table)
    assert acquire_release(ledger, "L", {"other": Md(CpuEvent(1))}) == (
        ev,
        False,
        EventSource.KV_READY_TABLE,
    )


def test_stale_table_event_is_never_reused_next_step(table) -> None:
    table["L"] = CpuEvent(5)
    ledger = ledger_for(table)
    assert acquire_release(ledger, "L", None)[2] == EventSource.KV_READY_TABLE
    # next step: the KV-write patch did not publish for L -> own a fresh event
    event, owned, source = acquire_release(ledger, "L", None)
    assert owned and source == EventSource.CURRENT_STREAM
    assert event.handle != 5


def test_default_table_is_the_layerwise_one() -> None:
    layerwise.kv_ready_events["model.layers.0.attn"] = ev = CpuEvent(7)
    try:
        ledger = EventLedger(CpuDevice(), DumpMetrics())
        assert ledger.acquire("model.layers.0.attn", None)[:2] == (ev, False)
        assert "model.layers.0.attn" not in layerwise.kv_ready_events
    finally:
        layerwise.kv_ready_events.pop("model.layers.0.attn", None)


def test_current_stream_then_device_sync_fallbacks(table) -> None:
    ledger = ledger_for(table)
    event, owned, source = ledger.acquire("L", None)
    assert owned and source == EventSource.CURRENT_STREAM and isinstance(event, CpuEvent)
    assert ledger.live() == (1, 0)
    ledger.release(event, owned)
    assert ledger.live() == (0, 0)

    broken = ledger_for(table, NoRecordDevice())
    assert broken.acquire("L", None) == (None, False, EventSource.DEVICE_SYNC)
    assert broken.metrics.event_record_failed == 1
    assert broken.metrics.event_sources[EventSource.DEVICE_SYNC] == 1
    assert broken.device.pooled == 1, "the event whose record failed went back to the pool"
    # Second time through the pooled (inlined) path: same fallback, nothing leaked.
    assert broken.acquire("L", None) == (None, False, EventSource.DEVICE_SYNC)
    assert broken.metrics.event_record_failed == 2
    assert broken.device.pooled == broken.device.created == 1
    assert broken.live() == (0, 0)


def test_expected_but_missing_is_counted_only_when_kv_ready_was_expected(table) -> None:
    expecting = ledger_for(table, expect_kv_ready=True)
    acquire_release(expecting, "L", Md(CpuEvent(1)))
    assert expecting.metrics.event_expected_missing == 0
    acquire_release(expecting, "L", None)
    acquire_release(ledger_for(table, NoRecordDevice(), expect_kv_ready=True), "L", None)
    assert expecting.metrics.event_expected_missing == 1
    relaxed = ledger_for(table)
    acquire_release(relaxed, "L", None)
    assert relaxed.metrics.event_expected_missing == 0


def test_handle_extraction_failure_is_counted_and_falls_back(table) -> None:
    ledger = ledger_for(table, need_handle=True)
    no_handle = CpuEvent(0)  # handle 0: unusable for a C++ store
    table["L"] = good = CpuEvent(4)
    assert acquire_release(ledger, "L", Md(no_handle)) == (good, False, EventSource.KV_READY_TABLE)
    assert ledger.metrics.event_handle_failed == 1
    # a borrowed object that is not an event at all (AttributeError path)
    assert acquire_release(ledger, "L", Md(object()))[2] == EventSource.CURRENT_STREAM
    assert ledger.metrics.event_handle_failed == 2


def test_owned_event_without_handle_is_released_and_sync_used(table) -> None:
    class ZeroHandleDevice(CpuDevice):
        def _new_event(self) -> CpuEvent:
            return CpuEvent(0)

    ledger = ledger_for(table, ZeroHandleDevice(), need_handle=True)
    assert ledger.acquire("L", None) == (None, False, EventSource.DEVICE_SYNC)
    assert ledger.metrics.event_handle_failed == 1
    assert ledger.device.pooled == ledger.device.created == 1
    assert ledger.live() == (0, 0)


# ---------------------------------------------------------------------------------------
# Ownership: borrowed never destroyed, owned always pooled back; thread safety
# ---------------------------------------------------------------------------------------


class CountingDevice(CpuDevice):
    def __init__(self, pool_size: int = 256) -> None:
        super().__init__(pool_size)
        self.given_back: list[Any] = []
        self.destroyed_events: list[Any] = []

    def release(self, event: Any) -> None:
        self.given_back.append(event)
        super().release(event)

    def _destroy_event(self, event: Any) -> None:
        self.destroyed_events.append(event)


def test_borrowed_events_are_dropped_never_given_to_the_device(table) -> None:
    device = CountingDevice()
    ledger = ledger_for(table, device)
    borrowed = CpuEvent(11)
    for _ in range(3):
        acquire_release(ledger, "L", Md(borrowed))
    assert device.given_back == []
    assert ledger.live() == (0, 0)


def test_pool_is_bounded_and_close_destroys_pooled_events() -> None:
    device = CountingDevice(pool_size=2)
    events = [device.record_event() for _ in range(3)]
    assert device.created == 3
    for ev in events:
        device.release(ev)
    assert device.pooled == 2 and device.destroyed_events == [events[2]]
    assert device.record_event() is events[1], "pooled events are reused (no allocation)"
    device.close()
    assert device.pooled == 0 and device.destroyed == 2
    with pytest.raises(ValueError, match="pool_size"):
        CpuDevice(pool_size=-1)


def test_concurrent_acquire_release_keeps_counts_exact(table) -> None:
    ledger = ledger_for(table)
    borrowed = Md(CpuEvent(3))
    per_thread = 3000
    start = threading.Barrier(4)

    def run(i: int) -> None:
        start.wait()
        for n in range(per_thread):
            event, owned, _ = ledger.acquire(f"L{i}", borrowed if n % 2 else None)
            ledger.release(event, owned)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.live() == (0, 0)
    assert sum(ledger.metrics.event_sources) == 4 * per_thread
    assert ledger.device.pooled == ledger.device.created


def test_fake_event_blocks_until_set_and_can_fail() -> None:
    ev = FakeEvent()
    done = threading.Event()
    t = threading.Thread(target=lambda: (ev.synchronize(), done.set()))
    t.start()
    assert not done.wait(0.05) and not ev.query()
    ev.set()
    assert done.wait(2.0) and ev.query()
    t.join()
    bad = FakeEvent()
    bad.fail("xid 79")
    with pytest.raises(RuntimeError, match="xid 79"):
        bad.synchronize()


def test_cpu_raw_handle_rejects_zero() -> None:
    with pytest.raises(EventHandleError, match="handle=0"):
        CpuDevice().raw_handle(CpuEvent(0))


def test_hooks_modules_import_neither_torch_nor_vllm() -> None:
    """Binding is lazy: importing the scheduler stack must not pull torch or vLLM in."""
    code = (
        "import sys\n"
        "import ucm_patch.hooks.dump, ucm_patch.connector.rows, ucm_patch.hooks.device_npu\n"
        "bad = sorted(m for m in ('torch', 'vllm', 'torch_npu', 'acl', 'prometheus_client')"
        " if m in sys.modules)\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_make_device_by_kind() -> None:
    assert isinstance(make_device("cpu"), CpuDevice)
    with pytest.raises(ValueError, match="'tpu'"):
        make_device("tpu")


# ---------------------------------------------------------------------------------------
# NPU module with stand-in torch_npu / acl (no Ascend hardware here)
# ---------------------------------------------------------------------------------------


class FakeAcl:
    """``acl.rt`` stand-in recording calls; ``fail_record`` makes record_event return 507."""

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.calls: list[str] = []
        self.fail_record = False
        self.syncs: list[int] = []  # torch.npu.synchronize(device) calls
        self._next = 0x1000
        self.rt = types.SimpleNamespace(
            create_event=self.create_event,
            record_event=self.record_event,
            query_event_status=lambda h: (1, 0),
            synchronize_event=lambda h: 0,
            destroy_event=self.destroy_event,
        )

    def create_event(self) -> tuple[int, int]:
        self._next += 8
        self.live.add(self._next)
        self.calls.append("create")
        return self._next, 0

    def record_event(self, handle: int, stream: int) -> int:
        self.calls.append(f"record@{stream:#x}")
        return 507 if self.fail_record else 0

    def destroy_event(self, handle: int) -> int:
        self.calls.append("destroy")
        self.live.discard(handle)
        return 0


class FakeNpuEvent:
    """torch_npu's ``torch.npu.Event`` shape; handle via ``npu_event``."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.npu_event = 0

    def record(self, stream: Any = None) -> None:
        self.npu_event = 0xBEEF

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


@pytest.fixture
def npu_stubs(monkeypatch: pytest.MonkeyPatch) -> FakeAcl:
    import torch

    acl = FakeAcl()
    stream = types.SimpleNamespace(npu_stream=0x77)
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.npu = types.SimpleNamespace(current_stream=lambda: stream)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    acl_mod = types.ModuleType("acl")
    acl_mod.rt = acl.rt  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "acl", acl_mod)
    syncs = acl.syncs
    monkeypatch.setattr(
        torch,
        "npu",
        types.SimpleNamespace(
            Event=FakeNpuEvent, synchronize=syncs.append, current_device=lambda: 3
        ),
        raising=False,
    )
    return acl


def test_npu_acl_events_are_recorded_on_the_current_stream_and_destroyed(npu_stubs) -> None:
    from ucm_patch.hooks.device_npu import AclEvent, NpuDevice

    device = NpuDevice(pool_size=1, backend="acl")
    assert isinstance(make_device("npu"), NpuDevice)
    ledger = EventLedger(device, DumpMetrics(), need_handle=True, kv_ready_table={})
    ev1, owned, source = ledger.acquire("L", None)
    ev2, _, _ = ledger.acquire("L", None)
    assert type(ev1) is AclEvent and owned and source == EventSource.CURRENT_STREAM
    assert "record@0x77" in npu_stubs.calls
    assert device.raw_handle(ev1) == ev1.handle != 0
    ledger.release(ev1, True)
    ledger.release(ev2, True)  # pool_size 1: this one is destroyed via acl
    assert npu_stubs.calls.count("destroy") == 1
    device.close()
    assert npu_stubs.live == set(), "every ACL event destroyed"
    assert ledger.live() == (0, 0)


def test_npu_failed_record_destroys_the_event_and_falls_back_to_sync(npu_stubs) -> None:
    from ucm_patch.hooks.device_npu import NpuDevice, NpuEventError

    device = NpuDevice(backend="acl")
    npu_stubs.fail_record = True
    with pytest.raises(NpuEventError, match="record_event failed with ret=507"):
        device.record_event()
    assert npu_stubs.live == set() and device.pooled == 0, "the #982 leak"
    ledger = EventLedger(device, DumpMetrics(), kv_ready_table={})
    assert ledger.acquire("L", None) == (None, False, EventSource.DEVICE_SYNC)
    assert ledger.metrics.event_record_failed == 1
    assert npu_stubs.live == set()


def test_npu_torch_backend_handles(npu_stubs) -> None:
    from ucm_patch.hooks.device_npu import NpuDevice

    device = NpuDevice()
    ev = device.record_event()
    assert device.raw_handle(ev) == 0xBEEF
    device.synchronize()  # the device captured at construction, not the thread's default
    assert npu_stubs.syncs == [3]
    with pytest.raises(EventHandleError):
        device.raw_handle(FakeNpuEvent())  # never recorded: handle 0
    with pytest.raises(ValueError, match="backend"):
        NpuDevice(backend="hccl")


# ---------------------------------------------------------------------------------------
# Prometheus export
# ---------------------------------------------------------------------------------------


def test_prometheus_export_reads_the_plain_counters() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    metrics = DumpMetrics()
    ledger = EventLedger(CpuDevice(), metrics, kv_ready_table={})
    held = ledger.acquire("L", None)
    metrics.dumps_submitted = 7
    metrics.event_expected_missing = 2
    metrics.request_wait.observe(0.003)
    registry = CollectorRegistry()
    assert export(metrics, registry=registry)
    text = generate_latest(registry).decode()
    assert "ucm_patch_dumps_submitted_total 7.0" in text
    assert "ucm_patch_dump_event_expected_missing_total 2.0" in text
    assert 'ucm_patch_dump_event_source_total{source="current_stream"} 1.0' in text
    assert 'ucm_patch_dump_live_event_handles{ownership="owned"} 1.0' in text
    assert 'ucm_patch_request_dump_wait_seconds_bucket{le="0.005"} 1.0' in text
    assert 'ucm_patch_request_dump_wait_seconds_bucket{le="0.0025"} 0.0' in text
    ledger.release(held[0], held[1])
    assert 'ucm_patch_dump_live_event_handles{ownership="owned"} 0.0' in (
        generate_latest(registry).decode()
    )
