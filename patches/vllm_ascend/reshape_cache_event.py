"""``reshape_cache_event``: the NPU event "this layer's KV cache is written", where missing.

Why: a layerwise dump must not read a layer's KV blocks before the NPU wrote them.
vLLM-Ascend's answer is ``reshape_cache_event`` (PR #5303, v0.13.0rc2): a ``torch.npu.Event``
recorded right after the cache write and stored on the layer's metadata, where its
Mooncake layerwise connector and UCM #1025 read it: first
``attn_metadata[layer_name].reshape_cache_event``, then ``attn_metadata.reshape_cache_event``.
But vLLM-Ascend only records it for some roles and versions:

=============  ==========================================================================
vLLM-Ascend    upstream ``reshape_cache_event``
=============  ==========================================================================
0.13 - 0.22    attention (``AscendAttentionBackendImpl.reshape_and_cache``, the C8 and
               the CP variant, which records none before 0.15) and SFA: only
               ``if self.is_kv_producer``; MLA (``_mla_preprocess``): ``is_kv_producer``
               (0.13 - 0.17), ``is_kv_producer and not is_kv_both`` (0.18 - 0.22), so a
               ``kv_both`` MLA layer has none.
0.23 - 0.25    attention / MLA / DSA create none (PR #11444 replaced it with
               ``notify_kv_cache_written``); SFA still does for producers.
=============  ==========================================================================

What: wrap the method that writes the cache and, when it returns, record an event *unless
upstream created one in that same call* (it assigns a new ``torch.npu.Event()`` object;
identity before/after the call tells, whatever the role or version logic). The event goes on
the metadata object the method received: for attention that is ``attn_metadata`` (the
object vLLM passes to ``save_kv_layer``), for MLA and DSA the per-layer metadata
``forward_context.attn_metadata[layer_name]``; where the layer name is known it is also
published through :func:`ucm_patch.hooks.layerwise.kv_ready`. From 0.23 MLA and DSA
announce each write with ``notify_kv_cache_written(layer_name)`` (DSA writes in
``_forward_prefill`` / ``_forward_decode``): those bindings are wrapped to record right
there, before the connector hears of it. Attention's ``notify_kv_cache_written()`` carries
no layer name; there the event is recorded when ``reshape_and_cache`` returns.

Not covered: SFA writes inline in ``forward`` and records natively for producers in every
version; a non-producer has no hook point between the write and the save, where the dump
scheduler's current-stream fallback is equivalent. vLLM-Ascend 0.11 has no
``reshape_and_cache`` method (the write is inline) and no ``reshape_cache_event`` field.

Events: one ``torch.npu.Event`` per layer (per attention impl where the layer name is not
known), created on first use and re-recorded every step, so the per-layer path does not
allocate. A consumer waiting on a re-recorded event waits at most for the newer write.
The events belong to this module: consumers borrow them and never destroy them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm_ascend import _npu
from ucm_patch.patches.vllm_ascend import source_names as c
from ucm_patch.records import PatchRecord, records_from_rows
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper

NAME = "reshape_cache_event"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = (
    "torch.npu.Event recorded right after each layer's KV-cache write where vLLM-Ascend "
    "records none (non-producers, kv_both MLA, everything from 0.23), stored on the "
    "layer's metadata as reshape_cache_event."
)

WHY = (
    "A layerwise dump must wait for the layer's KV-cache write before reading it. "
    "vLLM-Ascend records reshape_cache_event only for kv_producer (attention, SFA), only for "
    "producers that are not kv_both (MLA 0.18-0.22), and not at all from 0.23 (attention, "
    "MLA, DSA). The wrapper records a torch.npu.Event right after the write when upstream "
    "did not, and stores it where connectors read it."
)
REMOVAL = (
    "Delete when vLLM-Ascend records a per-layer KV-written event for every role again, or "
    "when connectors implement on_kv_cache_written (vllm-ascend PR #11444, 0.23) instead of "
    "reading reshape_cache_event."
)

PARAMS_013 = ("self", "key", "value", "kv_cache", "attn_metadata")
PARAMS_016 = ("self", "query", "key", "value", "kv_cache", "attn_metadata", "output")
MLA_PARAMS = (
    "self",
    "layer_name",
    "hidden_states",
    "kv_cache",
    "attn_metadata",
    "need_gather_q_kv",
)
NOTIFY_PARAMS = ("layer_name",)


def make_method_wrapper(params: tuple[str, ...], by_layer_name: bool) -> Wrapper:
    """Wrapper for a method ``params`` that writes the KV cache of ``attn_metadata``.

    ``by_layer_name``: the method's ``layer_name`` argument names the layer (MLA); else the
    impl instance stands for the layer and the write happens only when ``len(kv_cache) > 1``
    (attention's own condition).
    """
    record = layerwise.LayerEvents(_npu.event_class()).record
    md_i = c.arg_index(params, "attn_metadata")
    kv_i = c.arg_index(params, "kv_cache")
    name_i = c.arg_index(params, "layer_name") if by_layer_name else -1
    active_connector, kv_ready = layerwise.connector_getter(), layerwise.kv_ready
    argument = layerwise.argument

    def reshape_cache_event_wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if active_connector() is None:
            return wrapped(*args, **kwargs)
        md = argument(args, kwargs, md_i, "attn_metadata", None)
        if md is None:
            return wrapped(*args, **kwargs)
        before = getattr(md, "reshape_cache_event", None)
        result = wrapped(*args, **kwargs)
        if md.reshape_cache_event is not before:
            return result  # upstream created and recorded its own event in this call
        if name_i < 0:
            if len(argument(args, kwargs, kv_i, "kv_cache")) <= 1:
                return result  # attention writes only when it has (key_cache, value_cache)
            key: Any = id(instance)
        else:
            key = argument(args, kwargs, name_i, "layer_name")
        event = record(key)
        if name_i < 0:
            md.reshape_cache_event = event
        else:
            kv_ready(key, event, md)
        return result

    return reshape_cache_event_wrapper


def make_notify_wrapper() -> Wrapper:
    """Wrapper for a module's ``notify_kv_cache_written(layer_name="")`` binding (MLA / DSA, 0.23+).

    Records the layer's event and stores it on its per-layer metadata *before* the
    notification goes out, so a connector's ``on_kv_cache_written`` already finds it (an
    empty name, the default, names no layer).
    """
    site = layerwise.KVReadySite(index=0, default="")
    return layerwise.kv_ready_wrapper(site, layerwise.LayerEvents(_npu.event_class()).record)


_ATTN = "vllm_ascend.attention.attention_v1"
_CP = "vllm_ascend.attention.context_parallel.attention_cp"
_MLA = "vllm_ascend.attention.mla_v1"
_DSA = "vllm_ascend.attention.dsa_v1"
_DSA_CP = "vllm_ascend.attention.context_parallel.dsa_cp"


# (era, target, its parameters, requires, upstream) of every method that writes the KV cache
_WRITERS: tuple[tuple[str, str, tuple[str, ...], str, str], ...] = (
    (
        "ascend-0.13",
        f"{_ATTN}:AscendAttentionBackendImpl.reshape_and_cache",
        PARAMS_013,
        ">=0.13,<0.16",
        "vLLM-Ascend 0.12.0rc1-0.15: reshape_and_cache(key, value, kv_cache, attn_metadata); "
        "event only if self.is_kv_producer (PR #5303, from 0.13.0rc2).",
    ),
    (
        "ascend-0.16",
        f"{_ATTN}:AscendAttentionBackendImpl.reshape_and_cache",
        PARAMS_016,
        ">=0.16,<0.26",
        "vLLM-Ascend 0.16.0rc1-0.25.1rc1: reshape_and_cache(query, key, value, kv_cache, "
        "attn_metadata, output); event only if self.is_kv_producer up to 0.22.1rc1, none from "
        "0.23.0rc1 (PR #11444: notify_kv_cache_written instead).",
    ),
    (
        "ascend-0.13-cp",
        f"{_CP}:AscendAttentionCPImpl.reshape_and_cache",
        PARAMS_013,
        ">=0.13,<0.16",
        "vLLM-Ascend 0.13-0.15: the context-parallel impl overrides reshape_and_cache; no "
        "event before 0.15.0rc1, then only for producers.",
    ),
    (
        "ascend-0.16-cp",
        f"{_CP}:AscendAttentionCPImpl.reshape_and_cache",
        PARAMS_016,
        ">=0.16,<0.25",
        "vLLM-Ascend 0.16-0.24: context-parallel reshape_and_cache override; event only for "
        "producers (0.16-0.22), none from 0.23; 0.25.1rc1 drops the override (the base "
        "method, wrapped above, runs).",
    ),
    (
        "ascend-0.21-c8",
        f"{_ATTN}:AscendC8AttentionBackendImpl._reshape_and_cache",
        PARAMS_016,
        ">=0.21,<0.26",
        "vLLM-Ascend 0.21.0rc1-0.25: the INT8 KV-cache impl writes in _reshape_and_cache; "
        "event only for producers (0.21-0.22), none from 0.23.",
    ),
    (
        "ascend-0.13-mla",
        f"{_MLA}:AscendMLAImpl._mla_preprocess",
        MLA_PARAMS,
        ">=0.13,<0.26",
        "vLLM-Ascend 0.13-0.25: MLA writes its latent KV in _mla_preprocess; event only if "
        "is_kv_producer (0.13-0.17; 0.13 on prefill only), is_kv_producer and not is_kv_both "
        "(0.18-0.22), none from 0.23 (notify_kv_cache_written(layer_name) instead).",
    ),
)

# (era, module, requires, upstream) of every by-name binding of notify_kv_cache_written
_NOTIFIERS: tuple[tuple[str, str, str, str], ...] = (
    (
        "ascend-0.23-mla",
        _MLA,
        ">=0.23,<0.26",
        "vLLM-Ascend 0.23+: AscendMLAImpl._mla_preprocess ends with "
        "notify_kv_cache_written(layer_name); recording here puts the event on the metadata "
        "before the notification (the _mla_preprocess record then sees it and stands aside).",
    ),
    (
        "ascend-0.23-dsa",
        _DSA,
        ">=0.23,<0.26",
        "vLLM-Ascend 0.23-0.25: AscendDSAImpl._forward_prefill / _forward_decode call "
        "notify_kv_cache_written(layer_name) after each KV write; no event is created.",
    ),
    (
        "ascend-0.23-dsa-cp",
        _DSA_CP,
        ">=0.23,<0.26",
        "vLLM-Ascend 0.23-0.25: the context-parallel DSA impl (_forward) calls "
        "notify_kv_cache_written(layer_name) after its KV write.",
    ),
)

RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm-ascend",
    "era target make_wrapper requires upstream expect",
    (
        *(
            (
                era,
                target,
                functools.partial(make_method_wrapper, params, "layer_name" in params),
                requires,
                upstream,
                (c.signature(target, params), c.marks_write(target)),
            )
            for era, target, params, requires, upstream in _WRITERS
        ),
        *(
            (
                era,
                f"{module}:{c.NOTIFY}",
                make_notify_wrapper,
                requires,
                upstream,
                (c.binding(module, c.NOTIFY), c.signature(f"{c.UTILS}:{c.NOTIFY}", NOTIFY_PARAMS)),
            )
            for era, module, requires, upstream in _NOTIFIERS
        ),
    ),
    why=WHY,
    removal=REMOVAL,
)
