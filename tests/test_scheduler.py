"""DumpScheduler behaviour against a controllable fake store (no timing budgets here).

Each test proves one promise of the dump scheduler; the review comments of UCM #989 /
#1025 are the failure modes they guard against (leaked handles, unbounded sets, blocking saves).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import pytest

from tests.support.fakes_store import FakeStore
from tests.support.one_client import OneClientScheduler
from ucm_patch.hooks.device import CpuDevice, FakeEvent
from ucm_patch.hooks.dump import (
    DumpClient,
    DumpScheduler,
    FinishedDumps,
    get_scheduler,
    reset_scheduler,
)
from ucm_patch.hooks.events import EventSource

ZERO_SIZES = {
    "requests": 0,
    "ready": 0,
    "finished_waiting": 0,
    "batches": 0,
    "slots_in_use": 0,
    "queued": 0,
    "unretired": 0,
    "waiters": 0,
    "live_owned_handles": 0,
    "live_borrowed_handles": 0,
}


def wait_until(pred: Callable[[], object], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.002)
    return bool(pred())


def settled(sched: DumpScheduler) -> bool:
    """All submitted dumps finished and retired (poll() does the retiring)."""
    sched.poll()
    return sched.metrics.queue_depth == 0


def metric(sched: DumpScheduler, name: str) -> int:
    sched.poll()
    return getattr(sched.metrics, name)


def finish(
    sched: DumpScheduler | DumpClient, ids: Iterable[str], timeout: float = 10.0
) -> FinishedDumps:
    """Pass ``ids`` to get_finished once, then poll until all of them were reported."""
    ids = set(ids)
    done = sched.get_finished(ids)
    sending, failed = set(done.sending), set(done.failed)
    deadline = time.monotonic() + timeout
    while not ids <= sending and time.monotonic() < deadline:
        time.sleep(0.002)
        done = sched.get_finished(())
        assert not (done.sending & sending), "a request was reported twice"
        sending |= done.sending
        failed |= done.failed
    return FinishedDumps(sending, failed)


@pytest.fixture
def make_sched() -> Iterator[Callable[..., DumpScheduler]]:
    made: list[DumpScheduler] = []

    def make(**kw: object) -> DumpScheduler:
        kw.setdefault("device", CpuDevice())
        kw.setdefault("workers", 2)
        sched = OneClientScheduler(**kw)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.shutdown(timeout=2.0)


def host(n: int, tag: str = "v") -> list[bytes]:
    return [f"{tag}{i}".encode() * 8 for i in range(n)]


# ---------------------------------------------------------------------------------------
# The forward side never waits on the store
# ---------------------------------------------------------------------------------------


def test_save_side_returns_while_store_is_busy(make_sched) -> None:
    store = FakeStore()
    store.hold()
    sched = make_sched()
    returned = threading.Event()
    results: list[bool] = []

    def forward_step() -> None:
        batch = sched.open_batch(["r1"], store)
        for layer in range(8):
            results.append(
                sched.submit_layer(
                    batch, f"model.layers.{layer}.attn", None, layer, [f"r1/{layer}"], host(1)
                )
            )
        sched.seal(batch)  # wait_for_save side
        sched.get_finished(["r1"])  # get_finished side, non-blocking default
        returned.set()

    thread = threading.Thread(target=forward_step)
    thread.start()
    assert returned.wait(5.0), "save side blocked on a store that is still busy"
    assert store.wait_busy(1)
    assert results == [True] * 8
    assert store.data == {}, "nothing can be stored while the store is held"
    assert sched.get_finished(()).sending == set()
    store.release()
    assert finish(sched, ["r1"]).sending == {"r1"}
    assert len(store.data) == 8
    thread.join()
    assert sched.internal_sizes() == ZERO_SIZES


def test_finished_sending_only_after_the_last_dump(make_sched) -> None:
    store = FakeStore()
    store.hold(lambda key: key == "r/2")
    sched = make_sched()
    batch = sched.open_batch(["r"], store)
    for row in range(3):
        sched.submit(batch, row, [f"r/{row}"], host(1))
    sched.seal(batch)
    assert wait_until(lambda: {"r/0", "r/1"} <= store.data.keys())
    assert sched.get_finished(["r"]).sending == set()
    assert sched.get_finished(()).sending == set()
    assert sched.needs_delayed_free("r")
    assert sched.has_pending()
    store.release()
    got: set[str] = set()
    while not got:
        got = sched.get_finished(()).sending
        if got:
            assert "r/2" in store.data, "reported before its last dump was stored"
    assert got == {"r"}
    assert sched.get_finished(["r"]).sending == set(), "reported twice"
    assert not sched.has_pending()
    assert sched.internal_sizes() == ZERO_SIZES


def test_request_spanning_steps_waits_for_every_batch(make_sched) -> None:
    store = FakeStore()
    sched = make_sched()
    ev1, ev2 = FakeEvent(), FakeEvent()
    for key, ev in (("step1", ev1), ("step2", ev2)):
        batch = sched.open_batch(["r"], store)
        sched.submit(batch, 0, [key], host(1), event=ev)
        sched.seal(batch)
    assert sched.get_finished(["r"]).sending == set()
    ev1.set()
    assert wait_until(lambda: metric(sched, "dumps_completed") == 1)
    assert sched.get_finished(()).sending == set(), "reported while step 2's dump runs"
    ev2.set()
    assert finish(sched, ["r"]) == ({"r"}, set())
    assert sched.internal_sizes() == ZERO_SIZES


def test_worker_without_dumps_still_reports_the_request(make_sched) -> None:
    """A TP rank that dumps nothing opens and seals an empty batch: vLLM waits for it too."""
    sched = make_sched()
    batch = sched.open_batch(["mla-req"], FakeStore())
    assert sched.needs_delayed_free("mla-req")
    sched.seal(batch)
    assert sched.get_finished(["mla-req"]) == ({"mla-req"}, set())
    assert sched.internal_sizes() == ZERO_SIZES


def test_request_with_finished_dumps_is_reported_in_the_same_call(make_sched) -> None:
    store = FakeStore()
    sched = make_sched()
    batch = sched.open_batch(["a", "b"], store)
    sched.submit(batch, 0, ["k"], host(1))
    sched.seal(batch)
    assert wait_until(lambda: metric(sched, "dumps_completed") == 1)
    done = sched.get_finished(["a", "unknown"])
    assert done.sending == {"a"}, "unknown ids are ignored, done ones reported at once"
    assert done.failed == set()
    assert sched.get_finished(["b"]).sending == {"b"}
    assert sched.internal_sizes() == ZERO_SIZES


def test_blocking_finish_waits_inside_get_finished(make_sched) -> None:
    """Opt-in UCM #989 behaviour: get_finished waits for the finished requests' dumps."""
    store = FakeStore()
    store.hold(lambda key: key.startswith("a/"))
    sched = make_sched(blocking_finish=True)
    batch_a = sched.open_batch(["a"], store)
    sched.submit(batch_a, 0, ["a/0"], host(1))
    sched.seal(batch_a)
    batch_b = sched.open_batch(["b"], store)
    sched.submit(batch_b, 0, ["b/0"], host(1))
    sched.seal(batch_b)
    assert wait_until(lambda: "b/0" in store.data)
    # b is done: reported without waiting for a.
    assert sched.get_finished(["b"]).sending == {"b"}
    out: list[set[str]] = []
    thread = threading.Thread(target=lambda: out.append(sched.get_finished(["a"]).sending))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive(), "blocking mode returned before a's dump finished"
    store.release()
    thread.join(5.0)
    assert out == [{"a"}]
    assert "a/0" in store.data
    assert sched.internal_sizes() == ZERO_SIZES


