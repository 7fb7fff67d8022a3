"""Stand-in for vllm_ascend/utils.py: only the helpers the patches and stand-ins use."""

from __future__ import annotations

import functools
import os

import vllm
from packaging.version import Version


@functools.cache
def vllm_version_is(target_vllm_version: str) -> bool:
    """Exact-equality vLLM version check honouring ``VLLM_VERSION`` (as upstream)."""
    version = os.getenv("VLLM_VERSION") or vllm.__version__
    return Version(version) == Version(target_vllm_version)


def is_310p() -> bool:
    """Upstream asks the device; the stand-in reads ``UCM_STANDIN_SOC=310p``."""
    return os.getenv("UCM_STANDIN_SOC") == "310p"
