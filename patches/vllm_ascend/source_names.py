"""The names vLLM-Ascend's source uses that its records target and their checks look for.

Every record in this package states in ``expect`` what it relies on in the vLLM-Ascend
source, with the shared vocabulary of :mod:`ucm_patch.source_checks` (re-exported here, so
a record table reads ``c.signature(...)``, ``c.binding(module, c.SAVE)``).
:mod:`tools.verify.ascend` evaluates the checks on every covered release; ``binding``
checks name :data:`UTILS` as the module the hooks come from and ``marks_write`` counts the
calls of :data:`KV_WRITE_OPS` as KV writes.
"""

from __future__ import annotations

from ucm_patch.source_checks import (
    Check,
    anonymous_only,
    arg_index,
    assigned,
    binding,
    local,
    marks_write,
    mlapo_no_wait,
    signature,
)

__all__ = [
    "HOOK_NAMES",
    "KV_WRITE_OPS",
    "NOTIFY",
    "SAVE",
    "SAVE_PARAMS",
    "UTILS",
    "WAIT",
    "WAIT_PARAMS",
    "Check",
    "anonymous_only",
    "arg_index",
    "assigned",
    "binding",
    "local",
    "marks_write",
    "mlapo_no_wait",
    "signature",
]

UTILS = "vllm_ascend.attention.utils"
WAIT = "wait_for_kv_layer_from_connector"
SAVE = "maybe_save_kv_layer_to_connector"
NOTIFY = "notify_kv_cache_written"
HOOK_NAMES = (WAIT, SAVE, NOTIFY)
# Their parameters in every verified release (scripts/data/ascend_signatures.json): what a
# wrapper on a by-name binding of them reads, checked in source and at apply time.
WAIT_PARAMS = ("layer_name",)
SAVE_PARAMS = ("layer_name", "kv_cache_layer")
# torch_npu / vLLM-Ascend calls that write the paged KV cache (attribute or plain calls).
KV_WRITE_OPS = (
    "_npu_reshape_and_cache",
    "npu_scatter_pa_kv_cache",
    "npu_scatter_nd_update_",
    "reshape_and_cache",
)