# ---------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------


def test_preemption_waits_for_the_preempted_requests_dumps_only(make_sched) -> None:
    store = FakeStore()
    sched = make_sched(workers=2)
    ev_a, ev_b = FakeEvent(), FakeEvent()
    batch_a = sched.open_batch(["A"], store)
    sched.submit(batch_a, 0, ["A/0"], host(1), event=ev_a)
    sched.seal(batch_a)
    batch_b = sched.open_batch(["B"], store)
    sched.submit(batch_b, 0, ["B/0"], host(1), event=ev_b)
    sched.seal(batch_b)
    assert wait_until(lambda: ev_a.waiters == 1 and ev_b.waiters == 1)

    returned: list[bool] = []
    thread = threading.Thread(target=lambda: returned.append(sched.handle_preemptions(["B"])))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive(), "handle_preemptions returned before B's dump finished"
    ev_b.set()
    thread.join(5.0)
    assert returned == [True]
    assert "B/0" in store.data
    # A's dump is still blocked: preemption of B did not wait for it.
    assert "A/0" not in store.data
    assert sched.needs_delayed_free("A")
    assert not sched.needs_delayed_free("B"), "preempted request must leave every map"
    assert sched.internal_sizes()["requests"] == 1
    assert sched.get_finished(["B"]).sending == set(), "a preempted request is not reported"
    ev_a.set()
    assert finish(sched, ["A"]) == ({"A"}, set())
    assert sched.metrics.preempt_wait.count == 1
    assert sched.internal_sizes() == ZERO_SIZES


