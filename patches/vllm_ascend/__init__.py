"""Patch sets for vllm_ascend (one module per feature; each lists its records per era).

Every record here gates on ``vllm-ascend`` only: the core (``ucm_patch.versions.align_ascend``)
already replaces a stale vLLM-Ascend version by the paired vLLM release on a major.minor
mismatch ("vLLM wins"), and ``ucm-patch status`` shows the mismatch. Each record's
``expect`` states the source facts it relies on (the names in :mod:`.source_names`),
verified by :mod:`tools.verify.ascend` and by the tests.
"""

from __future__ import annotations

from ucm_patch.patches.vllm_ascend import (
    gdn_layerwise,
    hook_bindings,
    reshape_cache_event,
    sfa_wait,
)
from ucm_patch.records import PatchSet, patch_sets

PATCH_SETS: tuple[PatchSet, ...] = patch_sets(
    "vllm-ascend",
    gdn_layerwise,
    reshape_cache_event,
    hook_bindings,
    sfa_wait,
)
