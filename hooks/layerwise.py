"""Layerwise save/wait entry points: the only functions a patch wrapper calls.

A wrapper placed on a layer that vLLM never hooks (GDN, some MLA ops) brackets the
layer's eager core with::

    md = layerwise.begin(layer_name)          # gate + wait_for_layer_load
    try:
        out = wrapped(*args, **kwargs)
    finally:
        layerwise.end(layer_name)
    if md is not None:
        layerwise.save(layer_name, kv_cache, md)

and a KV-write patch reports the device event that says "this layer's KV is written"
with :func:`kv_ready`. The functions forward to vLLM's *active* KV connector, whatever
it is (ours, LMCache, UCM, vLLM's ExampleConnector): patches carry no dump policy.

Why these gates: they are exactly the ones vLLM's own ``maybe_transfer_kv_layer``
decorator applies (no v1 KV-transfer group, ``attn_metadata is None`` during profile and
dummy runs, or ``not connector.has_connector_metadata()``), so a GDN layer sees the same
call pattern as an attention layer.

Hot path rules: these run once per layer per step. Nothing here imports, logs or
allocates per call; vLLM modules are bound once by :func:`bind` (at patch-apply time),
and with no connector active :func:`begin` costs one attribute load and one compare.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~7 ms)
if TYPE_CHECKING:
    from typing import Any

# Bound by bind(); module objects / functions from vLLM. Kept as module globals so the
# hot path reads them with one dict lookup and never imports.
_kv_state: Any = None  # vllm.distributed.kv_transfer.kv_transfer_state
_get_forward_context: Callable[[], Any] | None = None

# Layers whose hooked core is currently running. A layer's entry methods can nest
# (0.33's _forward_core_fused_norm_packed -> _forward_core): the inner call must not
# wait/save a second time, so "exactly once per layer per step" holds.
_inside: set[str] = set()


def _metadata_bound(conn: Any) -> bool:
    """vLLM <= 0.11 fallback: ``has_connector_metadata()`` only exists from 0.12 (UCM
    back-ported it); before that the bound metadata lives in ``_connector_metadata``."""
    return getattr(conn, "_connector_metadata", None) is not None


# Chosen by bind() for the installed vLLM: None means "call conn.has_connector_metadata()"
# (vLLM 0.12+), spelled inline on the hot path.
_has_metadata: Callable[[Any], bool] | None = None

# layer name -> the last device event recorded right after that layer's KV-cache write
# (kv_ready_event patch set). Borrowed: the hooks never destroy these events; the dump
# scheduler reads them as the preferred event source.
kv_ready_events: dict[str, Any] = {}

# Counters a test or benchmark can read without metrics libraries.
calls: dict[str, int] = {"wait": 0, "save": 0, "kv_ready": 0, "skipped_nested": 0}


def bind() -> bool:
    """Bind vLLM's KV-transfer state and forward context (idempotent, apply time only).

    Returns False when vLLM is not importable; hooks then stay inert (no connector).
    """
    global _kv_state, _get_forward_context, _has_metadata
    if _kv_state is not None:
        return True
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        from vllm.forward_context import get_forward_context
    except ImportError:
        return False
    if not hasattr(KVConnectorBase_V1, "has_connector_metadata"):
        _has_metadata = _metadata_bound
    _get_forward_context = get_forward_context
    _kv_state = kv_transfer_state
    return True


def idle() -> bool:
    """True when no KV connector is active: wrappers are skipped (``skip_when``)."""
    state = _kv_state
    return state is None or state._KV_CONNECTOR_AGENT is None


def _connector_getter() -> Callable[[], Any] | None:
    """``not idle()`` as a callable that runs no Python frame: ``getattr(kv_transfer_state,
    "_KV_CONNECTOR_AGENT")`` through ``functools.partial`` (both C), truthy while a
    connector is active. The registry hands it to wrapt as ``enabled``, which calls it
    on every call of a wrapped target (see :func:`ucm_patch.guard.make_enabled`).
    None before :func:`bind` succeeded."""
    if _kv_state is None:
        return None
    return functools.partial(getattr, _kv_state, "_KV_CONNECTOR_AGENT")


#: Read by ucm_patch.guard.make_enabled: a frame-free equivalent of ``not idle()``.
idle.enabled_callable = _connector_getter  # type: ignore[attr-defined]


def active_connector() -> Any | None:
    """vLLM's active KV connector in this process, or None (one attribute load)."""
    state = _kv_state
    if state is None:
        return None
    return state._KV_CONNECTOR_AGENT