def test_preempted_id_resumed_later_is_not_confused_with_its_old_dumps(make_sched) -> None:
    """Request-id ABA (vLLM #51637): an old batch finishing must not complete the new one."""
    store = FakeStore()
    sched = make_sched(workers=2)
    old_event = FakeEvent()
    old = sched.open_batch(["R"], store)
    sched.submit(old, 0, ["old"], host(1), event=old_event)
    # Preempted while its (unsealed) batch still has a running dump, with a timeout.
    assert sched.handle_preemptions(["R"], timeout=0.05) is False
    new_event = FakeEvent()
    new = sched.open_batch(["R"], store)
    sched.submit(new, 0, ["new"], host(1), event=new_event)
    sched.seal(new)
    sched.seal(old)
    old_event.fail("the old incarnation's dump failed")
    assert wait_until(lambda: metric(sched, "dumps_failed") == 1)  # bookkeeping done
    assert sched.get_finished(["R"]).sending == set(), "old dump completed the new incarnation"
    new_event.set()
    assert finish(sched, ["R"]) == ({"R"}, set()), "old failure leaked into the new incarnation"
    assert "new" in store.data
    assert sched.internal_sizes() == ZERO_SIZES


# ---------------------------------------------------------------------------------------
# Back-pressure
# ---------------------------------------------------------------------------------------


def test_queue_full_skips_and_marks_the_request_failed(make_sched) -> None:
    store = FakeStore()
    store.hold()
    sched = make_sched(workers=1, capacity=2, on_full="skip")
    batch = sched.open_batch(["r"], store)
    assert sched.submit_layer(batch, "l0", None, 0, ["k0"], host(1))
    assert sched.submit_layer(batch, "l1", None, 1, ["k1"], host(1))
    t0 = time.perf_counter()
    assert sched.submit_layer(batch, "l2", None, 2, ["k2"], host(1)) is False
    assert time.perf_counter() - t0 < 0.5, "skip policy must not block"
    assert sched.metrics.dumps_skipped == 1
    assert sched.internal_sizes()["live_owned_handles"] == 2, "skipped dump's event released"
    sched.seal(batch)
    store.release()
    done = finish(sched, ["r"])
    assert done.sending == {"r"}
    assert done.failed == {"r"}, "a request with a skipped dump must not be claimed as stored"
    assert "k2" not in store.data
    assert sched.metrics.requests_failed == 1
    assert sched.internal_sizes() == ZERO_SIZES


