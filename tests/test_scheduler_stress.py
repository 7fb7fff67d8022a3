"""Bounded state under churn, and concurrent connectors sharing one scheduler.

The UCM #989 review found ``_async_dump_req_ids`` growing forever and handles leaking on
error paths; these tests run thousands of requests through every path (finish, abort
mid-dump, preemption, resume after preemption, injected store errors, skipped dumps) and
then require every internal map to be empty and no event handle to be live.
"""

from __future__ import annotations

import random
import threading
import time

from tests.support.fakes_store import FakeStore
from tests.support.one_client import OneClientScheduler
from ucm_patch.hooks.device import CpuDevice, FakeEvent
from ucm_patch.hooks.dump import DumpScheduler

N_REQUESTS = 10_000
LAYERS = 4


class _Md:
    """Per-layer attention metadata carrying a borrowed KV-ready event."""

    __slots__ = ("reshape_cache_event",)

    def __init__(self, event: object) -> None:
        self.reshape_cache_event = event


def _drain(sched: DumpScheduler, expected: set[str], reported: list[str]) -> None:
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        reported.extend(sched.get_finished(()).sending)
        if set(reported) >= expected and sched.metrics.queue_depth == 0:
            reported.extend(sched.get_finished(()).sending)
            return
        time.sleep(0.002)


def test_10k_requests_with_aborts_preemptions_and_errors_leave_nothing_behind() -> None:
    rng = random.Random(1234)
    store = FakeStore(error_rate=0.03, seed=7)
    sched = OneClientScheduler(CpuDevice(), workers=2, capacity=64, on_full="skip")
    ready_event = FakeEvent()
    ready_event.set()
    md = _Md(ready_event)
    next_id = 0
    active: dict[str, int] = {}  # request id -> remaining steps
    preempted: list[str] = []
    finished: set[str] = set()
    gone: set[str] = set()  # preempted and never resumed
    reported: list[str] = []
    submits = 0
    step = 0
    t0 = time.perf_counter()
    while next_id < N_REQUESTS or active or preempted:
        step += 1
        # Admit new requests and resume some preempted ones (same id: ABA on purpose).
        for _ in range(min(12, N_REQUESTS - next_id)):
            active[f"req-{next_id}"] = rng.randint(1, 3)
            next_id += 1
        while preempted and (rng.random() < 0.5 or next_id >= N_REQUESTS):
            active[preempted.pop()] = rng.randint(1, 2)
        # Preempt a few before the step (handle_preemptions runs before the forward pass).
        victims = [rid for rid in active if rng.random() < 0.03]
        if victims:
            assert sched.handle_preemptions(victims, timeout=10.0)
            for rid in victims:
                del active[rid]
                preempted.append(rid)
        # The forward pass: one batch, a few layer dumps (owned or borrowed events).
        ids = list(active)
        batch = sched.open_batch(ids, store)
        for layer in range(LAYERS):
            keys = [f"{rid}/{step}/{layer}" for rid in ids]
            values = [b"x" * 16] * len(ids)
            meta = md if layer % 2 else None
            sched.submit_layer(batch, f"model.layers.{layer}.attn", meta, layer, keys, values)
            submits += 1
        sched.seal(batch)
        # Requests finishing this step; some "abort" early while their dumps still run.
        done_now = []
        for rid in ids:
            active[rid] -= 1
            if active[rid] <= 0 or rng.random() < 0.05:
                done_now.append(rid)
        for rid in done_now:
            del active[rid]
        finished.update(done_now)
        reported.extend(sched.get_finished(done_now).sending)
        # Occasionally drop a preempted request for good (it never comes back).
        if preempted and rng.random() < 0.2:
            gone.add(preempted.pop(0))
        if next_id >= N_REQUESTS and not active:
            gone.update(preempted)
            preempted.clear()

    _drain(sched, finished, reported)
    elapsed = time.perf_counter() - t0

    assert len(reported) == len(set(reported)), "a request was reported twice"
    assert set(reported) == finished, (
        f"missing {len(finished - set(reported))}, unexpected {len(set(reported) - finished)}"
    )
    assert not (set(reported) & gone)
    sizes = sched.internal_sizes()
    assert sizes == dict.fromkeys(sizes, 0), sizes
    m = sched.metrics
    assert m.dumps_submitted + m.dumps_skipped == submits
    assert m.dumps_submitted == m.dumps_completed + m.dumps_failed + m.dumps_cancelled
    assert m.dumps_failed > 0, "the test must inject store errors"
    assert m.requests_failed > 0
    assert sched.device.pooled == sched.device.created, "every owned event back in the pool"
    assert sched.shutdown(timeout=2.0)
    assert elapsed < 60, f"10k requests took {elapsed:.1f} s"


def test_two_threads_submitting_and_finishing_concurrently_lose_nothing() -> None:
    # A small pool and the bounded-wait policy: submitters block briefly for slots (both
    # threads contend on the same condition), and nothing may be skipped or lost.
    sched = DumpScheduler(CpuDevice(), workers=2, capacity=16, on_full="wait", full_wait_s=10.0)
    per_thread = 2_000
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def connector(tid: int) -> None:
        try:
            dumps = sched.client(f"connector-{tid}")  # what each connector instance does
            store = FakeStore()
            rng = random.Random(tid)
            reported: list[str] = []
            finished: set[str] = set()
            active: list[str] = []
            nid = 0
            start.wait()
            while nid < per_thread or active:
                while nid < per_thread and len(active) < 8:
                    active.append(f"req-{nid}")
                    nid += 1
                # Both threads use the same request ids: each client is its own id space.
                batch = dumps.open_batch(active, store)
                for layer in range(3):
                    keys = [f"{rid}/{layer}" for rid in active]
                    dumps.submit_layer(
                        batch, f"t{tid}.layers.{layer}", None, layer, keys, [b"v"] * len(keys)
                    )
                dumps.seal(batch)
                done = [rid for rid in active if rng.random() < 0.4]
                active = [rid for rid in active if rid not in done]
                finished.update(done)
                reported.extend(dumps.get_finished(done).sending)
            deadline = time.monotonic() + 30
            while set(reported) != finished and time.monotonic() < deadline:
                reported.extend(dumps.get_finished(()).sending)
                time.sleep(0.002)
            assert set(store.data) == {f"req-{i}/{x}" for i in range(per_thread) for x in range(3)}
            results[tid] = reported
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=connector, args=(tid,)) for tid in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    expected = {f"req-{i}" for i in range(per_thread)}
    for tid in (0, 1):
        assert len(results[tid]) == len(set(results[tid])), "a request was reported twice"
        assert set(results[tid]) == expected, f"connector {tid} lost or gained requests"
    m = sched.metrics
    assert m.dumps_skipped == 0
    assert m.dumps_submitted == m.dumps_completed
    sizes = sched.internal_sizes()
    assert sizes == dict.fromkeys(sizes, 0), sizes
    assert sched.shutdown(timeout=2.0)