def layer_metadata(layer_name: str) -> Any | None:
    """This layer's attention metadata as vLLM's decorator passes it, or None.

    ``forward_context.attn_metadata`` is None in profile/dummy runs, a dict keyed by layer
    name in V1, and from 0.11 possibly a list of dicts (ubatching, speculative decoding:
    element 0 is the base model's). Older single-object metadata is passed through.
    """
    return pick_metadata(_get_forward_context().attn_metadata, layer_name)  # type: ignore[misc]


def pick_metadata(all_metadata: Any, layer_name: str) -> Any | None:
    """``layer_name``'s entry of ``forward_context.attn_metadata`` (see :func:`layer_metadata`)."""
    md = all_metadata
    if md is None:
        return None
    if isinstance(md, list):
        if not md:
            return None
        md = md[0]
    if isinstance(md, dict):
        return md.get(layer_name)
    return md


def begin(layer_name: str) -> Any | None:
    """Gate and wait before a layer's core runs.

    Returns the layer's metadata to pass to :func:`save` when the connector must see this
    layer, or None when the hooks are skipped. A non-None return obliges the caller to
    call :func:`end` (in a ``finally``) once the core returned.
    """
    state = _kv_state
    if state is None:
        return None
    conn = state._KV_CONNECTOR_AGENT
    if conn is None:
        return None
    return enter(conn, layer_name, _get_forward_context().attn_metadata)  # type: ignore[misc]


def enter(conn: Any, layer_name: str, all_metadata: Any) -> Any | None:
    """:func:`begin` for a wrapper that already holds the active connector ``conn`` and
    ``forward_context.attn_metadata`` (it needs the forward context for the KV cache too):
    one Python call fewer per layer on the connector path. Same gates, same contract."""
    if layer_name in _inside:
        calls["skipped_nested"] += 1
        return None
    md = pick_metadata(all_metadata, layer_name)
    if md is None:
        return None
    if not (conn.has_connector_metadata() if _has_metadata is None else _has_metadata(conn)):
        return None
    _inside.add(layer_name)
    calls["wait"] += 1
    try:
        conn.wait_for_layer_load(layer_name)
    except BaseException:
        _inside.discard(layer_name)
        raise
    return md


def end(layer_name: str) -> None:
    """Mark the layer's core as finished (pairs with a non-None :func:`begin`)."""
    _inside.discard(layer_name)


def wait(layer_name: str) -> None:
    """Forward ``wait_for_layer_load`` to the active connector (no gating besides it)."""
    conn = active_connector()
    if conn is not None:
        calls["wait"] += 1
        conn.wait_for_layer_load(layer_name)


def save(layer_name: str, kv_cache: Any, attn_metadata: Any) -> None:
    """Forward ``save_kv_layer`` for a layer that :func:`begin` let through."""
    conn = active_connector()
    if conn is not None:
        calls["save"] += 1
        conn.save_kv_layer(layer_name, kv_cache, attn_metadata)


def kv_ready(layer_name: str, event: Any, attn_metadata: Any = None) -> None:
    """Publish the event recorded right after ``layer_name``'s KV-cache write.

    The event is borrowed: it belongs to whoever created it. It is kept in
    :data:`kv_ready_events` for the dump scheduler and, like vLLM-Ascend's
    ``reshape_cache_event``, set on the layer's metadata object so that any connector
    that reads that attribute (vLLM-Ascend's Mooncake layerwise connector, UCM #1025)
    finds it.
    """
    calls["kv_ready"] += 1
    kv_ready_events[layer_name] = event
    if attn_metadata is not None:
        try:
            attn_metadata.reshape_cache_event = event
        except AttributeError:
            # Slotted / frozen metadata: the table above still carries the event.
            calls["kv_ready_unattached"] = calls.get("kv_ready_unattached", 0) + 1


def reset_for_tests() -> None:
    """Forget bound state and counters (tests only)."""
    _inside.clear()
    kv_ready_events.clear()
    for key in list(calls):
        calls[key] = 0
