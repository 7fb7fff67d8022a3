"""``kv_ready_event`` (opt-in): a device event recorded right after a layer's KV write.

Why: a layerwise dump must not read a layer's KV blocks before the device has written
them. Without a marker the dumper either synchronizes the whole device or records a
current-stream event at save time (later than needed). vLLM-Ascend solves this with
``reshape_cache_event`` (PR #5303, v0.13.0rc2 - v0.22.1rc1): an NPU event recorded right
after ``reshape_and_cache``, read by its layerwise connector from the layer's metadata
(UCM #1025 consumes it). This patch gives vLLM the same contract: the event is published
with :func:`ucm_patch.hooks.layerwise.kv_ready`, which keeps it in ``kv_ready_events``
and sets it as ``attn_metadata.reshape_cache_event`` on the metadata object vLLM then
passes to that layer's ``save_kv_layer``.

Where the KV cache is written, by version:

* 0.11: inside the backend's forward, which vLLM's ``unified_attention*`` calls right
  before the module-global ``maybe_save_kv_layer_to_connector`` (looked up at call time).
  The event is recorded at the start of that save hook: after the write, before the save.
* 0.15.1+: backends with ``forward_includes_kv_cache_update = False`` (CPU, FlashAttention,
  Triton, FlashInfer ... on 0.32) write in the op ``vllm::unified_kv_cache_update``, MLA in
  ``vllm::unified_mla_kv_cache_update`` (0.18+). Their kernels are overridden. On 0.32 CPU
  ``CPUAttentionBackendImpl.do_kv_cache_update`` runs inside ``unified_kv_cache_update``
  (tests/test_patches_vllm_real.py proves the wrapper fires there).
* With the RoPE(+QK-norm)+KV-write fusion passes on (0.17.1+, mostly ROCm), fused ops
  replace ``unified_kv_cache_update`` in the graph; their kernels are overridden too.
* Backends that still write inside ``forward`` on 0.16+ get no event from this patch; the
  dumper keeps its fallback (current-stream event at save time), exact there because the
  write sits in the attention op vLLM saves right after. Every write site of 0.33 and why it
  is or is not covered: scripts/survey_kv_writes.py, docs/PATCHES.md "KV-cache write survey".

Event: CUDA / XPU / NPU ``torch.<device>.Event`` recorded on the current stream; CPU: a
shared event that is always ready (the write is synchronous). One event per layer is
created on first use and re-recorded every step, so the hot path does not allocate; a
consumer that waits on a re-recorded event waits at most for the newer write, never less.
The events stay owned by this module: consumers borrow them and must not destroy them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import _vllm_compat
from ucm_patch.records import Kind, PatchRecord, records_from_rows
from ucm_patch.source_checks import arg_index, leading
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper

NAME = "kv_ready_event"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = "Opt-in device event recorded right after each layer's KV-cache write."

WHY = (
    "Lets a layerwise dump wait on a device event recorded right after the layer's KV-cache "
    "write instead of synchronizing the device (same contract as vLLM-Ascend's "
    "reshape_cache_event). Opt-in: it records one event per layer per step."
)
REMOVAL = (
    "Delete when vLLM exposes a per-layer 'KV written' event or connector callback "
    "(vllm-ascend has notify_kv_cache_written since v0.23.0rc1, PR #11444; vLLM has none "
    "as of 0.33)."
)


class ReadyEvent:
    """An event that is always complete: the CPU backends write the KV cache synchronously.

    Mirrors the torch event methods a consumer calls (``query``, ``synchronize``,
    ``wait``, ``record``), so a dumper needs no CPU special case.
    """

    __slots__ = ()
    device_type = "cpu"

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None

    def __repr__(self) -> str:
        return "ReadyEvent()"


ALWAYS_READY = ReadyEvent()


def event_recorder() -> Callable[[str], Any]:
    """``record(layer_name) -> event`` for the platform, chosen once at apply time."""
    from vllm.platforms import current_platform

    device_type = current_platform.device_type
    if device_type == "cpu":
        return _record_cpu
    import torch

    event_cls = getattr(getattr(torch, device_type, None), "Event", None)
    if event_cls is None:
        raise RuntimeError(
            f"kv_ready_event: torch.{device_type}.Event does not exist "
            f"(current_platform.device_type={device_type!r})"
        )
    return layerwise.LayerEvents(event_cls).record


def _record_cpu(layer_name: str) -> Any:
    return ALWAYS_READY


def make_kv_update_wrapper(layer_name_index: int) -> Wrapper:
    """Wrapper for a KV-write op kernel whose ``layer_name`` is positional ``layer_name_index``.

    ``unified_kv_cache_update(key, value, layer_name)`` and
    ``unified_mla_kv_cache_update(kv_c_normed, k_pe, layer_name, ...)``: index 2. Publishes
    once the kernel wrote the KV.
    """
    site = layerwise.KVReadySite(
        index=layer_name_index, resolve_name=_vllm_compat.layer_name_resolver(), after=True
    )
    return layerwise.kv_ready_wrapper(site, event_recorder())


def make_save_hook_wrapper() -> Wrapper:
    """Wrapper for vLLM <= 0.11 ``maybe_save_kv_layer_to_connector(layer_name, kv_cache_layer)``.

    Runs right after the backend forward wrote the layer's KV: record, publish, then let
    vLLM's own save hook pass the same metadata object to ``save_kv_layer``.
    """
    return layerwise.kv_ready_wrapper(layerwise.KVReadySite(index=0), event_recorder())


_ATTN_016 = "vllm.model_executor.layers.attention.attention"
_MLA_016 = "vllm.model_executor.layers.attention.mla_attention"
_FUSION = "vllm.compilation.passes.fusion"
_FUSED_WHY = (
    " When the compile pass fuses RoPE (and QK-norm) with the KV write, this fused op "
    "replaces unified_kv_cache_update in the graph (fuse_rope_kvcache and friends, mostly "
    "ROCm), so its kernel must publish the event too."
)


# (era, target, op, leading parameters of the target, requires, upstream) of every op
# kernel that writes a layer's KV cache; the wrapper reads ``layer_name`` where the
# parameters say (the dispatcher passes it positionally).
_KV_UPDATES: tuple[tuple[str, str, str, tuple[str, ...], str, str], ...] = (
    (
        "vllm-0.15",
        "vllm.attention.layer:unified_kv_cache_update",
        "vllm::unified_kv_cache_update",
        ("key", "value", "layer_name"),
        ">=0.15.1,<0.16",
        "vLLM 0.15.1: the KV write moved out of the backend forward into the op "
        "unified_kv_cache_update(key, value, layer_name) (vllm/attention/layer.py).",
    ),
    (
        "vllm-0.16",
        f"{_ATTN_016}:unified_kv_cache_update",
        "vllm::unified_kv_cache_update",
        ("key", "value", "layer_name"),
        ">=0.16,<0.34",
        "vLLM 0.16-0.33: unified_kv_cache_update in model_executor/layers/attention/"
        "attention.py; layer_name may be a LayerName from 0.20.",
    ),
    (
        "vllm-0.17-mla",
        f"{_MLA_016}:unified_mla_kv_cache_update",
        "vllm::unified_mla_kv_cache_update",
        ("kv_c_normed", "k_pe", "layer_name"),
        ">=0.17.1,<0.34",
        "vLLM 0.17.1-0.33 (absent in 0.16.0): MLA writes its latent KV in the op "
        "unified_mla_kv_cache_update(kv_c_normed, k_pe, layer_name, ...).",
    ),
    (
        "vllm-0.17-rope-fused",
        f"{_FUSION}.rope_kvcache_fusion:fused_rope_and_unified_kv_cache_update_impl",
        "vllm::fused_rope_and_unified_kv_cache_update",
        (
            "query",
            "key",
            "value",
            "positions",
            "cos_sin_cache",
            "is_neox",
            "layer_name",
        ),
        ">=0.17.1,<0.34",
        "vLLM 0.17.1-0.33: compilation/passes/fusion/rope_kvcache_fusion.py." + _FUSED_WHY,
    ),
    (
        "vllm-0.26-qk-norm-rope-fused",
        f"{_FUSION}.qk_norm_rope_kvcache_fusion:fused_qk_norm_rope_and_unified_kv_cache_update_impl",
        "vllm::fused_qk_norm_rope_and_unified_kv_cache_update",
        (
            "q_out",
            "k_out",
            "qkv",
            "positions",
            "q_weight",
            "k_weight",
            "rms_norm_eps",
            "cos_sin_cache",
            "is_neox",
            "layer_name",
        ),
        ">=0.26,<0.34",
        "vLLM 0.26-0.33: compilation/passes/fusion/qk_norm_rope_kvcache_fusion.py." + _FUSED_WHY,
    ),
    (
        "vllm-0.31-qk-norm-mrope-fused",
        f"{_FUSION}.qk_norm_rope_kvcache_fusion:fused_qk_norm_mrope_and_unified_kv_cache_update_impl",
        "vllm::fused_qk_norm_mrope_and_unified_kv_cache_update",
        (
            "q_out",
            "qkv",
            "positions",
            "q_weight",
            "k_weight",
            "rms_norm_eps",
            "cos_sin_cache",
            "is_neox",
            "mrope_section_t",
            "mrope_section_h",
            "mrope_section_w",
            "is_interleaved",
            "rotary_dim",
            "layer_name",
        ),
        ">=0.31,<0.34",
        "vLLM 0.31-0.33: the M-RoPE variant in qk_norm_rope_kvcache_fusion.py." + _FUSED_WHY,
    ),
    (
        "vllm-0.22-mla-rope-fused",
        f"{_FUSION}.mla_rope_kvcache_cat_fusion:fused_rope_unified_mla_kv_cache_update_impl",
        "vllm::fused_rope_unified_mla_kv_cache_update",
        (
            "positions",
            "q_pe",
            "k_pe",
            "kv_c",
            "cos_sin_cache",
            "is_neox",
            "kv_cache_dtype",
            "kv_cache_scale",
            "layer_name",
        ),
        ">=0.22.1,<0.34",
        "vLLM 0.22.1-0.33: compilation/passes/fusion/mla_rope_kvcache_cat_fusion.py (MLA)."
        + _FUSED_WHY,
    ),
)

RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm",
    "era target requires make_wrapper upstream expect",
    (
        (
            "vllm-0.11",
            "vllm.attention.layer:maybe_save_kv_layer_to_connector",
            ">=0.11,<0.12",
            make_save_hook_wrapper,
            "vLLM 0.9.2-0.11.x: the KV write is inside the backend forward; "
            "unified_attention(_with_output) then calls the module-global "
            "maybe_save_kv_layer_to_connector (removed in 0.12 by vLLM PR #27816).",
            (leading(("layer_name", "kv_cache_layer")),),
        ),
        *(
            (
                era,
                target,
                requires,
                functools.partial(make_kv_update_wrapper, arg_index(params, "layer_name")),
                upstream,
                (leading(params),),
                {"kind": Kind.OP_KERNEL, "op": op, "dispatch_key": _vllm_compat.DISPATCH_KEY},
            )
            for era, target, op, params, requires, upstream in _KV_UPDATES
        ),
    ),
    skip_when=layerwise.idle,
    why=WHY,
    removal=REMOVAL,
    default=False,
)