def test_queue_full_wait_policy_is_bounded(make_sched) -> None:
    store = FakeStore()
    store.hold()
    sched = make_sched(workers=1, capacity=1, on_full="wait", full_wait_s=0.2)
    batch = sched.open_batch(["r"], store)
    assert sched.submit(batch, 0, ["k0"], host(1))
    t0 = time.perf_counter()
    assert sched.submit(batch, 1, ["k1"], host(1)) is False
    waited = time.perf_counter() - t0
    assert 0.15 <= waited < 2.0, f"bounded wait expected ~0.2 s, waited {waited:.3f} s"
    # A slot that frees within the wait is taken.
    timer = threading.Timer(0.05, store.release)
    timer.start()
    assert sched.submit(batch, 2, ["k2"], host(1)) is True
    timer.join()
    sched.seal(batch)
    assert finish(sched, ["r"]) == ({"r"}, {"r"})
    assert sched.metrics.dumps_skipped == 1
    assert sched.internal_sizes() == ZERO_SIZES


# ---------------------------------------------------------------------------------------
# Failures and payloads
# ---------------------------------------------------------------------------------------


def test_store_error_and_store_full_fail_the_request(make_sched) -> None:
    store = FakeStore(capacity_items=2)
    store.fail_keys = {"a"}  # a put with this key raises, whatever else it holds
    sched = make_sched(workers=1)
    batch = sched.open_batch(["r"], store)
    sched.submit_layer(batch, "l0", None, 0, ["a"], host(1))  # StoreError
    sched.submit_layer(batch, "l1", None, 1, ["b", "c"], host(2))  # stored
    sched.submit_layer(batch, "l2", None, 2, ["d"], host(1))  # store full -> False flag
    sched.seal(batch)
    assert wait_until(lambda: settled(sched))
    done = sched.get_finished(["r"])
    assert done.sending == {"r"} and done.failed == {"r"}
    m = sched.metrics
    assert (m.dumps_completed, m.dumps_failed, m.dumps_store_full) == (1, 2, 1)
    assert m.bytes_written == sum(len(v) for v in host(2))
    assert sched.internal_sizes() == ZERO_SIZES


def test_rows_queued_behind_a_busy_worker_are_put_together(make_sched) -> None:
    """A worker that fell behind (here: its put held; beside vLLM's forward, a wait for
    the GIL) takes the rows queued meanwhile in one put_many, and each row still gets
    its own status: stored, or store full where the store refused its values."""
    store = FakeStore(capacity_items=9)
    sched = make_sched(workers=1)
    store.hold(lambda key: key == "first")
    batch = sched.open_batch(["r"], store)
    sched.submit_layer(batch, "l0", None, 0, ["first"], host(1))
    assert store.wait_busy(1)
    for i in range(1, 11):
        sched.submit_layer(batch, f"l{i}", None, i, [f"k{i}"], host(1))
    store.release()
    sched.seal(batch)
    assert wait_until(lambda: settled(sched))
    assert store.put_log == [("first",), tuple(f"k{i}" for i in range(1, 11))]
    m = sched.metrics
    assert (m.dumps_completed, m.dumps_store_full, m.dumps_failed) == (9, 2, 2)
    assert m.bytes_written == 9 * len(host(1)[0])
    assert sched.get_finished(["r"]).failed == {"r"}
    assert sched.internal_sizes() == ZERO_SIZES


def test_a_worker_takes_every_row_queued_while_the_others_are_busy(make_sched) -> None:
    """The share a worker takes is of the workers free now: with the other worker busy
    (its put held), the rows queued meanwhile go in one put, not half of them with the
    rest in a second put behind it."""
    held_a, held_b, rows = FakeStore(), FakeStore(), FakeStore()
    sched = make_sched(workers=2)
    held_a.hold()
    held_b.hold()
    a = sched.open_batch(["a"], held_a)
    b = sched.open_batch(["b"], held_b)
    sched.submit_layer(a, "l0", None, 0, ["a0"], host(1))
    assert held_a.wait_busy(1)
    sched.submit_layer(b, "l0", None, 0, ["b0"], host(1))
    assert held_b.wait_busy(1)  # both workers at work
    batch = sched.open_batch(["r"], rows)
    keys = [f"k{i}" for i in range(6)]
    for i, key in enumerate(keys):
        sched.submit_layer(batch, f"l{i}", None, i, [key], host(1))
    held_b.release()  # one worker free, the other still busy: it takes all six
    assert wait_until(lambda: len(rows.data) == len(keys))
    held_a.release()
    for batch_ in (a, b, batch):
        sched.seal(batch_)
    assert wait_until(lambda: settled(sched))
    assert rows.put_log == [tuple(keys)]


