"""Fake ``torch_npu`` for tests only (never installed; tests put tests/standins/common on sys.path).

Like the real package, importing it renames torch's PrivateUse1 backend to ``npu`` and
registers ``torch.npu`` with an ``Event`` class (``record`` / ``query`` / ``synchronize`` /
``npu_event``). The KV-cache write ops the vLLM-Ascend stand-ins call
(``_npu_reshape_and_cache``, ``npu_scatter_nd_update_``) write into CPU tensors.

Every write and every event record is appended to :data:`LOG`, one ordered sequence that
the test connector appends its calls to as well, so a test can assert "the event was
recorded after the cache write and before the save".
"""

from __future__ import annotations

import itertools
import sys
import types
from typing import Any

import torch

__version__ = "0.0.0+standin"

# ("write", tag) | ("record", event_id, "native" | "ucm") | connector calls (the harness).
LOG: list[tuple[Any, ...]] = []
_ids = itertools.count(1)


class Event:
    """``torch.npu.Event`` stand-in: records its position in LOG."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.id = next(_ids)
        self.recorded_at: int | None = None
        self.records = 0
        # Who created it: "native" (vllm_ascend code) or "ucm" (a ucm_patch wrapper).
        creator = sys._getframe(1).f_globals.get("__name__", "")
        self.origin = "ucm" if creator.startswith("ucm_patch") else "native"

    def record(self, stream: Any = None) -> None:
        self.recorded_at = len(LOG)
        self.records += 1
        LOG.append(("record", self.id, self.origin))

    def query(self) -> bool:
        return self.recorded_at is not None

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    @property
    def npu_event(self) -> int:
        return 0x1000 + self.id

    def __repr__(self) -> str:
        return f"Event(id={self.id}, recorded_at={self.recorded_at})"


class _Stream:
    npu_stream = 0x2000

    def wait_event(self, event: Event) -> None:
        return None


npu = types.ModuleType("torch_npu.npu")
npu.Event = Event  # type: ignore[attr-defined]
npu.current_stream = lambda device=None: _Stream()  # type: ignore[attr-defined]
npu.synchronize = lambda device=None: None  # type: ignore[attr-defined]
# No device behind it: libraries probing for an NPU (transformers) must not take NPU paths.
npu.is_available = lambda: False  # type: ignore[attr-defined]
npu.device_count = lambda: 0  # type: ignore[attr-defined]

if torch._C._get_privateuse1_backend_name() != "npu":
    torch.utils.rename_privateuse1_backend("npu")
if not hasattr(torch, "npu"):
    torch._register_device_module("npu", npu)


def _npu_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """Scatter key/value rows into the caches at ``slot_indices`` (flattened slots)."""
    key_cache.view(-1, key.shape[-1])[slot_indices] = key.reshape(-1, key.shape[-1])
    value_cache.view(-1, value.shape[-1])[slot_indices] = value.reshape(-1, value.shape[-1])
    LOG.append(("write", "reshape_and_cache"))


def npu_scatter_nd_update_(
    cache: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor
) -> None:
    """In-place row update ``cache[indices] = updates``."""
    cache[indices.view(-1)] = updates
    LOG.append(("write", "scatter_nd_update"))
