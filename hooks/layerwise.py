"""The layerwise hook API: the one door between patch wrappers and KV connectors.

Patch wrappers (``ucm_patch.patches``) reach vLLM's *active* KV connector, whatever it is
(ours, LMCache, UCM, vLLM's ExampleConnector), only through this module; they carry no
dump policy. What it offers, all bound at patch-apply time:

* :func:`layer_bracket`: the wrapper for a layer vLLM never hooks (GDN, some MLA paths,
  vLLM-Ascend GDN cores). Gate, ``wait_for_layer_load``, the layer's core,
  ``save_kv_layer``: the call pattern vLLM's ``maybe_transfer_kv_layer`` gives attention.
  Every vLLM and vLLM-Ascend layer patch builds its wrapper here; only *where* the layer,
  its name and its KV cache come from differs (:class:`LayerSite`).
* :func:`kv_ready_wrapper`: the wrapper for a call that writes a layer's KV (or runs
  right after the write): publishes the device event that says "this layer's KV is
  written" (:func:`kv_ready`, one reusable event per layer, :class:`LayerEvents`). Every
  KV-ready patch builds its wrapper here; only where the call names its layer differs
  (:class:`KVReadySite`).
* the active connector, reached one way: vLLM's ``kv_transfer_state`` as :func:`bind`
  bound it, read by the wrappers above and by :func:`connector_getter` (a frame-free
  callable for other wrappers); :func:`idle` reads the same object without binding.
* lookups: :func:`forward_context_holder`,
  :func:`forward_context_getter`, :func:`layer_metadata`, :func:`has_metadata_check`,
  :func:`argument`.

Why these gates: they are exactly the ones vLLM's own ``maybe_transfer_kv_layer``
decorator applies (no v1 KV-transfer group, ``attn_metadata is None`` during profile and
dummy runs, or ``not connector.has_connector_metadata()``), so a GDN layer sees the same
call pattern as an attention layer.

Hot path rules: these run once per layer per step. Nothing here imports, logs or
allocates per call; vLLM modules are bound once by :func:`bind`, and with no connector
active the bracket costs two attribute loads and two compares before the core runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper


class _NoConnector:
    """Stands for ``kv_transfer_state`` where vLLM is not importable: never a connector."""

    _KV_CONNECTOR_AGENT = None


class _NoForwardContext:
    """Stands for vLLM's ``forward_context`` module where vLLM is not importable."""

    _forward_context = None


class _ForwardContextByCall:
    """Stands for the ``forward_context`` module of a vLLM without the
    ``_forward_context`` module global (none of 0.11-0.33 lacks it): reads the context
    through ``get_forward_context``."""

    def __init__(self, getter: Callable[[], Any]) -> None:
        self._getter = getter

    @property
    def _forward_context(self) -> Any:
        return self._getter()


# Bound by bind(); module objects / functions from vLLM. Kept as module globals so the
# hot path reads them with one dict lookup and never imports.
_kv_state: Any = None  # vllm.distributed.kv_transfer.kv_transfer_state
_get_forward_context: Callable[[], Any] | None = None
_forward_context_holder: Any = _NoForwardContext

# Layers whose hooked core is currently running. A layer's entry methods can nest
# (0.33's _forward_core_fused_norm_packed -> _forward_core): the inner call must not
# wait/save a second time, so "exactly once per layer per step" holds.
_inside: set[str] = set()


def _metadata_bound(conn: Any) -> bool:
    """vLLM <= 0.11 fallback: ``has_connector_metadata()`` only exists from 0.12 (UCM
    back-ported it); before that the bound metadata lives in ``_connector_metadata``."""
    return getattr(conn, "_connector_metadata", None) is not None


def _metadata_method(conn: Any) -> bool:
    return bool(conn.has_connector_metadata())


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
    global _kv_state, _get_forward_context, _has_metadata, _forward_context_holder
    if _kv_state is not None:
        return True
    try:
        from vllm import forward_context
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    except ImportError:
        return False
    if not hasattr(KVConnectorBase_V1, "has_connector_metadata"):
        _has_metadata = _metadata_bound
    _get_forward_context = forward_context.get_forward_context
    _forward_context_holder = forward_context_holder()
    _kv_state = kv_transfer_state
    return True