def test_payload_callable_runs_after_the_event(make_sched) -> None:
    store = FakeStore()
    sched = make_sched(workers=1)
    event = FakeEvent()
    seen: list[bool] = []

    def produce(task) -> tuple[list[str], list[bytes]]:
        seen.append(event.query())
        return [f"row{task.row}/{rid}" for rid in task.batch.req_ids], host(2)

    batch = sched.open_batch(["x", "y"], store, context={"block_ids": [1, 2]})
    sched.submit(batch, 5, None, produce, event=event)
    sched.seal(batch)
    time.sleep(0.05)
    assert seen == [], "payload produced before its event completed"
    event.set()
    assert finish(sched, ["x", "y"]) == ({"x", "y"}, set())
    assert seen == [True]
    assert set(store.data) == {"row5/x", "row5/y"}
    assert sched.metrics.event_sources[EventSource.EXTERNAL] == 1
    assert sched.internal_sizes() == ZERO_SIZES


def test_dump_time_is_split_into_event_wait_copy_and_put(make_sched) -> None:
    """A dump's duration = its wait for the KV-ready event + its payload callable (the
    connector's device copy) + the store's put: each part is counted, so make gpu-check
    can set the dump path's own seconds against KV production."""
    store = FakeStore(latency_s=0.05)
    sched = make_sched(workers=1)
    event = FakeEvent()

    def produce(task) -> tuple[list[str], list[bytes]]:
        time.sleep(0.1)
        return ["k"], host(1)

    batch = sched.open_batch(["r"], store)
    sched.submit(batch, 0, None, produce, event=event)
    sched.seal(batch)
    time.sleep(0.2)
    event.set()
    assert finish(sched, ["r"]) == ({"r"}, set())
    m = sched.metrics
    wait, copy = m.dump_event_wait_s, m.dump_produce_s
    put = m.dump_duration.total - wait - copy
    assert wait >= 0.15 and 0.1 <= copy < wait and put >= 0.05, (wait, copy, put)
    snap = m.snapshot()
    assert snap["dump_event_wait_s"] == wait and snap["dump_produce_s"] == copy


def test_busy_time_is_wall_time_with_any_worker_at_work(make_sched) -> None:
    """dump_busy_s: the wall seconds with at least one worker past its event wait. Two
    workers copying at once count once (the per-worker sums count both); the time no
    worker works (all waiting for events, or idle) is not counted."""
    sched = make_sched(workers=2)
    store = FakeStore(latency_s=0.2)
    batch = sched.open_batch(["a", "b"], store)
    sched.submit(batch, 0, ["a"], host(1))
    sched.submit(batch, 1, ["b"], host(1))
    sched.seal(batch)
    assert finish(sched, ["a", "b"]) == ({"a", "b"}, set())
    m = sched.metrics
    work = m.dump_duration.total - m.dump_event_wait_s
    assert work >= 0.4 and 0.2 <= m.dump_busy_s < 0.3, (work, m.dump_busy_s)
    time.sleep(0.2)  # idle: not busy
    event = FakeEvent()
    batch = sched.open_batch(["c"], store)
    sched.submit(batch, 2, ["c"], host(1), event=event)
    sched.seal(batch)
    time.sleep(0.2)  # waiting for the event: not busy
    event.set()
    assert finish(sched, ["c"]) == ({"c"}, set())
    assert 0.4 <= m.dump_busy_s < 0.55, m.dump_busy_s
    assert m.snapshot()["dump_busy_s"] == m.dump_busy_s


