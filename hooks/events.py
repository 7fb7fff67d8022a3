"""Which event a dump waits on, who owns it, and when it is let go.

Ownership (UCM #989 / #1025 leaked or double-freed event handles): every event a dump task holds is
either

* **owned** — recorded by us on the current stream (:meth:`Device.record_event`); it must be
  released exactly once, on every path (success, store error, submission error,
  preemption, shutdown). Release returns it to the device pool.
* **borrowed** — someone else's event: vLLM-Ascend's ``reshape_cache_event`` or the KV-ready
  event a patch published via :func:`ucm_patch.hooks.layerwise.kv_ready`. It is never
  destroyed, only dropped (the reference is cleared when the task is retired).

:class:`EventLedger` is the single place both kinds pass through, so it can count live
handles (``live_owned`` / ``live_borrowed``; both 0 when nothing is in flight).

Event-source resolution (:meth:`EventLedger.acquire`), first hit wins:

1. the layer's KV-ready event in per-layer metadata: ``attn_metadata[layer].reshape_cache_event``
   (``attn_metadata`` is the forward context's dict, or a list of dicts with ubatching);
2. ``attn_metadata.reshape_cache_event`` (the per-layer object vLLM passes to
   ``save_kv_layer``);
3. ``ucm_patch.hooks.layerwise.kv_ready_events[layer]`` — consumed (popped) on every
   resolution, so a stale event from an earlier step can never be used: a layer whose patch
   did not publish this step falls through to 4;
4. an owned event recorded now on the current stream;
5. no event: the worker synchronises the whole device before reading (correct, slow).

A borrowed event whose raw handle cannot be extracted (only checked when
``need_handle=True``, i.e. for stores that wait on raw handles in C++) counts as "handle
extraction failed" and resolution continues with the next source. With
``expect_kv_ready=True`` (the KV-ready patch set is active), reaching 4 or 5 also counts
"expected but missing". Only the specific exceptions each step can raise are caught.

Locking: ``EventLedger.lock`` (a ``threading.Lock``; the DumpScheduler passes its own so a
dump takes one lock, not two) guards the live counters, the event counters and every
``Device.release`` (pool append). ``resolve`` takes no lock: it only reads, pops the
KV-ready table entry and pops an event from the device pool — ``list.pop`` / ``dict.pop``
are single atomic operations. ``acquire``/``resolve`` run on the forward thread;
``release`` runs wherever the owner retires a task (the DumpScheduler retires finished dumps
on the forward side, see its module docstring), possibly on several threads at once. The
lock is never held while waiting on an event or calling a store.
"""

from __future__ import annotations

import threading
from enum import IntEnum
from typing import Any

from ucm_patch.hooks import layerwise
from ucm_patch.hooks.device import Device, EventHandleError
from ucm_patch.hooks.metrics import DumpMetrics


class EventSource(IntEnum):
    """Where a dump's event came from (index into ``DumpMetrics.event_sources``)."""

    NONE = 0
    LAYER = 1
    DIRECT = 2
    KV_READY_TABLE = 3
    CURRENT_STREAM = 4
    DEVICE_SYNC = 5
    EXTERNAL = 6


_NONE = int(EventSource.NONE)
_LAYER = int(EventSource.LAYER)
_DIRECT = int(EventSource.DIRECT)
_TABLE = int(EventSource.KV_READY_TABLE)
_STREAM = int(EventSource.CURRENT_STREAM)
_SYNC = int(EventSource.DEVICE_SYNC)
_EXTERNAL = int(EventSource.EXTERNAL)

#: What handle extraction may raise (EventHandleError derives from ValueError).
_HANDLE_ERRORS = (EventHandleError, AttributeError, TypeError, ValueError)