def forward_context_getter() -> Callable[[], Any]:
    """vLLM's ``get_forward_context`` (same module in every supported version)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context


def forward_context_holder() -> Any:
    """An object whose ``_forward_context`` is vLLM's current forward context or None.

    vLLM's ``forward_context`` module itself: ``get_forward_context()`` is
    ``assert _forward_context is not None; return _forward_context`` in every supported
    version (0.11-0.33), so a per-layer wrapper reads the global instead of calling a
    function; None means "outside a forward pass" and the wrapper lets the call through
    untouched.
    """
    from vllm import forward_context

    if hasattr(forward_context, "_forward_context"):
        return forward_context
    return _ForwardContextByCall(forward_context.get_forward_context)


def _connector_probe() -> Any:
    """An object whose ``_KV_CONNECTOR_AGENT`` is vLLM's active connector or None:
    vLLM's ``kv_transfer_state`` module as :func:`bind` bound it, or a stand-in that
    always says None where vLLM is not importable. Read inline by the bracket."""
    return _kv_state if bind() else _NoConnector


def connector_getter() -> Callable[[], Any]:
    """``() -> active connector or None`` that runs no Python frame (C-level ``getattr``
    through ``functools.partial``): for wrappers outside this module that gate per call."""
    return functools.partial(getattr, _connector_probe(), "_KV_CONNECTOR_AGENT")


def has_metadata_check() -> Callable[[Any], bool]:
    """``connector -> bool``: vLLM's "connector metadata is bound this step" gate.

    ``has_connector_metadata()`` from vLLM 0.12; before that the attribute it reads.
    """
    bind()
    return _metadata_method if _has_metadata is None else _has_metadata


_REQUIRED: Any = object()


def argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: int, key: str, default: Any = _REQUIRED
) -> Any:
    """A wrapped call's argument at position ``index`` of wrapt's ``args`` (``self``
    excluded) or, passed by keyword, ``kwargs[key]``; ``default`` when it is absent (else
    ``KeyError``, as the target itself would fail)."""
    if len(args) > index:
        return args[index]
    if default is _REQUIRED:
        return kwargs[key]
    return kwargs.get(key, default)


# Where a layer bracket finds the layer (LayerSite.layer).
LAYER_IS_INSTANCE = "instance"  # wrapt's instance (or args[0] for an unbound copy)
LAYER_ARGUMENT = "argument"  # an argument of the wrapped call is the layer object
LAYER_NAME_ARGUMENT = "name"  # an argument is the layer's *name* (custom-op kernels)

# Which of the layer's caches the connector saves (LayerSite.stage).
STAGE_NONE = "none"  # kv_cache itself (vLLM >= 0.19)
STAGE_VIRTUAL_ENGINE = "virtual_engine"  # kv_cache[forward_context.virtual_engine] (<= 0.18)
STAGE_FIRST = "first"  # kv_cache[0] (vLLM-Ascend cores that index with 0)


def _same_name(layer_name: Any) -> str:
    return layer_name


class _NoLayerName:
    """Matches no object's class: ``LayerSite.name_class`` where no wrapper name exists."""