def test_bad_payload_and_buggy_callable_fail_the_dump_not_the_worker(make_sched) -> None:
    store = FakeStore()
    sched = make_sched(workers=1)

    def buggy(task) -> list[bytes]:
        raise KeyError("connector bug")

    batch = sched.open_batch(["r"], store)
    sched.submit(batch, 0, ["a", "b"], host(1))  # 2 keys, 1 value: ValueError
    sched.submit(batch, 1, ["c"], buggy)  # unexpected exception at the thread boundary
    sched.submit(batch, 2, ["d"], host(1))  # the worker survived
    sched.seal(batch)
    assert wait_until(lambda: settled(sched))
    m = sched.metrics
    assert (m.dumps_failed, m.dumps_completed, m.worker_errors) == (2, 1, 1)
    assert "KeyError" in sched.last_errors[-1]
    assert set(store.data) == {"d"}
    assert sched.get_finished(["r"]).failed == {"r"}
    assert sched.internal_sizes() == ZERO_SIZES


def test_device_error_on_the_event_fails_the_dump(make_sched) -> None:
    store = FakeStore()
    sched = make_sched(workers=1)
    event = FakeEvent()
    batch = sched.open_batch(["r"], store)
    sched.submit(batch, 0, ["k"], host(1), event=event)
    sched.seal(batch)
    event.fail("device lost")
    assert wait_until(lambda: metric(sched, "dumps_failed") == 1)
    assert store.data == {}
    assert sched.get_finished(["r"]).failed == {"r"}
    assert sched.internal_sizes() == ZERO_SIZES


# ---------------------------------------------------------------------------------------
# Event handles: released on every path, borrowed never destroyed
# ---------------------------------------------------------------------------------------


class TrackingDevice(CpuDevice):
    """CpuDevice recording every event given back to it."""

    def __init__(self) -> None:
        super().__init__(pool_size=1024)
        self.released: list[object] = []

    def release(self, event: object) -> None:
        self.released.append(event)
        super().release(event)


def test_owned_events_released_on_every_path_borrowed_never(make_sched) -> None:
    device = TrackingDevice()
    store = FakeStore()
    store.fail_keys = {"e"}  # a put with this key raises, whatever else it holds
    sched = make_sched(device=device, workers=1, capacity=3)
    borrowed = FakeEvent()
    borrowed.set()
    batch = sched.open_batch(["r"], store)
    # store error path, success path, borrowed (never given to the device)
    sched.submit_layer(batch, "l0", None, 0, ["e"], host(1))
    sched.submit_layer(batch, "l1", None, 1, ["s"], host(1))
    sched.submit(batch, 2, ["b"], host(1), event=borrowed, owned=False)
    assert wait_until(lambda: settled(sched))
    # submission error paths: non-Batch and sealed batch raise, event still released
    ev, owned, src = sched.events.record()
    assert owned and src == EventSource.CURRENT_STREAM
    with pytest.raises(TypeError, match="open_batch"):
        sched.submit(object(), 0, ["x"], host(1), ev, owned, src)  # type: ignore[arg-type]
    sched.seal(batch)
    with pytest.raises(RuntimeError, match="sealed"):
        sched.submit_layer(batch, "l3", None, 3, ["y"], host(1))
    # skip path
    store.hold()
    batch2 = sched.open_batch(["q"], store)
    for i in range(3):
        assert sched.submit_layer(batch2, f"m{i}", None, i, [f"q{i}"], host(1))
    assert sched.submit_layer(batch2, "m3", None, 3, ["q3"], host(1)) is False
    sched.seal(batch2)
    store.release()
    assert wait_until(lambda: settled(sched))
    assert sched.internal_sizes()["live_owned_handles"] == 0
    assert sched.internal_sizes()["live_borrowed_handles"] == 0
    assert borrowed not in device.released, "a borrowed event was given to the device"
    # 2 + 3 queued owned, 1 own_new (TypeError), 1 sealed, 1 skipped
    assert len(device.released) == 8
    assert len({id(e) for e in device.released}) == device.created
    assert device.pooled == device.created
    assert finish(sched, ["r", "q"]) == ({"r", "q"}, {"r", "q"})
    assert sched.internal_sizes() == ZERO_SIZES