class EventLedger:
    """Resolves, counts and releases dump events (see the module docstring)."""

    __slots__ = (
        "_missing_sources",
        "_pool",
        "_sources",
        "_table",
        "consume_table",
        "device",
        "expect_kv_ready",
        "live_borrowed",
        "live_owned",
        "lock",
        "metrics",
        "need_handle",
    )

    def __init__(
        self,
        device: Device,
        metrics: DumpMetrics,
        *,
        expect_kv_ready: bool = False,
        need_handle: bool = False,
        consume_table: bool = True,
        kv_ready_table: dict[str, Any] | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        self.device = device
        self._pool = device.free_events  # the same list object for the device's whole life
        self.metrics = metrics
        self.expect_kv_ready = expect_kv_ready
        self.need_handle = need_handle
        self.consume_table = consume_table
        self._table = layerwise.kv_ready_events if kv_ready_table is None else kv_ready_table
        self._sources = metrics.event_sources
        # Sources that mean "the KV-ready event we expected was not there".
        self._missing_sources = (_STREAM, _SYNC) if expect_kv_ready else ()
        #: Guards live_owned / live_borrowed, the event counters and pool appends. The
        #: DumpScheduler passes its own lock so one acquisition covers both per dump.
        self.lock = threading.Lock() if lock is None else lock
        self.live_owned = 0
        self.live_borrowed = 0
        metrics.live_handles = self.live

    def live(self) -> tuple[int, int]:
        """(owned, borrowed) events currently held by tasks."""
        return self.live_owned, self.live_borrowed

    # -- acquire (forward thread) ---------------------------------------------------
    def acquire(self, layer_name: str, attn_metadata: Any) -> tuple[Any, bool, int]:
        """The event a dump of ``layer_name`` must wait on: ``(event, owned, source)``.

        ``event`` is None for :attr:`EventSource.DEVICE_SYNC`. The caller must pass the
        result to :meth:`release` exactly once (the scheduler does that on every path).
        """
        event, owned, source = self.resolve(layer_name, attn_metadata)
        lock = self.lock
        lock.acquire()
        try:
            self.count_locked(owned, source)
        finally:
            lock.release()
        return event, owned, source

    def resolve(self, layer_name: str, attn_metadata: Any) -> tuple[Any, bool, int]:
        """:meth:`acquire` without the accounting (``DumpScheduler`` counts under its lock).

        Takes no lock on the common path: it reads metadata, pops the KV-ready table and
        may pop an owned event from the device pool (``list.pop`` is atomic; a racing
        empty pool is handled by the device).
        """
        table_event = (
            self._table.pop(layer_name, None) if self.consume_table else self._table.get(layer_name)
        )
        md = attn_metadata
        if type(md) is list:
            md = md[0] if md else None
        if md is not None:
            if type(md) is dict:
                layer_md = md.get(layer_name)
                event = (
                    getattr(layer_md, "reshape_cache_event", None) if layer_md is not None else None
                )
                if event is not None and (not self.need_handle or self._usable(event)):
                    return event, False, _LAYER
            else:
                event = getattr(md, "reshape_cache_event", None)
                if event is not None and (not self.need_handle or self._usable(event)):
                    return event, False, _DIRECT
        if table_event is not None and (not self.need_handle or self._usable(table_event)):
            return table_event, False, _TABLE
        if self.need_handle:
            return self._record_or_sync()
        # Device.record_event inlined (once per layer per step: two Python frames saved).
        # Keep in step with Device.record_event.
        try:
            event = self._pool.pop()
        except IndexError:
            return self._record_or_sync()  # pool empty: create one (slow path)
        try:
            event.record()
        except RuntimeError:
            self.device.record_failed(event)
            self._bump("event_record_failed")
            return None, False, _SYNC
        return event, True, _STREAM

    def count_locked(self, owned: bool, source: int, n: int = 1) -> None:
        """Account ``n`` events from :meth:`resolve` as live (caller holds :attr:`lock`)."""
        self._sources[source] += n
        if owned:
            self.live_owned += n
        elif source != _SYNC and source != _NONE:
            self.live_borrowed += n
        if source in self._missing_sources:
            self.metrics.event_expected_missing += n

    def _usable(self, event: Any) -> bool:
        try:
            self.device.raw_handle(event)
        except _HANDLE_ERRORS:
            self._bump("event_handle_failed")
            return False
        return True

    def _bump(self, counter: str) -> None:
        lock = self.lock
        lock.acquire()
        try:
            setattr(self.metrics, counter, getattr(self.metrics, counter) + 1)
        finally:
            lock.release()

    def _record_or_sync(self) -> tuple[Any, bool, int]:
        try:
            event = self.device.record_event()
        except RuntimeError:
            self._bump("event_record_failed")
            return None, False, _SYNC
        if self.need_handle and not self._usable(event):
            self.release(event, True, counted=False)
            return None, False, _SYNC
        return event, True, _STREAM

    def record(self) -> tuple[Any, bool, int]:
        """An owned current-stream event (else device sync), not yet counted.

        Like :meth:`resolve`, for callers that hand the event to
        :meth:`DumpScheduler.submit <ucm_patch.hooks.dump.DumpScheduler.submit>`,
        which counts it.
        """
        return self._record_or_sync()

    # -- release (worker threads, or the caller on a failed submit) -------------------
    def release(self, event: Any, owned: bool, counted: bool = True) -> None:
        """Let go of an event: owned -> pool, borrowed -> dropped.

        ``counted=False`` for an event from :meth:`resolve` / :meth:`record` that was never
        accounted (a submit that failed before counting it).
        """
        if event is None:
            return
        lock = self.lock
        lock.acquire()
        try:
            self.release_locked(event, owned, counted)
        finally:
            lock.release()

    def release_locked(self, event: Any, owned: bool, counted: bool = True) -> None:
        """:meth:`release` for a caller that holds :attr:`lock`."""
        if owned:
            if counted:
                self.live_owned -= 1
            self.device.release(event)
        elif counted:
            self.live_borrowed -= 1
