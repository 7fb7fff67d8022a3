"""vLLM's ``@eager_break_during_capture`` stays outermost around every ucm_patch wrapper.

The decorator is vLLM's own (``vllm.compilation.breakable_cudagraph``, installed vLLM): a
wrapper outside it would run its connector calls inside a captured CUDA-graph segment,
once at capture and never on replay (Kimi Linear's ``_forward`` from vLLM 0.27, the XPU
GDN op kernel from 0.28). The capture itself needs a GPU; what is checked here is the
structure the decorator relies on and that the wrapped call still reaches the core.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.compilation import breakable_cudagraph
from vllm.compilation.breakable_cudagraph import eager_break_during_capture

from ucm_patch import capture_break, kernel_ledger
from ucm_patch.installer import MARKER
from ucm_patch.records import Kind, PatchRecord
from ucm_patch.registry import Registry
from ucm_patch.source_checks import leading

MOD = "ucm_capture_break_test_mod"
IN_RANGE = ">=0.0.1,<999"


class Calls:
    """A record factory whose wrapper logs around the call it wraps."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def __call__(self, hooks: tuple[str, ...] | None = None) -> Any:
        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict) -> Any:
            self.log.append("wrapper")
            return wrapped(*args, **kwargs)

        return wrapper


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    # The decorator returns the function itself unless breakable CUDA graphs are on
    # (VLLM_USE_BREAKABLE_CUDAGRAPH, read when the decorated module is imported).
    monkeypatch.setattr(breakable_cudagraph, "is_breakable_cudagraph_enabled", lambda: True)
    mod = types.ModuleType(MOD)

    class Layer:
        prefix = "model.layers.0.linear_attn"

        @eager_break_during_capture
        def _forward(self, mixed_qkv: torch.Tensor, core_attn_out: torch.Tensor) -> None:
            core_attn_out.copy_(mixed_qkv)

    mod.Layer = Layer
    sys.modules[MOD] = mod
    yield mod
    del sys.modules[MOD]


def _record(target: str, factory: Calls, **kw: Any) -> PatchRecord:
    return PatchRecord(
        "capture_break_test",
        "t",
        target,
        {"wrapt": IN_RANGE},
        why="w",
        upstream="u",
        removal="r",
        make_wrapper=factory,
        **kw,
    )


def test_detects_only_vllms_decorator(module):
    assert capture_break.is_capture_break(module.Layer.__dict__["_forward"])
    assert not capture_break.is_capture_break(module.Layer.__dict__["_forward"].__wrapped__)
    assert capture_break.split(len) == (len, None)


def test_a_decorated_method_is_rewrapped_inside_the_decorator(module):
    decorated = module.Layer.__dict__["_forward"]
    inner = decorated.__wrapped__
    factory = Calls()
    reg = Registry(
        [_record(f"{MOD}:Layer._forward", factory, expect=(leading(("self", "mixed_qkv")),))]
    )
    reg.activate(env={})
    assert reg.report()[0]["state"] == "applied", reg.report()[0]["reason"]

    live = module.Layer.__dict__["_forward"]
    assert capture_break.is_capture_break(live), "the decorator is no longer outermost"
    assert getattr(live, MARKER) == "capture_break_test@t"
    ours = live.__wrapped__
    assert getattr(ours, MARKER) == "capture_break_test@t"  # our wrapper right inside it
    assert ours.__wrapped__ is inner

    x, out = torch.ones(2), torch.zeros(2)
    module.Layer()._forward(x, out)
    assert factory.log == ["wrapper"] and torch.equal(out, x)

    reg.revert()
    assert module.Layer.__dict__["_forward"] is decorated  # the exact original back


def test_an_overridden_op_kernel_keeps_the_decorator(module, monkeypatch):
    """vLLM 0.28+ registers the XPU GDN op with op_func=eager_break_during_capture(impl)
    while the module keeps the plain impl: the override must register the decorator
    around ucm_patch's wrapper, not the wrapper alone."""
    kernel_ledger.watch()

    def ucm_cb_op(x: torch.Tensor, layer_name: str) -> torch.Tensor:
        return x + 1

    module.ucm_cb_op = ucm_cb_op
    lib = torch.library.Library("ucm_capture_break_test", "FRAGMENT")
    lib.define("ucm_cb_op(Tensor x, str layer_name) -> Tensor")
    lib.impl("ucm_cb_op", eager_break_during_capture(ucm_cb_op), "CPU")
    registered: list[Any] = []
    impl = torch.library.Library.impl

    def spy(self: Any, name: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        registered.append(fn)
        return impl(self, name, fn, *args, **kwargs)

    monkeypatch.setattr(torch.library.Library, "impl", spy)
    factory = Calls()
    record = _record(
        f"{MOD}:ucm_cb_op",
        factory,
        expect=(leading(("x", "layer_name")),),
        kind=Kind.OP_KERNEL,
        op="ucm_capture_break_test::ucm_cb_op",
        dispatch_key="CPU",
    )
    reg = Registry([record])
    try:
        reg.activate(env={})
        assert reg.report()[0]["state"] == "applied", reg.report()[0]["reason"]
        (kernel,) = registered
        assert capture_break.is_capture_break(kernel)
        assert getattr(kernel.__wrapped__, MARKER) == "capture_break_test@t"
        y = torch.ops.ucm_capture_break_test.ucm_cb_op(torch.zeros(1), "l")
        assert factory.log == ["wrapper"] and torch.equal(y, torch.ones(1))
    finally:
        reg.revert()
        lib._destroy()
