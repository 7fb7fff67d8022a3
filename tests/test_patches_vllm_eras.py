"""Each era's wrapper against the signature extracted from that vLLM version's source.

``scripts/data/vllm_signatures.json`` holds, per vLLM wheel, the parameters of every
record's target (read with ``ast`` by scripts/verify_targets.py). For every (record,
version) the matrix marks "applies", these tests rebuild a stand-in target with exactly
that signature, wrap it with the era's wrapper the way the registry does (a wrapt
``FunctionWrapper`` on the class attribute / module function), call it the way that
vLLM version calls it, and check the hooks a connector receives. The version facts the
wrappers depend on come from the same file: ``ForwardContext.virtual_engine`` (KV cache
indexed per pipeline stage up to 0.18) and ``_resolve_layer_name`` (``LayerName`` args).

The connector, forward context and layer are stand-ins (vLLM itself runs in
tests/test_patches_vllm_real.py); everything else is the real wrapper code.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import wrapt

from tests.support.standin_connector import StandInConnector
from tools.verify import vllm as verify_targets
from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import PATCH_SETS, _vllm_compat, kv_ready_event

REPO = Path(__file__).resolve().parent.parent

DATA = json.loads(verify_targets.DATA.read_text())
RECORDS = {r.id: r for ps in PATCH_SETS for r in ps.records}

# How vLLM calls each era's target: GDN ops call the layer method with keywords
# (mixed_qkv=, b=, ...); op kernels are called positionally by the dispatcher; Kimi-K3
# calls its methods positionally.
KEYWORD_CALLS = {"gdn_layerwise"}
OP_LIKE = {"kv_ready_event"}
# Not layer hooks: with a stand-in instance (no KV-cache groups, no mamba align split) the
# call passes straight through (the scheduler patches' behaviour:
# tests/test_hybrid_load_failure.py, tests/test_hybrid_async_load.py).
PASS_THROUGH = {"hybrid_async_load", "hybrid_load_failure"}


class FakeLayerName:
    """Stands in for vLLM's opaque ``LayerName`` op argument (0.20+)."""

    def __init__(self, name: str) -> None:
        self.name = name


def resolve_fake(raw: Any) -> str:
    return raw.name if isinstance(raw, FakeLayerName) else raw


class Metadata:
    """Per-layer attention metadata (a plain object, like vLLM's dataclasses)."""


class World:
    """A forward context with one layer, a connector and a call log."""

    def __init__(self, name: str, virtual_engine: bool) -> None:
        self.name = name
        self.log: list[tuple[Any, ...]] = []
        self.md = Metadata()
        self.conv, self.ssm = object(), object()
        own = [self.conv, self.ssm]
        # Up to 0.18 a layer's kv_cache is a per-pipeline-stage list; stage 1 is current.
        self.expected_kv = own
        kv_cache = [[object(), object()], own] if virtual_engine else own
        self.layer = types.SimpleNamespace(prefix=name, layer_name=name, kv_cache=kv_cache)
        self.fc = types.SimpleNamespace(
            attn_metadata={name: self.md},
            no_compile_layers={name: self.layer},
            virtual_engine=1,
        )
        self.connector = StandInConnector(log=self.log)


def cases() -> list[tuple[str, str]]:
    out = []
    for key, facts in DATA["versions"].items():
        for rid, rec in RECORDS.items():
            if verify_targets.verdict(rec, facts)[0] == verify_targets.APPLIES:
                out.append((rid, key))
    return out


def _install(monkeypatch: pytest.MonkeyPatch, world: World, facts: dict[str, Any]) -> None:
    monkeypatch.setattr(
        layerwise, "_kv_state", types.SimpleNamespace(_KV_CONNECTOR_AGENT=world.connector)
    )
    monkeypatch.setattr(layerwise, "_get_forward_context", lambda: world.fc)
    monkeypatch.setattr(
        layerwise, "_forward_context_holder", types.SimpleNamespace(_forward_context=world.fc)
    )
    monkeypatch.setattr(
        _vllm_compat, "has_virtual_engine", lambda: facts["forward_context_virtual_engine"]
    )
    resolver = resolve_fake if facts["resolve_layer_name"] else _vllm_compat._identity_name
    monkeypatch.setattr(_vllm_compat, "layer_name_resolver", lambda: resolver)
    monkeypatch.setattr(kv_ready_event, "event_recorder", lambda: lambda name: ("event", name))
    layerwise.reset_for_tests()


