"""Gates and edge cases of the vLLM wrappers (called directly, with stand-in vLLM state).

The per-era behaviour on each version's real signature is in test_patches_vllm_eras.py;
real vLLM runs are in test_patches_vllm_real.py. Here: what must *not* happen (hooks
without a connector, in profile runs, without connector metadata, twice when entry
methods nest, a save after a failed core) and the KV-ready event plumbing.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import wrapt

from tests.support.standin_connector import StandInConnector as Connector
from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import _layer_hooks, _vllm_compat, kv_ready_event, mla_bypass

NAME = "model.layers.0.linear_attn"


class Md:
    pass


@pytest.fixture
def world(monkeypatch):
    """A forward context with one GDN-like layer; the connector is set per test."""
    md = Md()
    state = types.SimpleNamespace(_KV_CONNECTOR_AGENT=None)
    fc = types.SimpleNamespace(attn_metadata={NAME: md}, no_compile_layers={}, virtual_engine=0)
    monkeypatch.setattr(layerwise, "_kv_state", state)
    monkeypatch.setattr(layerwise, "_get_forward_context", lambda: fc)
    monkeypatch.setattr(
        layerwise, "_forward_context_holder", types.SimpleNamespace(_forward_context=fc)
    )
    monkeypatch.setattr(_vllm_compat, "has_virtual_engine", lambda: False)
    monkeypatch.setattr(_vllm_compat, "layer_name_resolver", lambda: _vllm_compat._identity_name)
    layerwise.reset_for_tests()
    w = types.SimpleNamespace(state=state, fc=fc, md=md, log=[])
    yield w
    layerwise.reset_for_tests()


def gdn_layer_class(log: list[tuple[Any, ...]], fail: bool = False) -> type:
    """A class shaped like QwenGatedDeltaNetAttention: _forward_core_rocm may call _forward_core."""

    class Layer:
        def __init__(self) -> None:
            self.prefix = NAME
            self.kv_cache = [torch.zeros(1), torch.zeros(2)]

        def _forward_core(self, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> str:
            log.append(("core",))
            if fail:
                raise RuntimeError("kernel failed")
            return "out"

        def _forward_core_rocm(self, qkvz: Any, ba: Any, z_out: Any, core_attn_out: Any) -> str:
            log.append(("rocm",))
            return self._forward_core(mixed_qkv=qkvz, b=ba, a=z_out, core_attn_out=core_attn_out)

    for attr in ("_forward_core", "_forward_core_rocm"):
        setattr(
            Layer,
            attr,
            wrapt.FunctionWrapper(vars(Layer)[attr], _layer_hooks.make_method_wrapper()),
        )
    return Layer


def call_core(layer: Any) -> Any:
    return layer._forward_core(mixed_qkv=1, b=2, a=3, core_attn_out=4)


def test_no_connector_runs_core_without_hooks(world):
    layer = gdn_layer_class(world.log)()
    assert call_core(layer) == "out"
    assert world.log == [("core",)]
    assert layerwise.calls["wait"] == layerwise.calls["save"] == 0


@pytest.mark.parametrize("why", ["profile_run", "layer_missing", "no_connector_metadata"])
def test_gates_skip_hooks(world, why):
    conn = Connector(has_metadata=why != "no_connector_metadata")
    world.state._KV_CONNECTOR_AGENT = conn
    if why == "profile_run":
        world.fc.attn_metadata = None
    elif why == "layer_missing":
        world.fc.attn_metadata = {"model.layers.1.self_attn.attn": Md()}
    layer = gdn_layer_class(world.log)()
    assert call_core(layer) == "out"
    assert conn.log == []
    assert world.log == [("core",)]


def test_hooks_bracket_core_with_layer_cache(world):
    conn = Connector()
    world.state._KV_CONNECTOR_AGENT = conn
    layer = gdn_layer_class(conn.log)()
    assert call_core(layer) == "out"
    assert [e[0] for e in conn.log] == ["wait", "core", "save"]
    _, name, kv, md = conn.log[2]
    assert name == NAME and md is world.md
    assert kv is layer.kv_cache  # [conv_state, ssm_state], the layer's own list


def test_nested_entry_methods_fire_once(world):
    conn = Connector()
    world.state._KV_CONNECTOR_AGENT = conn
    layer = gdn_layer_class(conn.log)()
    assert layer._forward_core_rocm(qkvz=1, ba=2, z_out=3, core_attn_out=4) == "out"
    assert [e[0] for e in conn.log] == ["wait", "rocm", "core", "save"]
    assert layerwise.calls["skipped_nested"] == 1
    assert not layerwise._inside


def test_failed_core_ends_layer_and_does_not_save(world):
    conn = Connector()
    world.state._KV_CONNECTOR_AGENT = conn
    layer = gdn_layer_class(conn.log, fail=True)()
    with pytest.raises(RuntimeError, match="kernel failed"):
        call_core(layer)
    assert [e[0] for e in conn.log] == ["wait", "core"]
    assert not layerwise._inside  # the next step can hook this layer again
    conn.log.clear()
    with pytest.raises(RuntimeError):
        call_core(layer)
    assert [e[0] for e in conn.log] == ["wait", "core"]


def test_op_wrapper_resolves_layer_and_accepts_keyword_name(world, monkeypatch):
    conn = Connector()
    world.state._KV_CONNECTOR_AGENT = conn
    layer = types.SimpleNamespace(prefix=NAME, kv_cache=[object(), object()])
    world.fc.no_compile_layers[NAME] = layer

    class Encoded:
        def __init__(self, name: str) -> None:
            self.name = name

    def resolve(raw: Any) -> str:
        return raw.name if isinstance(raw, Encoded) else raw

    monkeypatch.setattr(_vllm_compat, "layer_name_resolver", lambda: resolve)
    kernel = wrapt.FunctionWrapper(
        lambda mixed_qkv, b, a, core_attn_out, layer_name: conn.log.append(("core",)),
        _layer_hooks.make_op_wrapper(4),
    )
    from vllm.utils.torch_utils import _encode_layer_name

    kernel(1, 2, 3, 4, Encoded(NAME))  # an unknown encoding: through the resolver
    kernel(1, 2, 3, 4, layer_name=NAME)  # a plain str
    kernel(1, 2, 3, 4, _encode_layer_name(NAME))  # vLLM's LayerName: unwrapped inline
    assert [e[0] for e in conn.log] == ["wait", "core", "save"] * 3
    assert {e[1] for e in conn.log if e[0] != "core"} == {NAME}
    assert all(e[2] is layer.kv_cache for e in conn.log if e[0] == "save")


def test_kimi_amd_fused_decode_saves_the_argument_cache(world):
    conn = Connector()
    world.state._KV_CONNECTOR_AGENT = conn
    attn = types.SimpleNamespace(layer_name=NAME)
    kv = object()
    wrapped = wrapt.FunctionWrapper(
        lambda *args: conn.log.append(("core",)) or "latent",
        mla_bypass.make_kimi_amd_fused_decode_wrapper(),
    )
    assert wrapped("q", "kv_c", "k_pe", "pos", (1, 2), world.md, attn, kv, "slots") == "latent"
    assert conn.log[0] == ("wait", NAME)
    assert conn.log[2] == ("save", NAME, kv, world.md)


# -- kv_ready_event -------------------------------------------------------------------------
def test_ready_event_is_always_complete():
    ev = kv_ready_event.ALWAYS_READY
    assert ev.query() is True
    assert ev.synchronize() is None and ev.wait() is None and ev.record() is None


def test_cpu_platform_gets_the_ready_event():
    record = kv_ready_event.event_recorder()  # real vLLM: the CPU platform here
    assert record(NAME) is kv_ready_event.ALWAYS_READY


def test_device_events_are_reused_per_layer_and_recorded_each_call(monkeypatch):
    import vllm.platforms

    class FakeEvent:
        made = 0

        def __init__(self) -> None:
            FakeEvent.made += 1
            self.records = 0

        def record(self) -> None:
            self.records += 1

    monkeypatch.setattr(
        vllm.platforms, "current_platform", types.SimpleNamespace(device_type="fakedev")
    )
    monkeypatch.setattr(torch, "fakedev", types.SimpleNamespace(Event=FakeEvent), raising=False)
    record = kv_ready_event.event_recorder()
    a1, a2, b1 = record("a"), record("a"), record("b")
    assert a1 is a2 and a1 is not b1
    assert a1.records == 2 and b1.records == 1 and FakeEvent.made == 2


def test_device_without_event_type_is_a_clear_error(monkeypatch):
    import vllm.platforms

    monkeypatch.setattr(
        vllm.platforms, "current_platform", types.SimpleNamespace(device_type="nodev")
    )
    with pytest.raises(RuntimeError, match=r"torch\.nodev\.Event"):
        kv_ready_event.event_recorder()


def test_kv_update_wrapper_publishes_after_the_write(world, monkeypatch):
    world.state._KV_CONNECTOR_AGENT = Connector()
    order: list[str] = []
    monkeypatch.setattr(
        kv_ready_event, "event_recorder", lambda: lambda n: order.append("record") or "ev"
    )
    op = wrapt.FunctionWrapper(
        lambda key, value, layer_name: order.append("write") or "dummy",
        kv_ready_event.make_kv_update_wrapper(2),
    )
    assert op("k", "v", NAME) == "dummy"
    assert order == ["write", "record"]
    assert layerwise.kv_ready_events[NAME] == "ev"
    assert world.md.reshape_cache_event == "ev"


def test_kv_update_wrapper_is_inert_without_connector_or_metadata(world, monkeypatch):
    monkeypatch.setattr(kv_ready_event, "event_recorder", lambda: lambda n: pytest.fail("recorded"))
    op = wrapt.FunctionWrapper(
        lambda key, value, layer_name: "dummy", kv_ready_event.make_kv_update_wrapper(2)
    )
    assert op("k", "v", NAME) == "dummy"  # no connector
    world.state._KV_CONNECTOR_AGENT = Connector()
    world.fc.attn_metadata = None
    assert op("k", "v", NAME) == "dummy"  # profile run
    assert layerwise.kv_ready_events == {}


def test_save_hook_wrapper_records_before_vllm_saves(world, monkeypatch):
    world.state._KV_CONNECTOR_AGENT = Connector()
    order: list[str] = []
    monkeypatch.setattr(
        kv_ready_event, "event_recorder", lambda: lambda n: order.append("record") or "ev"
    )
    hook = wrapt.FunctionWrapper(
        lambda layer_name, kv_cache_layer: order.append(
            f"save sees {getattr(world.md, 'reshape_cache_event', None)}"
        ),
        kv_ready_event.make_save_hook_wrapper(),
    )
    hook(NAME, ["kv"])
    assert order == ["record", "save sees ev"]


# -- _vllm_compat on the installed vLLM -----------------------------------------------------
def test_compat_on_installed_vllm():
    import vllm.forward_context
    import vllm.utils.torch_utils as tu
    from vllm.forward_context import get_forward_context

    assert _vllm_compat.forward_context_getter() is get_forward_context
    assert _vllm_compat.forward_context_holder() is vllm.forward_context
    assert _vllm_compat.layer_name_class() is tu.LayerName
    assert _vllm_compat.has_virtual_engine() is False  # 0.32 (virtual_engine gone since 0.19)
    assert _vllm_compat.layer_name_resolver() is tu._resolve_layer_name
    assert _vllm_compat.platform_dispatch_key() == "CPU"
    module, _, attr = _vllm_compat.DISPATCH_KEY.partition(":")
    assert module == _vllm_compat.__name__ and attr == "platform_dispatch_key"


def test_forward_context_holder_without_the_module_global(monkeypatch):
    """A vLLM without ``forward_context._forward_context`` (none of 0.11-0.33 so far):
    the holder reads the context through ``get_forward_context`` instead."""
    import vllm.forward_context as fc_module

    context = object()
    monkeypatch.delattr(fc_module, "_forward_context")
    monkeypatch.setattr(fc_module, "get_forward_context", lambda: context)
    holder = _vllm_compat.forward_context_holder()
    assert holder is not fc_module
    assert holder._forward_context is context
