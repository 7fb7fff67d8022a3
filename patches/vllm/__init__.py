"""Patch sets for vllm (one module per feature; each lists its records per era).

Importing this package imports neither vLLM nor torch: the records are data, and their
wrappers bind vLLM when the registry applies them (the target module is imported).
"""

from __future__ import annotations

from ucm_patch.patches.vllm import (
    cpu_block_size,
    gdn_layerwise,
    gdn_variants,
    kv_ready_event,
    mla_bypass,
)
from ucm_patch.records import PatchSet

PATCH_SETS: tuple[PatchSet, ...] = (
    cpu_block_size.PATCH_SET,
    gdn_layerwise.PATCH_SET,
    gdn_variants.PATCH_SET,
    kv_ready_event.PATCH_SET,
    mla_bypass.PATCH_SET,
)
