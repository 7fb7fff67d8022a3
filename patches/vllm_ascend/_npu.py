"""The only NPU-specific code of the vLLM-Ascend patch sets: creating ``torch.npu.Event``.

The patches need exactly what vLLM-Ascend itself does for ``reshape_cache_event``:
``torch.npu.Event()`` and ``.record()`` on the current stream. Raw handles (``npu_event``,
``acl.rt``) are the dump scheduler's business and live in
:mod:`ucm_patch.hooks.device_npu` (``NpuDevice.raw_handle`` turns the events made here into
the integer a C++ store waits on; they are *borrowed* there and never destroyed).

Nothing here imports ``torch_npu`` at module import time; :func:`event_class` binds it once
at apply time. In CI the tests put a fake ``torch_npu`` (tests/standins/common) on
``sys.path`` that registers a ``torch.npu`` with ``Event`` / ``record`` / ``query``.

Check on Ascend hardware (no NPU in CI; run on a 910B/910C host with CANN, torch_npu and
this package installed, and paste the printed dict into the PR)::

    python -m ucm_patch.patches.vllm_ascend._npu

It exits 0 only when an event made by :func:`event_class`, recorded right after a KV-cache
style write (``torch_npu.npu_scatter_nd_update_``, queued behind a large matmul), reports
complete after ``synchronize()``, the write is visible then, and ``NpuDevice.raw_handle``
turns the event into a non-zero integer. ``query_before_sync`` is printed for information
(usually False). Any failure raises naming the step.
"""

from __future__ import annotations

from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any


def event_class() -> Any:
    """``torch.npu.Event`` (importing ``torch_npu`` registers ``torch.npu``)."""
    import torch
    import torch_npu  # noqa: F401  (registers the torch.npu device module)

    npu = getattr(torch, "npu", None)
    event = getattr(npu, "Event", None)
    if event is None:
        raise RuntimeError("torch_npu is imported but torch.npu.Event does not exist")
    return event


def self_check() -> dict[str, Any]:
    """Record an event after a cache write on a real NPU and check it (module docstring)."""
    import torch
    import torch_npu

    from ucm_patch.hooks.device_npu import NpuDevice

    event_cls = event_class()
    out: dict[str, Any] = {"torch_npu": getattr(torch_npu, "__version__", "?")}
    cache = torch.zeros(4096, 128, device="npu")
    slots = torch.arange(0, 4096, 2, device="npu").view(-1, 1)
    values = torch.ones(slots.shape[0], 128, device="npu")
    big = torch.randn(4096, 4096, device="npu")
    _ = big @ big  # queue work ahead of the write so the event is not trivially complete
    torch_npu.npu_scatter_nd_update_(cache, slots, values)
    event = event_cls()
    event.record()
    out["query_before_sync"] = bool(event.query())
    event.synchronize()
    if not event.query():
        raise AssertionError("event.query() is False after event.synchronize()")
    written = float(cache[0].sum().item())
    if written != 128.0:
        raise AssertionError(f"cache write not visible after the event: row 0 sums to {written}")
    out["raw_handle"] = NpuDevice(pool_size=0).raw_handle(event)
    return out


if __name__ == "__main__":  # pragma: no cover - hardware only
    print(self_check())
