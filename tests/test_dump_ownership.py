"""Each piece of dump-engine state has one owner (issue #28, item 3).

The client owns its request maps under its own lock; the scheduler tells it of completed
batches through a queue and never touches the maps; the client calls the scheduler only
with its own lock released (so the two locks have one order and cannot deadlock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tests.support.fakes_store import FakeStore
from ucm_patch.hooks.device import CpuDevice
from ucm_patch.hooks.dump import Batch, DumpScheduler
from ucm_patch.hooks.dump.client import DumpClient
from ucm_patch.hooks.dump.types import SubmitTally
from ucm_patch.hooks.events import EventSource


def _in_thread(fn: Callable[[], Any], timeout: float = 5.0) -> tuple[bool, Any]:
    """(finished within ``timeout``, its result)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), out[0] if out else None


def test_client_answers_while_another_thread_holds_the_schedulers_lock() -> None:
    sched = DumpScheduler(device=CpuDevice(), workers=1)
    try:
        client = sched.client("c")
        batch = client.open_batch(["r"], FakeStore())
        with sched._lock:  # a retire in progress elsewhere
            done, answer = _in_thread(lambda: client.needs_delayed_free("r"))
            assert done, "the client's maps waited for the scheduler's lock"
            assert answer is True
            done, sizes = _in_thread(client.sizes)
            assert done and sizes == {"requests": 1, "ready": 0, "finished_waiting": 0}
        sched.seal(batch)
        assert client.get_finished(["r"]).sending == {"r"}
    finally:
        sched.shutdown(timeout=2.0)


class _Scheduler:
    """A SchedulerOfClient that fails any call made while the client holds its lock."""

    closed = False
    blocking_finish = False

    def __init__(self) -> None:
        self.client: DumpClient | None = None
        self.calls: list[str] = []
        self.reported: list[tuple[int, int, int]] = []

    def _check(self, name: str) -> None:
        assert self.client is not None and not self.client._lock.locked(), (
            f"DumpClient called scheduler.{name} holding its own lock"
        )
        self.calls.append(name)

    def submit_layer(self, *args: Any) -> bool:
        return True

    submit = submit_layer

    def seal(self, batch: Batch) -> None:
        self._check("seal")
        batch.sealed = True
        if batch.retired == batch.submitted:
            batch.done = True
            batch.client.batch_done(batch)

    def batch_opened(self) -> None:
        self._check("batch_opened")

    def poll(self) -> None:
        self._check("poll")

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        self._check("wait_until")
        return predicate()

    def requests_reported(self, ready: int, failed: int, waits_ns: list[int]) -> None:
        self._check("requests_reported")
        self.reported.append((ready, failed, len(waits_ns)))

    def preempt_waited(self, seconds: float) -> None:
        self._check("preempt_waited")

    def remove_client(self, client: DumpClient) -> None:
        self._check("remove_client")


def test_client_calls_the_scheduler_only_with_its_own_lock_released() -> None:
    sched = _Scheduler()
    client = sched.client = DumpClient(sched, "c")  # type: ignore[arg-type]
    store = FakeStore()
    first = client.open_batch(["a", "b"], store)
    client.seal(first)  # completes at once: queued on the client, not yet taken in
    assert client._done and client.needs_delayed_free("a")
    assert client.get_finished(["a"]).sending == {"a"}
    assert sched.reported == [(1, 0, 1)]
    second = client.open_batch(["c"], store)
    assert client.has_pending() is False  # "a" reported; "b" and "c" not finished
    assert client.handle_preemptions(["b"]) is True
    assert client.flush(1.0) is True and second.sealed
    client.close()
    assert {"batch_opened", "poll", "seal", "requests_reported", "wait_until"} <= set(sched.calls)
    assert sched.calls[-1] == "remove_client"


def test_the_tally_counts_per_owned_and_source_and_folds_what_was_added() -> None:
    tally, folded = SubmitTally(), SubmitTally()
    tally[True][EventSource.LAYER] += 2  # the submit path's two subscripts
    tally[False][EventSource.NONE] += 1
    assert sorted(tally.added(folded)) == [
        (int(EventSource.NONE), False, 1),
        (int(EventSource.LAYER), True, 2),
    ]
    assert folded == tally and list(tally.added(folded)) == []
