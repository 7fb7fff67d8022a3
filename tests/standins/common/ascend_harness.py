"""Harness for the vLLM-Ascend behaviour scenarios (runs in a child process only).

Real pieces: vLLM 0.32's ``kv_transfer_state`` (the connector is installed as
``_KV_CONNECTOR_AGENT``, which ucm_patch.hooks.layerwise and vLLM-Ascend's hook functions
read), a real ``vllm.forward_context.ForwardContext`` set as the current context, the real
``ucm_patch`` registry. Stand-ins: vllm_ascend (one era folder on sys.path) and torch_npu.

Every connector call is appended to ``torch_npu.LOG`` next to the cache writes and event
records, so one ordered list shows what happened. Objects are reported by *tag*
(:func:`tag`), so a test can assert identity ("the save carried this layer's own cache").
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch_npu
import vllm.forward_context as fc_module
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.forward_context import ForwardContext

from tests.support.standin_connector import Entry, StandInConnector
from ucm_patch.hooks import layerwise
from ucm_patch.registry import Registry

LOG = torch_npu.LOG
_TAGS: dict[int, str] = {}
_KEEP: list[Any] = []


def tag(obj: Any, name: str) -> Any:
    """Name ``obj`` in the report (identity, not equality)."""
    _TAGS[id(obj)] = name
    _KEEP.append(obj)
    return obj


def describe(obj: Any) -> str:
    if id(obj) in _TAGS:
        return _TAGS[id(obj)]
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(describe(o) for o in obj) + "]"
    return type(obj).__name__


def event_for(layer_name: str, md: Any) -> Any:
    """How a connector finds a layer's KV-ready event: ``md[layer].reshape_cache_event``
    (per-layer metadata), else ``md.reshape_cache_event``."""
    if isinstance(md, dict):
        per_layer = md.get(layer_name)
        event = getattr(per_layer, "reshape_cache_event", None)
        if event is not None:
            return event
    return getattr(md, "reshape_cache_event", None)


class ScenarioLog:
    """The stand-in connector's log in the scenarios: its wait / save / notified calls go to
    ``torch_npu.LOG`` with objects described by tag, next to the cache writes and events."""

    def append(self, entry: Entry, /) -> None:
        call = entry[0]
        if call == "save":
            _, layer_name, kv_layer, attn_metadata = entry
            event = event_for(layer_name, attn_metadata)
            LOG.append(
                (
                    "save",
                    layer_name,
                    describe(kv_layer),
                    describe(attn_metadata),
                    getattr(event, "id", None),
                    getattr(event, "recorded_at", None),
                )
            )
        elif call in ("wait", "notified"):
            LOG.append(entry)


def install_connector(with_metadata: bool = True) -> StandInConnector:
    """Make the stand-in connector vLLM's active connector (``_KV_CONNECTOR_AGENT``)."""
    connector = StandInConnector(log=ScenarioLog(), has_metadata=with_metadata)
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    return connector


def set_forward_context(
    attn_metadata: dict[str, Any] | None,
    layers: dict[str, Any] | None = None,
    virtual_engine: int | None = None,
) -> ForwardContext:
    """Make a real ForwardContext current; ``virtual_engine`` adds the <= 0.18 field."""
    ctx = ForwardContext(
        no_compile_layers=layers or {}, attn_metadata=attn_metadata, slot_mapping={}
    )
    if virtual_engine is not None:
        ctx.virtual_engine = virtual_engine  # type: ignore[attr-defined]
    fc_module._forward_context = ctx
    return ctx


def make_layer(cls: type, prefix: str, kv_cache: Any) -> Any:
    """An instance of a (vLLM nn.Module) GDN class without its config-heavy __init__."""
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.prefix = prefix
    layer.kv_cache = kv_cache
    return layer


def gdn_cache(name: str) -> list[torch.Tensor]:
    """``[conv_state, ssm_state]`` tagged ``<name>.conv`` / ``<name>.ssm``."""
    conv = tag(torch.zeros(2, 4), f"{name}.conv")
    ssm = tag(torch.zeros(2, 4), f"{name}.ssm")
    return tag([conv, ssm], name)


def ascend_records(include_vllm_gdn: bool = False) -> list[Any]:
    from ucm_patch.patches import vllm_ascend

    records = [r for ps in vllm_ascend.PATCH_SETS for r in ps.records]
    if include_vllm_gdn:
        from ucm_patch.patches import vllm

        records += [r for ps in vllm.PATCH_SETS for r in ps.records if r.name == "gdn_layerwise"]
    return records


def activate(include_vllm_gdn: bool = False) -> Registry:
    """A registry of the vLLM-Ascend records (and vLLM's GDN ones), activated now.

    ``UCM_SCENARIO_OFF=name,...`` switches logical patches off (the control runs);
    ``UCM_PATCH_ALLOW_UNTESTED`` is passed on (the main-branch runs).
    """
    layerwise.bind()
    off = [n for n in os.environ.get("UCM_SCENARIO_OFF", "").split(",") if n]
    registry = Registry(ascend_records(include_vllm_gdn))
    # Only the opt-in for untested versions reaches the registry from the environment.
    env = {k: v for k, v in os.environ.items() if k == "UCM_PATCH_ALLOW_UNTESTED"}
    registry.activate(patches=dict.fromkeys(off, False), env=env, strict=False)
    return registry


def states(registry: Registry) -> dict[str, str]:
    return {row["id"]: row["state"] for row in registry.report()}


def reasons(registry: Registry) -> dict[str, str]:
    return {row["id"]: row["reason"] for row in registry.report() if row["reason"]}


def eid(event: Any) -> int | None:
    """An event's id (None when there is no event)."""
    return getattr(event, "id", None)


def unwraps_to(obj: Any, target: Any) -> bool:
    """True when ``target`` is reached following ``__wrapped__`` from ``obj`` (wrappers, shims)."""
    for _ in range(16):
        if obj is target:
            return True
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            return False
    return False


def markers(obj: Any) -> list[str]:
    """Record ids of every ucm_patch wrapper on the ``__wrapped__`` chain, outermost first."""
    out = []
    for _ in range(16):
        marker = getattr(obj, "_self_ucm_patch_id", None)
        if marker:
            out.append(marker)
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            break
    return out


def hook_bindings() -> dict[str, list[str]]:
    """Every imported vllm_ascend module's wait/save binding -> the ucm_patch wrappers on it."""
    out: dict[str, list[str]] = {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("vllm_ascend.") or name == "vllm_ascend.attention.utils":
            continue
        for attr in ("wait_for_kv_layer_from_connector", "maybe_save_kv_layer_to_connector"):
            if attr in vars(module):
                out[f"{name}:{attr}"] = markers(vars(module)[attr])
    return out


def finish(result: dict[str, Any], registry: Registry) -> None:
    """Add the end-of-run states, reasons and bindings, then print the result."""
    result["final_states"] = states(registry)
    result["final_reasons"] = reasons(registry)
    result["bindings"] = hook_bindings()
    emit(result)


def take_log() -> list[list[Any]]:
    """The log so far as JSON-able lists; the log is cleared."""
    out = [list(entry) for entry in LOG]
    LOG.clear()
    return out


def emit(result: dict[str, Any]) -> None:
    print("UCM_RESULT " + json.dumps(result, sort_keys=True, default=str))