def test_shutdown_cancels_queued_dumps_and_releases_their_events(make_sched) -> None:
    device = TrackingDevice()
    store = FakeStore()
    sched = make_sched(device=device, workers=1, capacity=8)
    blocker = FakeEvent()
    batch = sched.open_batch(["r"], store)
    sched.submit(batch, 0, ["first"], host(1), event=blocker)
    assert wait_until(lambda: blocker.waiters == 1)
    for i in range(5):
        sched.submit_layer(batch, f"l{i}", None, i, [f"k{i}"], host(1))
    assert sched.shutdown(timeout=0.2) is False, "the worker is stuck on the blocker"
    m = sched.metrics
    assert m.dumps_cancelled == 5
    assert sched.internal_sizes()["live_owned_handles"] == 0
    assert len(device.released) == 5
    assert device.pooled == 0 and device.destroyed == device.created == 5, "pool closed"
    assert sched.submit_layer(batch, "late", None, 9, ["late"], host(1)) is False
    assert device.destroyed == device.created, "an event released after close is destroyed"
    blocker.set()
    assert wait_until(lambda: settled(sched))
    assert sched.get_finished(["r"]) == ({"r"}, {"r"})
    assert sched.internal_sizes() == ZERO_SIZES
    with pytest.raises(RuntimeError, match="shut down"):
        sched.open_batch(["z"], store)


# ---------------------------------------------------------------------------------------
# Misc API contracts
# ---------------------------------------------------------------------------------------


def test_open_batch_rejects_a_tracked_finished_id(make_sched) -> None:
    store = FakeStore()
    store.hold()
    sched = make_sched(workers=1)
    batch = sched.open_batch(["r", "r"], store)  # duplicate ids collapse
    assert batch.req_ids == ("r",)
    sched.submit(batch, 0, ["k"], host(1))
    sched.seal(batch)
    sched.get_finished(["r"])
    with pytest.raises(ValueError, match="'r'"):
        sched.open_batch(["r"], store)
    store.release()
    assert finish(sched, ["r"]).sending == {"r"}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"workers": 0}, "workers"),
        ({"capacity": 0}, "capacity"),
        ({"on_full": "drop"}, "on_full"),
        ({"full_wait_s": -1}, "full_wait_s"),
        ({"poll_s": 0}, "poll_s"),
    ],
)
def test_bad_config_is_rejected_by_name(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DumpScheduler(CpuDevice(), **kw)


# ---------------------------------------------------------------------------------------
# The per-worker singleton
# ---------------------------------------------------------------------------------------


def test_get_scheduler_is_one_per_process_and_rejects_conflicts() -> None:
    reset_scheduler()
    try:
        device = CpuDevice()
        sched = get_scheduler(device=device, workers=1)
        assert get_scheduler() is sched
        assert get_scheduler(workers=1, device=device) is sched
        with pytest.raises(ValueError, match="workers=3"):
            get_scheduler(workers=3)
        with pytest.raises(TypeError, match="'turbo'"):
            get_scheduler(turbo=True)
        a, b = sched.client("a"), sched.client("b")
        store = FakeStore()
        for client in (a, b):  # the same request id in two connectors' id spaces
            batch = client.open_batch(["0"], store)
            client.submit(batch, 0, [f"{client.name}/0"], host(1))
            client.seal(batch)
        assert finish(a, ["0"]).sending == {"0"}
        assert b.needs_delayed_free("0")
        assert finish(b, ["0"]).sending == {"0"}
        b.close()
        with pytest.raises(RuntimeError, match="'b'"):
            b.open_batch(["1"], store)
        pid = os.fork()
        if pid == 0:  # child: threads did not survive the fork, so a fresh scheduler
            code = 1
            try:
                child = get_scheduler(device=CpuDevice(), workers=1).client("child")
                batch = child.open_batch(["c"], store)
                child.submit(batch, 0, ["child"], host(1))
                child.seal(batch)
                ok = child.scheduler is not sched and finish(child, ["c"]).sending == {"c"}
                code = 0 if ok else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "scheduler unusable after fork"
        assert get_scheduler() is sched
    finally:
        reset_scheduler()
    assert get_scheduler(device=CpuDevice()) is not sched
    reset_scheduler()
