"""Reused host buffers for the pages the worker copies between the KV cache and a store.

Why: a dump gathered its pages into a new device tensor and copied that into a new
pageable host tensor (``.cpu()``) for every batch, and a load read pages into a new host
tensor. A pageable device-to-host copy is staged by the driver through its own pinned
bounce buffer, synchronously, and a new host tensor per batch is an allocation (and page
faults) per batch. Here:

* **Host buffers are reused**: :class:`StagingBuffers` keeps the buffers it handed out
  and gives them out again (by size class), so after warm-up nothing is allocated for a
  dump or a load, whatever its number of pages.
* **Pinned on an accelerator**: the buffers are page-locked (``pin_memory``), so the copy
  to or from the device is one DMA the copy engine runs while the GPU computes.
* **A copy stream per thread**: gathers, copies and scatters run on the calling thread's
  own stream of the connector, not on the stream the forward pass runs on, and the thread
  then waits for that stream alone. One stream per thread, because a thread that waits
  for a shared stream waits for every other thread's copies queued on it too.
* **A dump copies once its layer's KV is written, not after the whole forward**: a dump
  thread has waited for the layer's KV-ready event on the host before it copies, so its
  stream waits for nothing else (``after_current=False``). Waiting for the thread's
  current stream as well made every dump copy wait for all the forward work queued so
  far, that is the rest of the prefill (CUDA vLLM runs the forward on the device's
  default stream, which every thread shares): on an H100 the dumps then ran after the
  prefill, not beside it. A copy the forward thread makes itself (an eager dump) and a
  load (its blocks may still be read by work queued before it) do wait for it.
* **On CPU the same path copies once**: the gather writes straight into the buffer
  (``index_select(out=...)``), and a load scatters straight from it.
* **Offered to the store** (``KVStore.register_host_memory``) when created, withdrawn
  before one is dropped: the Mooncake store sends a dump's values from these buffers
  without copying them (zero-copy puts); the local store declines (it copies into its
  segments anyway).

A buffer is lent for one dump or load: :class:`StagedPages` is the list of page views a
dump hands to ``KVStore.put_many``; the dump scheduler calls its :meth:`StagedPages.release`
once the store has copied them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

MIN_BUFFER = 1 << 20  # smaller requests share the 1 MiB class
KEEP_PER_CLASS = 4  # free buffers kept per size class (the dump and load threads' share)


def _size_class(nbytes: int) -> int:
    """The buffer size serving ``nbytes``: the next power of two, at least 1 MiB (a few
    classes, so a buffer fits many batch sizes and is reused)."""
    return max(MIN_BUFFER, 1 << (max(nbytes, 1) - 1).bit_length())


def copy_stream(device: torch.device) -> Any:
    """The connector's own stream on ``device`` (``torch.cuda`` / ``torch.npu``), None on
    CPU or when the backend has no streams."""
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    make = getattr(backend, "Stream", None)
    if make is None:
        return None
    return make(device)


class StagingBuffers:
    """Host buffers lent to dumps and loads, reused; pinned when the KV cache is on an
    accelerator. Thread-safe: the dump and load threads share one instance."""

    def __init__(
        self,
        device: torch.device,
        register: Callable[[int, int], bool] | None = None,
        unregister: Callable[[int], None] | None = None,
    ) -> None:
        self.device = device
        # the store's register_host_memory / unregister_host_memory
        self._register = register
        self._unregister = unregister
        self.pinned = device.type != "cpu"
        self._has_streams = copy_stream(device) is not None
        self._streams = threading.local()  # .stream: the calling thread's copy stream
        self.allocated = 0  # buffers ever created: stays small when buffers are reused
        self.lent = 0  # buffers out now
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # guards _free and the counters

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` host buffer of at least ``nbytes`` (give it back with
        :meth:`give`)."""
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            self.lent += 1
            if free:
                return free.pop()
            self.allocated += 1
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        if self._register is not None:
            self._register(buf.data_ptr(), size)
        return buf

    def reserve(self, nbytes: int, count: int) -> None:
        """Have ``count`` buffers of at least ``nbytes`` ready (at most
        :data:`KEEP_PER_CLASS`), made now: a pinned allocation takes milliseconds, and the
        first hit of a new process would otherwise pay them (the caches' registration
        calls this, off the request path)."""
        size = _size_class(nbytes)
        with self._lock:
            have = len(self._free.get(size, ()))
        made = []
        for _ in range(min(count, KEEP_PER_CLASS) - have):
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            buf.fill_(0)  # every page touched now, not in the first copy into it
            if self._register is not None:
                self._register(buf.data_ptr(), size)
            made.append(buf)
        with self._lock:
            self.allocated += len(made)
            self._free.setdefault(size, []).extend(made)

    def give(self, buf: torch.Tensor) -> None:
        """Take ``buf`` back (kept for the next :meth:`take` of its size class)."""
        with self._lock:
            self.lent -= 1
            free = self._free.setdefault(buf.numel(), [])
            kept = len(free) < KEEP_PER_CLASS
            if kept:
                free.append(buf)
        if not kept and self._unregister is not None:
            self._unregister(buf.data_ptr())  # dropped: the store must not send from it

    @property
    def stream(self) -> Any:
        """The calling thread's copy stream (made on its first use), None on CPU."""
        if not self._has_streams:
            return None
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = copy_stream(self.device)
        return stream

    @contextlib.contextmanager
    def on_stream(self, after_current: bool = True) -> Iterator[None]:
        """Run the block's device work on the calling thread's copy stream, then wait for
        that stream alone. ``after_current``: first make it wait for everything already
        queued on the thread's current stream (an eager dump's layer KV, a kernel still
        reading a block a load overwrites); a dump thread that waited for its layer's
        KV-ready event passes False. No-op on CPU."""
        stream = self.stream
        if stream is None:
            yield
            return
        backend = getattr(torch, self.device.type)
        if after_current:
            stream.wait_stream(backend.current_stream(self.device))
        with backend.stream(stream):
            yield
        stream.synchronize()


class StagedPages(list):  # type: ignore[type-arg]  (list[memoryview])
    """One page view per key, into a buffer lent by :class:`StagingBuffers`; the store
    copies them, then :meth:`release` gives the buffer back (once)."""

    __slots__ = ("_buffer", "_staging")

    def __init__(self, views: list[memoryview], staging: StagingBuffers, buffer: torch.Tensor):
        super().__init__(views)
        self._staging: StagingBuffers | None = staging
        self._buffer = buffer

    def release(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            self.clear()  # no view of the buffer outlives the loan
            staging.give(self._buffer)


__all__ = ["StagedPages", "StagingBuffers", "copy_stream"]
