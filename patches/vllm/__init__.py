"""Patch sets for vllm (one module per feature; each lists its records per era).

Importing this package imports neither vLLM nor torch: the records are data, and their
wrappers bind vLLM when the registry applies them (the target module is imported).
"""

from __future__ import annotations

from ucm_patch.patches.vllm import (
    cpu_block_size,
    gdn_layerwise,
    gdn_variants,
    hybrid_async_load,
    hybrid_load_failure,
    kv_ready_event,
    mla_bypass,
)
from ucm_patch.records import PatchSet, patch_sets

PATCH_SETS: tuple[PatchSet, ...] = patch_sets(
    "vllm",
    cpu_block_size,
    gdn_layerwise,
    gdn_variants,
    hybrid_async_load,
    hybrid_load_failure,
    kv_ready_event,
    mla_bypass,
)