class LayerSite:
    """Where a wrapped call keeps the layer, its name and its KV cache.

    ``layer``: :data:`LAYER_IS_INSTANCE` (a method of the layer; ``name_attr`` holds its
    name), :data:`LAYER_ARGUMENT` (argument ``index`` / keyword ``key`` is the layer;
    ``name_attr`` holds its name) or :data:`LAYER_NAME_ARGUMENT` (argument ``index`` /
    ``key`` is the layer's name, possibly an instance of ``name_class`` whose ``value`` is
    the string, else turned into one by ``resolve_name``; the layer is looked up in
    ``forward_context.no_compile_layers`` as vLLM's kernels do).

    ``kv_index`` / ``kv_key``: the argument that is the KV cache the core writes, when it
    is passed in (``kv_index < 0``: the layer's ``kv_cache``). ``stage``: which element of
    it belongs to this step (:data:`STAGE_NONE`, :data:`STAGE_VIRTUAL_ENGINE`,
    :data:`STAGE_FIRST`).

    ``wait`` / ``save``: which half of the bracket this site adds. Both by default; a site
    where upstream already makes one of the calls natively (vLLM-Ascend main waits in
    its GDN core itself) adds only the other, so the connector never sees it twice.

    A plain class, not a dataclass: ``dataclasses`` imports ``inspect`` (and ``ast``,
    ``dis``, ``tokenize``), which ``import ucm_patch`` would then pay for at every
    interpreter start.
    """

    __slots__ = (
        "index", "key", "kv_index", "kv_key", "layer", "name_attr", "name_class",
        "resolve_name", "save", "stage", "wait",
    )  # fmt: skip

    def __init__(
        self,
        *,
        layer: str = LAYER_IS_INSTANCE,
        index: int = -1,
        key: str = "layer_name",
        name_attr: str = "prefix",
        name_class: type = _NoLayerName,
        resolve_name: Callable[[Any], str] = _same_name,
        kv_index: int = -1,
        kv_key: str = "kv_cache",
        stage: str = STAGE_NONE,
        wait: bool = True,
        save: bool = True,
    ) -> None:
        layers = (LAYER_IS_INSTANCE, LAYER_ARGUMENT, LAYER_NAME_ARGUMENT)
        if layer not in layers:
            raise ValueError(f"LayerSite.layer={layer!r}; expected one of {layers}")
        if layer != LAYER_IS_INSTANCE and index < 0:
            raise ValueError(f"LayerSite.index={index!r}: layer={layer!r} needs one")
        stages = (STAGE_NONE, STAGE_VIRTUAL_ENGINE, STAGE_FIRST)
        if stage not in stages:
            raise ValueError(f"LayerSite.stage={stage!r}; expected one of {stages}")
        if not (wait or save):
            raise ValueError("LayerSite: wait=False and save=False leave nothing to add")
        self.layer, self.index, self.key, self.name_attr = layer, index, key, name_attr
        self.name_class, self.resolve_name = name_class, resolve_name
        self.kv_index, self.kv_key, self.stage = kv_index, kv_key, stage
        self.wait, self.save = wait, save

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"LayerSite({fields})"


def site_for_hooks(hooks: tuple[str, ...]) -> dict[str, bool]:
    """``LayerSite`` keywords for a record's ``hooks`` (``("save",)`` -> wait=False)."""
    return {"wait": "wait" in hooks, "save": "save" in hooks}


def layer_bracket(site: LayerSite) -> Wrapper:
    """The wrapt wrapper for a layer vLLM never hooks: gate, wait, core, save.

    Per call: with no connector or outside a forward pass the core runs untouched (two
    attribute loads, two compares). Else the gates (nested entry, no metadata for the
    layer in profile / dummy runs, no connector metadata this step),
    ``wait_for_layer_load``, the core, and ``save_kv_layer`` with the cache of
    ``site`` once the core returned normally, spelled out in one frame: on a per-layer
    path each Python call saved counts (``scripts/bench_hooks.py`` measures it).
    """
    probe = _connector_probe()  # binds first: _has_metadata below is final
    holder = _forward_context_holder
    has_metadata = _has_metadata  # None: conn.has_connector_metadata() (0.12+)
    inside, counts, pick = _inside, calls, pick_metadata
    layer_from, index, key, name_attr = site.layer, site.index, site.key, site.name_attr
    name_class, resolve_name = site.name_class, site.resolve_name
    kv_index, kv_key = site.kv_index, site.kv_key
    by_instance = layer_from == LAYER_IS_INSTANCE
    by_name = layer_from == LAYER_NAME_ARGUMENT
    kv_passed = kv_index >= 0
    per_engine, first = site.stage == STAGE_VIRTUAL_ENGINE, site.stage == STAGE_FIRST
    do_wait, do_save = site.wait, site.save

    def layer_wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        conn = probe._KV_CONNECTOR_AGENT
        forward_context = holder._forward_context
        if conn is None or forward_context is None:
            return wrapped(*args, **kwargs)
        if by_instance:
            # vLLM-Ascend copies methods between classes; a copy of an already wrapped
            # method that another wrapper calls as a plain function arrives unbound (wrapt
            # passes instance=None and the layer as the first argument).
            layer = instance if instance is not None else args[0]
            layer_name = getattr(layer, name_attr)
        elif by_name:
            raw = args[index] if len(args) > index else kwargs[key]
            kind = raw.__class__  # LayerName (0.20+ dispatcher) or str, without a call
            if kind is str:
                layer_name = raw
            elif kind is name_class:
                layer_name = raw.value
            else:
                layer_name = resolve_name(raw)
            layer = None
        else:
            layer = args[index] if len(args) > index else kwargs[key]
            layer_name = getattr(layer, name_attr)
        if layer_name in inside:
            counts["skipped_nested"] += 1
            return wrapped(*args, **kwargs)
        all_md = forward_context.attn_metadata
        if all_md.__class__ is dict:
            md = all_md.get(layer_name)
        else:
            md = pick(all_md, layer_name)
        if md is None:
            return wrapped(*args, **kwargs)
        if not (conn.has_connector_metadata() if has_metadata is None else has_metadata(conn)):
            return wrapped(*args, **kwargs)
        inside.add(layer_name)
        try:
            if do_wait:
                counts["wait"] += 1
                conn.wait_for_layer_load(layer_name)
            result = wrapped(*args, **kwargs)
        finally:
            inside.discard(layer_name)
        if not do_save:
            return result
        if kv_passed:
            kv_cache = args[kv_index] if len(args) > kv_index else kwargs[kv_key]
        elif layer is None:
            kv_cache = forward_context.no_compile_layers[layer_name].kv_cache
        else:
            kv_cache = layer.kv_cache
        if per_engine:
            kv_cache = kv_cache[forward_context.virtual_engine]
        elif first:
            kv_cache = kv_cache[0]
        counts["save"] += 1
        conn.save_kv_layer(layer_name, kv_cache, md)
        return result

    return layer_wrapper


