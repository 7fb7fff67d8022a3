"""Every line of NPU-only code: torch_npu events and raw ``acl.rt`` event handles.

Kept in one module so that CUDA/CPU hosts never import ``torch_npu`` or ``acl``: nothing
here imports them at module import time; :class:`NpuDevice` binds them once in
``__init__``, never on the per-layer path (an import per dump would tax every layer).

Two kinds of owned event, picked by ``NpuDevice(backend=...)``:

* ``"torch"`` (default): ``torch.npu.Event`` — same ``record/query/synchronize`` shape as
  CUDA, raw handle from ``event.npu_event`` (or ctypes ``_as_parameter_``).
* ``"acl"``: a raw ``aclrtEvent`` from ``acl.rt.create_event`` recorded on
  ``torch_npu.npu.current_stream().npu_stream``, wrapped in :class:`AclEvent` so it has the
  same shape. For C++ stores that want handles created by ACL itself. Every ``acl.rt``
  return code is checked; a failed ``record_event`` destroys the event it created (the
  #982 review found that leak).

Borrowed NPU events (vLLM-Ascend's ``reshape_cache_event``) are never destroyed here; the
ledger in :mod:`ucm_patch.hooks.events` only drops them.

Manual check on Ascend hardware (the CI has no NPU; run this on a 910B/910C host with CANN,
torch_npu and this package installed, and paste the printed dict into the PR)::

    python -c "from ucm_patch.hooks.device_npu import self_check; print(self_check())"
    python -c "from ucm_patch.hooks.device_npu import self_check; \
print(self_check(backend='acl'))"

Each prints a dict and exits 0 only when: an owned event recorded after a 4096x4096
matmul completes after ``synchronize``; ``raw_handle`` of owned and of a borrowed
``torch.npu.Event`` is a non-zero int; ``release`` pooled the event (pooled == 1); a
ledger round trip leaves ``live_owned == live_borrowed == 0``; and ``close`` destroyed the
pool (``destroyed == created``). Any failure raises with the failing step's name.
"""

from __future__ import annotations

from typing import Any

from ucm_patch.hooks.device import Device, EventHandleError

#: ACL_EVENT_RECORDED_STATUS_COMPLETE from ``acl.rt.query_event_status``.
ACL_EVENT_RECORDED_STATUS_COMPLETE = 1


class NpuEventError(RuntimeError):
    """An ``acl.rt`` event call returned a non-zero error code."""


def _check(ret: int, call: str) -> None:
    if ret != 0:
        raise NpuEventError(f"acl.rt.{call} failed with ret={ret}")


class AclEvent:
    """A raw ACL event with torch's Event shape (record / query / synchronize)."""

    __slots__ = ("_acl", "_stream_of", "handle")

    def __init__(self, acl: Any, stream_of: Any) -> None:
        event, ret = acl.rt.create_event()
        _check(ret, "create_event")
        self._acl = acl
        self._stream_of = stream_of
        self.handle = int(event)

    def record(self, stream: Any = None) -> None:
        s = self._stream_of() if stream is None else stream
        _check(self._acl.rt.record_event(self.handle, s), "record_event")

    def query(self) -> bool:
        status, ret = self._acl.rt.query_event_status(self.handle)
        _check(ret, "query_event_status")
        return status == ACL_EVENT_RECORDED_STATUS_COMPLETE

    def synchronize(self) -> None:
        _check(self._acl.rt.synchronize_event(self.handle), "synchronize_event")

    def destroy(self) -> None:
        handle, self.handle = self.handle, 0
        if handle:
            _check(self._acl.rt.destroy_event(handle), "destroy_event")


class NpuDevice(Device):
    """NPU events via torch_npu (``backend="torch"``) or raw ACL (``backend="acl"``)."""

    kind = "npu"

    def __init__(self, pool_size: int = 256, backend: str = "torch") -> None:
        super().__init__(pool_size)
        if backend not in ("torch", "acl"):
            raise ValueError(f"NpuDevice backend={backend!r}; expected 'torch' or 'acl'")
        import torch
        import torch_npu  # registers torch.npu

        self.backend = backend
        self._torch = torch
        self._torch_npu = torch_npu
        # Per-thread current device (see CudaDevice): captured on the constructing thread.
        self.device_index = torch.npu.current_device()
        self._acl: Any = None
        if backend == "acl":
            import acl

            self._acl = acl

    def _current_stream_ptr(self) -> Any:
        return self._torch_npu.npu.current_stream().npu_stream

    def _new_event(self) -> Any:
        if self._acl is not None:
            return AclEvent(self._acl, self._current_stream_ptr)
        return self._torch.npu.Event(enable_timing=False)

    def _destroy_event(self, event: Any) -> None:
        if type(event) is AclEvent:
            event.destroy()

    def record_failed(self, event: Any) -> None:
        """A failed record may leave the event unusable: destroy it, never pool it."""
        self.destroyed += 1
        self._destroy_event(event)

    def synchronize(self) -> None:
        self._torch.npu.synchronize(self.device_index)

    def raw_handle(self, event: Any) -> int:
        if type(event) is AclEvent:
            handle = event.handle
        else:
            handle = getattr(event, "npu_event", None)
            if not handle:  # older torch_npu: a ctypes c_void_p in _as_parameter_
                handle = getattr(getattr(event, "_as_parameter_", None), "value", None)
        if type(handle) is not int or handle == 0:
            raise EventHandleError(f"NPU event {event!r} has no handle (handle={handle!r})")
        return handle


def self_check(backend: str = "torch") -> dict[str, Any]:
    """Exercise NpuDevice on real Ascend hardware (see the module docstring)."""
    import torch

    from ucm_patch.hooks.events import EventLedger
    from ucm_patch.hooks.metrics import DumpMetrics

    device = NpuDevice(pool_size=4, backend=backend)
    out: dict[str, Any] = {"backend": backend}
    a = torch.randn(4096, 4096, device="npu")
    _ = a @ a
    event = device.record_event()
    device.wait(event)
    if not event.query():
        raise AssertionError("owned event: query() is False after synchronize()")
    out["owned_handle"] = device.raw_handle(event)
    device.release(event)
    if device.pooled != 1:
        raise AssertionError(f"release: pooled={device.pooled}, expected 1")
    borrowed = torch.npu.Event()
    borrowed.record()
    out["borrowed_handle"] = device.raw_handle(borrowed)
    ledger = EventLedger(device, DumpMetrics(), need_handle=True)

    class _Md:
        reshape_cache_event = borrowed

    ev, owned, source = ledger.acquire("layer.0", _Md())
    ledger.release(ev, owned)
    ev, owned, _ = ledger.acquire("layer.1", None)
    ledger.release(ev, owned)
    out["borrowed_source"] = int(source)
    out["live"] = (ledger.live_owned, ledger.live_borrowed)
    if out["live"] != (0, 0):
        raise AssertionError(f"ledger: live handles {out['live']} after release")
    device.close()
    out["created_destroyed"] = (device.created, device.destroyed)
    if device.created != device.destroyed:
        raise AssertionError(f"close: created={device.created} destroyed={device.destroyed}")
    return out
