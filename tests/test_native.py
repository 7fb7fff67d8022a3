"""Native-hook detection (ucm_patch.native) and the kernel ledger, on real functions and
real torch.library registrations: what counts as a wait or a save, what does not."""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator

import pytest
import torch

from ucm_patch import kernel_ledger, native
from ucm_patch.records import PatchRecord


def wait_for_kv_layer_from_connector(layer_name: str) -> None:  # upstream's helper names
    pass


def maybe_save_kv_layer_to_connector(layer_name: str, kv_cache_layer: object) -> None:
    pass


def bracket(func):  # what vLLM's maybe_transfer_kv_layer does, reduced
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        conn = args[0]
        conn.wait_for_layer_load("x")
        result = func(*args, **kwargs)
        conn.save_kv_layer("x", None, None)
        return result

    return wrapper


def core(conn, mixed_qkv, b, a, core_attn_out):
    return core_attn_out


class AscendMainLike:
    """vLLM-Ascend main's GDN core: a native wait, an anonymous layer-counting save."""

    prefix = "model.layers.0.linear_attn"

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        wait_for_kv_layer_from_connector(self.prefix)
        out = core_attn_out
        maybe_save_kv_layer_to_connector("", [])
        return out


def _record(target: str, **kw) -> PatchRecord:
    return PatchRecord(
        "gdn_layerwise",
        "test",
        target,
        {"wrapt": ">=1"},
        lambda **_: lambda w, i, a, k: w(*a, **k),
        why="w",
        upstream="u",
        removal="r",
        hooks=("wait", "save"),
        **kw,
    )


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    mod = types.ModuleType("ucm_native_test_mod")
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_plain_function_makes_no_connector_call(module):
    module.core = core
    finding = native.detect(_record(f"{module.__name__}:core"), module, core)
    assert finding.found == {} and finding.missing(("wait", "save")) == ("wait", "save")


def test_decorator_found_down_the_wrapped_chain(module):
    decorated = bracket(core)
    assert decorated.__name__ == "core"  # functools.wraps hid the decorator's name
    finding = native.detect(_record(f"{module.__name__}:core"), module, decorated)
    assert finding.missing(("wait", "save")) == ()
    assert "bracket.<locals>.wrapper" in finding.found["wait"]
    assert "save_kv_layer" in finding.found["save"]


def test_anonymous_save_is_not_a_save(module):
    method = AscendMainLike.__dict__["_forward_core"]
    finding = native.detect(
        _record(f"{module.__name__}:AscendMainLike._forward_core"), module, method
    )
    assert finding.missing(("wait", "save")) == ("save",)
    assert "wait_for_kv_layer_from_connector" in finding.found["wait"]
    assert finding.anonymous and "maybe_save_kv_layer_to_connector('', ...)" in finding.anonymous[0]
    assert "anonymous save ignored" in finding.describe(("wait", "save"))


def test_named_caller_is_read(module):
    module.core = core
    module.caller = bracket(lambda *a: None)
    rec = _record(f"{module.__name__}:core", callers=(f"{module.__name__}:caller",))
    assert native.detect(rec, module, core).missing(("wait", "save")) == ()


def test_our_own_wrappers_never_read_as_native(module):
    from ucm_patch.hooks import layerwise

    wrapper = layerwise.layer_bracket(layerwise.LayerSite())
    finding = native.detect(_record(f"{module.__name__}:core"), module, wrapper)
    assert finding.found == {}


def test_registered_kernel_is_read_even_when_the_module_keeps_the_plain_function(module):
    """An op registered with a decorated copy (``op_func=maybe_transfer_kv_layer(f)``)
    while the module attribute stays plain: only the ledger can tell."""
    kernel_ledger.watch()

    def ucm_native_op(x: torch.Tensor, layer_name: str) -> torch.Tensor:
        return x.clone()

    module.ucm_native_op = ucm_native_op  # the module attribute: plain
    lib = torch.library.Library("ucm_native_test", "FRAGMENT")
    lib.define("ucm_native_op(Tensor x, str layer_name) -> Tensor")
    decorated = bracket(ucm_native_op)
    lib.impl("ucm_native_op", decorated, "CPU")
    try:
        assert kernel_ledger.registered("ucm_native_test::ucm_native_op") is decorated
        rec = _record(
            f"{module.__name__}:ucm_native_op", callers=("ucm_native_test::ucm_native_op",)
        )
        finding = native.detect(rec, module, ucm_native_op)
        assert finding.missing(("wait", "save")) == ()
        assert "kernel registered for ucm_native_test::ucm_native_op" in finding.found["wait"]
    finally:
        lib._destroy()


def test_ledger_wrapper_never_breaks_a_registration(module):
    kernel_ledger.watch()
    lib = torch.library.Library("ucm_native_test2", "FRAGMENT")
    try:
        lib.define("f(Tensor x) -> Tensor")
        lib.impl("f", lambda x: x + 1, "CPU")
        assert torch.equal(torch.ops.ucm_native_test2.f(torch.zeros(1)), torch.ones(1))
        assert kernel_ledger.registered("ucm_native_test2::f") is not None
        assert kernel_ledger.missed == []
    finally:
        lib._destroy()