class LayerEvents:
    """One reusable device event per layer (or per key), recorded on demand.

    A KV-ready patch records "this layer's KV is written" once per layer per step; the
    event object is created on the first step and re-recorded afterwards, so the steady
    state allocates nothing. The events belong to this cache: whoever reads them (the
    dump scheduler, a connector) borrows them.
    """

    __slots__ = ("_events", "_make_event")

    def __init__(self, make_event: Callable[[], Any]) -> None:
        self._make_event = make_event
        self._events: dict[Any, Any] = {}

    def record(self, key: Any) -> Any:
        """Record ``key``'s event on the current stream and return it."""
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = self._make_event()
        event.record()
        return event


class KVReadySite:
    """Where a KV-writing call (or the call right after the write) names its layer.

    ``index`` / ``key``: the argument that is the layer's name (position in wrapt's
    ``args``, or keyword); ``default``: its value when it is absent (none: the call must
    pass it). ``resolve_name``: the name's string (vLLM's ``LayerName`` wrappers, or
    identity). ``after``: publish once the wrapped call returned (it is the write itself);
    else before it runs (it is the notification or save that follows the write, and must
    already find the event). An empty name names no layer and publishes nothing.
    A plain class, as :class:`LayerSite`.
    """

    __slots__ = ("after", "default", "index", "key", "resolve_name")

    def __init__(
        self,
        *,
        index: int = 0,
        key: str = "layer_name",
        default: Any = _REQUIRED,
        resolve_name: Callable[[Any], str] = _same_name,
        after: bool = False,
    ) -> None:
        self.index, self.key, self.default = index, key, default
        self.resolve_name, self.after = resolve_name, after

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"KVReadySite({fields})"


def kv_ready_wrapper(site: KVReadySite, record: Callable[[str], Any]) -> Wrapper:
    """The wrapt wrapper that publishes "this layer's KV is written" (:func:`kv_ready`)
    around a call described by ``site``: with a connector active and the layer in this
    step's metadata, ``record(layer_name)`` (one reusable event per layer,
    :class:`LayerEvents`) goes to :data:`kv_ready_events` and onto the layer's metadata.
    Every KV-ready patch builds its wrapper here; with no connector the call costs one
    attribute load."""
    probe = _connector_probe()  # binds first: layer_metadata below can read the context
    index, key, default, resolve = site.index, site.key, site.default, site.resolve_name
    required = default is _REQUIRED
    metadata, publish, after = layer_metadata, kv_ready, site.after

    def kv_ready_wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if after:  # the call is the write: publish once it returned
            result = wrapped(*args, **kwargs)
        if probe._KV_CONNECTOR_AGENT is not None:
            if len(args) > index:
                raw = args[index]
            else:
                raw = kwargs[key] if required else kwargs.get(key, default)
            layer_name = resolve(raw)
            if layer_name:
                md = metadata(layer_name)
                if md is not None:
                    publish(layer_name, record(layer_name), md)
        return result if after else wrapped(*args, **kwargs)

    return kv_ready_wrapper


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
    return connector_getter()


#: Read by ucm_patch.guard.make_enabled: a frame-free equivalent of ``not idle()``.
idle.enabled_callable = _connector_getter  # type: ignore[attr-defined]


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