def _stand_in(params: list[str], log: list[tuple[Any, ...]]) -> Any:
    """A function with exactly ``params`` that logs its call and returns a marker."""
    plain = [p for p in params if not p.startswith("*")]
    sig = ", ".join(params)
    src = f"def target({sig}):\n    _log.append(('core',))\n    return 'result'\n"
    scope: dict[str, Any] = {"_log": log}
    exec(compile(src, "<stand-in>", "exec"), scope)
    fn = scope["target"]
    fn.plain_params = plain
    return fn


@pytest.mark.parametrize(("record_id", "version"), cases())
def test_era_wrapper_on_extracted_signature(monkeypatch, record_id, version):
    record = RECORDS[record_id]
    facts = DATA["versions"][version]
    params = facts["targets"][record.target]["params"]
    name = "model.layers.0.linear_attn"
    world = World(name, facts["forward_context_virtual_engine"])
    _install(monkeypatch, world, facts)

    fn = _stand_in(params, world.log)
    wrapper = record.make_wrapper()
    if params[0] == "cls":  # a classmethod (a config patch, no layer hooks): as installed
        attr = record.qualname.rsplit(".", 1)[1]
        # wrapt binds a classmethod with the class as ``instance`` and the rest as ``args``,
        # as the installer's guarded classmethod does.
        klass = type("Target", (), {attr: wrapt.FunctionWrapper(classmethod(fn), wrapper)})
        assert getattr(klass(), attr)(*[object() for _ in fn.plain_params[1:]]) == "result"
        assert not record.hooks and world.log == [("core",)]  # passed through, no hooks
        return
    is_method = params[0] == "self"
    values: dict[str, Any] = {p: object() for p in fn.plain_params}
    if "layer_name" in values:
        values["layer_name"] = FakeLayerName(name) if facts["resolve_layer_name"] else name
    if "layer" in values:  # Kimi-K3 AMD _fused_decode: the attention layer is an argument
        values["layer"] = world.layer
        values["kv_cache"] = world.expected_kv

    if is_method:
        attr = record.qualname.rsplit(".", 1)[1]
        klass = type("Layer", (), {attr: wrapt.FunctionWrapper(fn, wrapper)})
        inst = klass()
        if "layer" not in values:  # the instance is the layer that owns the cache
            vars(inst).update(vars(world.layer))
            world.fc.no_compile_layers[name] = inst
        args = [values[p] for p in fn.plain_params[1:]]
        bound = getattr(inst, attr)
        if record.name in KEYWORD_CALLS:
            result = bound(**dict(zip(fn.plain_params[1:], args, strict=True)))
        else:
            result = bound(*args)
    else:
        result = wrapt.FunctionWrapper(fn, wrapper)(*[values[p] for p in fn.plain_params])

    assert result == "result"
    if record.name in PASS_THROUGH:
        assert world.log == [("core",)]
        return
    if record.name in OP_LIKE:
        assert world.log == [("core",)]
        assert layerwise.kv_ready_events[name] == ("event", name)
        assert world.md.reshape_cache_event == ("event", name)
        return
    assert [entry[0] for entry in world.log] == ["wait", "core", "save"], world.log
    assert world.log[0] == ("wait", name)
    _, saved_name, saved_kv, saved_md = world.log[2]
    assert saved_name == name
    assert saved_md is world.md
    if isinstance(saved_kv, list):
        assert saved_kv == world.expected_kv and all(
            a is b for a, b in zip(saved_kv, world.expected_kv, strict=True)
        )
    else:
        assert saved_kv is world.expected_kv
    assert not layerwise._inside


def test_every_era_has_a_case():
    """Each record applies to at least one extracted version (else its range is wrong)."""
    covered = {rid for rid, _ in cases()}
    assert covered == set(RECORDS), sorted(set(RECORDS) - covered)
