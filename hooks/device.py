"""One small interface over CUDA, NPU and CPU events, so the dump scheduler is device-blind.

Why an interface at all: the scheduler only needs five things from a device — record an
event on the current stream (an *owned* event), give it back, block a worker thread until
an event completes, synchronise the whole device (last-resort fallback), and turn an event
into the raw integer handle a C++ store waits on. torch's ``torch.cuda.Event`` and
``torch.npu.Event`` already share ``record()`` / ``query()`` / ``synchronize()``, and the CPU
events below copy that shape, so waiting on any event — owned or borrowed — is just
``event.synchronize()``.

Owned events come from a per-device pool: creating a CUDA event costs about the
whole 2 µs submit budget, reusing a pooled one a small fraction of it. ``release`` returns
an owned event to the pool (or drops it when the pool is full); an event that is *borrowed*
(vLLM-Ascend's ``reshape_cache_event``, our KV-ready events) must never be passed to
``release`` — :mod:`ucm_patch.hooks.events` enforces that.

Thread-safety: ``record_event`` (forward thread) takes an event with one ``list.pop``, an
atomic operation, and falls back to creating one when the pool is empty — so it needs no
lock and two forward threads cannot get the same event. ``release`` and ``close`` (worker
threads, shutdown) are called by :class:`ucm_patch.hooks.events.EventLedger` under its lock,
which serialises the check-then-append that bounds the pool. The ``created``/``destroyed``
counters are diagnostics; concurrent creation may race on them.

Nothing here imports torch at module import time; the devices bind it lazily. NPU code
lives in :mod:`ucm_patch.hooks.device_npu` only; :mod:`ucm_patch.hooks.device_choice`
chooses one.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any


class EventHandleError(ValueError):
    """An event could not be turned into a usable raw handle (0, None or wrong type)."""


class Device(ABC):
    """Events and synchronisation for one accelerator kind (see the module docstring)."""

    #: Short platform name ("cpu", "cuda", "npu"), used in metrics and reports.
    kind: str = "abstract"

    def __init__(self, pool_size: int = 256) -> None:
        if pool_size < 0:
            raise ValueError(f"pool_size must be >= 0, got pool_size={pool_size!r}")
        self.pool_size = pool_size
        # Recorded-and-released events ready for reuse. Public because the event ledger
        # pops from this very list on the per-layer path (no call into the device).
        self.free_events: list[Any] = []
        #: Owned events created / destroyed over the device's life (not pool hits).
        self.created = 0
        self.destroyed = 0

    # -- owned events ---------------------------------------------------------------
    @abstractmethod
    def _new_event(self) -> Any:
        """Create one platform event (not yet recorded)."""

    def _destroy_event(self, event: Any) -> None:  # noqa: B027 - optional override
        """Destroy one platform event the pool no longer keeps (default: drop it)."""

    def record_event(self) -> Any:
        """An owned event recorded now on the current stream (pooled; caller must release).

        Raises RuntimeError (torch's device errors derive from it) when the platform
        cannot create or record an event; the pool is left consistent.
        """
        try:
            event = self.free_events.pop()  # atomic; IndexError when empty (or a racing pop won)
        except IndexError:
            event = self._new_event()
            self.created += 1
        try:
            event.record()  # every event kind records on the calling thread's current stream
        except BaseException:
            self.record_failed(event)
            raise
        return event

    def record_failed(self, event: Any) -> None:
        """An event whose record raised: pool it again (platforms may destroy it instead)."""
        self._give_back(event)

    def release(self, event: Any) -> None:
        """Give an owned event back (pool it, or destroy it when the pool is full)."""
        self._give_back(event)

    def _give_back(self, event: Any) -> None:
        if len(self.free_events) < self.pool_size:
            self.free_events.append(event)
        else:
            self.destroyed += 1
            self._destroy_event(event)

    def close(self) -> None:
        """Destroy every pooled event; events released later are destroyed (idempotent)."""
        self.pool_size = 0
        pool = self.free_events[:]
        self.free_events.clear()  # in place: EventLedger holds a reference to this list
        for event in pool:
            self.destroyed += 1
            self._destroy_event(event)

    @property
    def pooled(self) -> int:
        """Owned events currently idle in the pool."""
        return len(self.free_events)

    # -- waiting --------------------------------------------------------------------
    @staticmethod
    def wait(event: Any) -> None:
        """Block the calling (worker) thread until ``event`` completed.

        Works for owned and borrowed events alike: torch's CUDA/NPU events and the CPU
        events here all expose ``synchronize()`` (torch releases the GIL while waiting).
        """
        event.synchronize()

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until all work queued on the device finished (fallback when no event).

        Called from a worker thread, so it must be device-wide, not "current stream":
        a worker's current stream is not the forward pass's stream.
        """

    @abstractmethod
    def raw_handle(self, event: Any) -> int:
        """The event's raw runtime handle (cudaEvent_t / aclrtEvent) as a non-zero int.

        Raises :class:`EventHandleError`, AttributeError or TypeError when the event has
        no usable handle; callers count that as "handle extraction failed".
        """


# ---------------------------------------------------------------------------------------
# CPU: used by tests and by CPU-only vLLM. Work is synchronous, so an event is always ready.
# ---------------------------------------------------------------------------------------


class CpuEvent:
    """An always-ready event with torch's Event shape (record / query / synchronize)."""

    __slots__ = ("handle", "records")

    def __init__(self, handle: int = 0) -> None:
        self.handle = handle
        self.records = 0

    def record(self, stream: Any = None) -> None:
        self.records += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class FakeEvent:
    """A controllable event for tests of waiting: incomplete until :meth:`set` is called.

    :meth:`fail` makes every waiter raise ``RuntimeError`` (what torch raises when the
    device reports an error), to test the scheduler's failure paths.
    """

    __slots__ = ("_done", "_error", "handle", "waiters")

    def __init__(self, handle: int = 0) -> None:
        self._done = threading.Event()
        self._error: str | None = None
        self.handle = handle
        self.waiters = 0

    def record(self, stream: Any = None) -> None:
        self._done.clear()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.waiters += 1
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(self._error)

    def set(self) -> None:
        """Complete the event: every waiter returns."""
        self._done.set()

    def fail(self, message: str = "fake device error") -> None:
        """Complete the event with a device error: every waiter raises RuntimeError."""
        self._error = message
        self._done.set()


class CpuDevice(Device):
    """CPU device: always-ready owned events, no-op synchronise, counting destroys.

    Handles are small positive ints so the raw-handle path can be exercised on CPU.
    """

    kind = "cpu"

    def __init__(self, pool_size: int = 256) -> None:
        super().__init__(pool_size)
        self._next_handle = 0
        self.synchronizes = 0

    def _new_event(self) -> CpuEvent:
        self._next_handle += 1
        return CpuEvent(self._next_handle)

    def synchronize(self) -> None:
        self.synchronizes += 1

    def raw_handle(self, event: Any) -> int:
        handle = event.handle
        if type(handle) is not int or handle <= 0:
            raise EventHandleError(f"event {event!r} has no raw handle (handle={handle!r})")
        return handle


# ---------------------------------------------------------------------------------------
# CUDA: torch.cuda.Event. Bound lazily; constructing a CudaDevice imports torch.
# ---------------------------------------------------------------------------------------


class CudaDevice(Device):
    """CUDA events via ``torch.cuda.Event`` (timing off: cheapest event kind)."""

    kind = "cuda"

    def __init__(self, pool_size: int = 256, device_index: int | None = None) -> None:
        super().__init__(pool_size)
        import torch  # bound once here, never on the hot path

        self._torch = torch
        self._event_cls = torch.cuda.Event
        # The current device is per thread: a worker thread would default to device 0.
        # Capture the forward thread's device now (vLLM sets it before connectors exist).
        self.device_index = torch.cuda.current_device() if device_index is None else device_index

    def _new_event(self) -> Any:
        return self._event_cls(enable_timing=False)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device_index)

    def raw_handle(self, event: Any) -> int:
        handle = event.cuda_event  # 0 until the event was recorded once
        if type(handle) is not int or handle == 0:
            raise EventHandleError(f"CUDA event {event!r} has no handle (cuda_event={handle!r})")
        return handle
