"""``ascend_sfa_wait``: SFA's ``mlapo`` branch never waits for the layer's KV load (0.13 - 0.18).

Why: ``AscendSFAImpl.forward`` (DeepSeek sparse attention) calls
``wait_for_kv_layer_from_connector(layer_name)`` only in its native preprocessing branch.
When ``enable_mlapo`` is on and the batch is small enough, the fused ``mlapo`` branch reads
(and writes) the KV cache without waiting, so a layerwise connector still loading that
layer's blocks races the kernel. vLLM-Ascend 0.19.1rc1 added the wait to that branch; UCM
#911 fixed it for 0.18 by copying the whole method with the wait moved up.

What, without copying the method: wait once at the top of ``forward`` through the SFA
module's own ``wait_for_kv_layer_from_connector`` binding (so ``ascend_hook_bindings``'
gate applies too), then let the branch's own wait for that layer pass as a no-op while the
forward runs (``-dedupe`` record on the same binding). Every branch thus waits exactly once,
before anything touches the cache, whatever the branch condition of the release (it changed
between 0.13.0rc1 and 0.13.0). The source check ``mlapo_no_wait`` confirms the bug in every
covered version in range and its absence from 0.19.1rc1 on.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm_ascend import source_names as c
from ucm_patch.records import PatchRecord, records_from_rows
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper

NAME = "ascend_sfa_wait"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = (
    "The layerwise wait vLLM-Ascend 0.13-0.18 skips in SFA's mlapo branch, done once at "
    "the top of AscendSFAImpl.forward."
)

WHY = (
    "vLLM-Ascend 0.13-0.18 AscendSFAImpl.forward skips wait_for_kv_layer_from_connector in its "
    "mlapo branch, so layerwise loads race the fused kernel. The wrapper waits once at the top "
    "of forward and turns the native branch's second wait for the same layer into a no-op."
)
REMOVAL = (
    "Delete with vLLM-Ascend 0.18 support: 0.19.1rc1 waits in the mlapo branch (UCM #911 "
    "carried the same fix as a copied method)."
)
SFA = "vllm_ascend.attention.sfa_v1"
FORWARD_PARAMS = (
    "self",
    "layer_name",
    "hidden_states",
    "kv_cache",
    "attn_metadata",
    "need_gather_q_kv",
    "output",
)
REQUIRES = ">=0.13,<0.19"

# Layers whose SFA forward already waited (set by the forward wrapper, read by the dedupe
# wrapper on the binding). One forward thread per worker; entries live for one call.
_waited: set[str] = set()


def make_forward_wrapper() -> Wrapper:
    """Wrapper for ``AscendSFAImpl.forward``: wait first, then run the method."""
    namespace = importlib.import_module(SFA).__dict__  # the target module, already imported
    active_connector, argument = layerwise.connector_getter(), layerwise.argument
    waited, wait_name = _waited, c.WAIT

    def sfa_wait_first(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if active_connector() is None:
            return wrapped(*args, **kwargs)
        layer_name = argument(args, kwargs, 0, "layer_name")
        namespace[wait_name](layer_name)  # looked up now: whatever wraps the binding applies
        waited.add(layer_name)
        try:
            return wrapped(*args, **kwargs)
        finally:
            waited.discard(layer_name)

    return sfa_wait_first


def make_dedupe_wrapper() -> Wrapper:
    """Wrapper for ``sfa_v1.wait_for_kv_layer_from_connector``: skip a layer that waited."""
    waited, argument = _waited, layerwise.argument

    def skip_second_wait(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if argument(args, kwargs, 0, "layer_name") in waited:
            return None
        return wrapped(*args, **kwargs)

    return skip_second_wait


_FORWARD = f"{SFA}:AscendSFAImpl.forward"
RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm-ascend",
    "era target make_wrapper upstream expect",
    (
        (
            "ascend-0.13",
            _FORWARD,
            make_forward_wrapper,
            "vLLM-Ascend 0.13.0-0.18.0: the `if self.enable_mlapo and num_input_tokens <= "
            "MLAPO_MAX_SUPPORTED_TOKENS` branch of AscendSFAImpl.forward has no wait "
            "(0.13.0rc1: `enable_mlapo and not has_prefill`); fixed in 0.19.1rc1.",
            (c.signature(_FORWARD, FORWARD_PARAMS), c.mlapo_no_wait(_FORWARD)),
        ),
        (
            "ascend-0.13-dedupe",
            f"{SFA}:{c.WAIT}",
            make_dedupe_wrapper,
            "vLLM-Ascend 0.13.0-0.18.0: the native branch of AscendSFAImpl.forward calls the "
            "by-name binding sfa_v1.wait_for_kv_layer_from_connector(layer_name).",
            (
                c.binding(SFA, c.WAIT),
                c.signature(f"{c.UTILS}:{c.WAIT}", c.WAIT_PARAMS),
                c.mlapo_no_wait(_FORWARD),
            ),
        ),
    ),
    requires=REQUIRES,
    why=WHY,
    removal=REMOVAL,
    retired="vLLM-Ascend 0.19.1rc1 waits in the mlapo branch of AscendSFAImpl.forward itself.",
)
