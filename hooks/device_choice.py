"""The :class:`~ucm_patch.hooks.device.Device` of this process: CPU, CUDA or NPU.

Kept apart from ``device.py``, which the NPU device builds on: choosing a device needs every
kind, and a kind must not import the module that chooses it (no import circle).
"""

from __future__ import annotations

from ucm_patch.hooks.device import CpuDevice, CudaDevice, Device


def make_device(kind: str | None = None, pool_size: int = 256) -> Device:
    """The Device for this process: ``kind`` ("cpu" | "cuda" | "npu") or the platform's.

    Without ``kind`` the choice follows vLLM's ``current_platform.device_type`` when vLLM
    is importable (what the engine itself runs on), else torch's availability checks.
    Unknown kinds raise ValueError naming the value.
    """
    if kind is None:
        kind = _platform_kind()
    if kind == "cpu":
        return CpuDevice(pool_size)
    if kind == "cuda":
        return CudaDevice(pool_size)
    if kind == "npu":
        from ucm_patch.hooks.device_npu import NpuDevice  # torch_npu only where it runs

        return NpuDevice(pool_size)
    raise ValueError(f"unknown device kind={kind!r}; expected 'cpu', 'cuda' or 'npu'")


def _platform_kind() -> str:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        current_platform = None
    if current_platform is not None:
        device_type = getattr(current_platform, "device_type", "cpu")
        if device_type in ("cuda", "npu"):
            return device_type
        return "cpu"
    try:
        import torch
    except ImportError:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"
