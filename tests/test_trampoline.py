"""Exact-signature trampolines: every parameter shape a target can have binds exactly like
the original, the wrapper sees a normalised call, and introspection sees the original."""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import wrapt

from ucm_patch import guard, trampoline
from ucm_patch.records import PatchRecord
from ucm_patch.registry import Registry

SEEN: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []


def full(a, b, c=3, /, d=4, *, e, f=6):  # every parameter kind
    return (a, b, c, d, e, f)


def _install(fn: Any, method: bool = False, enabled: Any = None) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        SEEN.append((instance, args, dict(kwargs)))
        return wrapped(*args, **kwargs)

    cell = guard.CallCell()
    return trampoline.make_trampoline(
        fn, wrapper, enabled, method, cell, lambda exc: None, lambda: False
    )


@pytest.fixture(autouse=True)
def _clear() -> Iterator[None]:
    SEEN.clear()
    yield
    SEEN.clear()


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1, 2), {"e": 5}),
        ((1, 2, 30, 40), {"e": 50, "f": 60}),
        ((1, 2, 30), {"d": 40, "e": 50}),
    ],
)
def test_every_parameter_kind_binds_like_the_original(args, kwargs) -> None:
    tr = _install(full)
    assert tr(*args, **kwargs) == full(*args, **kwargs)
    instance, seen_args, seen_kwargs = SEEN[0]
    expected = full(*args, **kwargs)
    # Normalised: every parameter before "*" positional in declaration order, keyword-only
    # ones (and only those) in kwargs.
    assert instance is None
    assert seen_args == expected[:4]
    assert seen_kwargs == {"e": expected[4], "f": expected[5]}


def test_binding_errors_are_the_originals() -> None:
    tr = _install(full)
    with pytest.raises(TypeError, match="positional-only"):
        tr(1, b=2, e=5)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'e'"):
        tr(1, 2)
    assert SEEN == []


def test_introspection_sees_the_original() -> None:
    tr = _install(full)
    assert tr.__wrapped__ is full
    assert (tr.__name__, tr.__qualname__, tr.__module__) == (
        full.__name__,
        full.__qualname__,
        full.__module__,
    )
    assert inspect.signature(tr) == inspect.signature(full)
    assert "ucm_patch trampoline" in tr.__code__.co_filename  # tracebacks say whose frame


def test_method_passes_the_instance_and_binds_like_any_method() -> None:
    class Layer:
        def core(self, mixed_qkv, b, a, core_attn_out):
            return (self, mixed_qkv, b, a, core_attn_out)

    Layer.core = _install(vars(Layer)["core"], method=True)
    layer = Layer()
    assert layer.core(mixed_qkv=1, b=2, a=3, core_attn_out=4) == (layer, 1, 2, 3, 4)
    assert Layer.core(layer, 1, 2, a=3, core_attn_out=4) == (layer, 1, 2, 3, 4)
    assert SEEN == [(layer, (1, 2, 3, 4), {})] * 2
    assert type(vars(Layer)["core"]) is types.FunctionType  # bound like any method


def test_enabled_false_calls_the_original_without_the_wrapper() -> None:
    switch = {"on": False}
    tr = _install(full, enabled=lambda: switch["on"])
    assert tr(1, 2, e=5) == (1, 2, 3, 4, 5, 6)
    assert SEEN == []
    switch["on"] = True
    assert tr(1, 2, e=5) == (1, 2, 3, 4, 5, 6)
    assert len(SEEN) == 1


def test_parameter_names_cannot_shadow_the_generated_ones() -> None:
    """A parameter named like the generated locals would silently rebind them."""
    src = "def f(_ucm_tr_original):\n    return _ucm_tr_original\n"
    scope: dict[str, Any] = {}
    exec(src, scope)
    assert trampoline.supports(full, method=False)
    assert not trampoline.supports(scope["f"], method=False)


@pytest.mark.parametrize(
    ("fn", "method"),
    [
        (lambda *args: None, False),
        (lambda **kwargs: None, False),
        (lambda: None, True),  # a "method" without an instance parameter
        (staticmethod(full), True),
        (len, False),
        (wrapt.FunctionWrapper(full, lambda w, i, a, k: w(*a, **k)), False),
    ],
    ids=["varargs", "varkw", "no-self", "staticmethod", "builtin", "wrapt-proxy"],
)
def test_shapes_left_to_wrapt(fn, method) -> None:
    assert not trampoline.supports(fn, method)


# -- through the registry ---------------------------------------------------------------------
@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    mod = types.ModuleType("ucm_trampoline_target")
    mod.full = full
    mod.varargs = lambda *args: sum(args)
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _record(target: str) -> PatchRecord:
    def make_wrapper() -> Any:
        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
            SEEN.append((instance, args, dict(kwargs)))
            return wrapped(*args, **kwargs)

        return wrapper

    return PatchRecord(
        "tramp",
        target.rpartition(":")[2],
        target,
        {"wrapt": ">=1"},
        make_wrapper,
        why="test record",
        upstream="test only here",
        removal="never at all",
    )


def test_registry_picks_the_installer_and_reverts_both(module) -> None:
    reg = Registry(
        [_record("ucm_trampoline_target:full"), _record("ucm_trampoline_target:varargs")]
    )
    reg.activate()
    assert {r["state"] for r in reg.report()} == {"applied"}
    assert type(module.full) is types.FunctionType and module.full is not full
    assert isinstance(module.varargs, wrapt.FunctionWrapper)
    assert module.full(1, 2, e=5) == (1, 2, 3, 4, 5, 6)
    assert module.varargs(1, 2) == 3
    assert [s[1] for s in SEEN] == [(1, 2, 3, 4), (1, 2)]
    reg.revert()
    assert module.full is full
    assert not isinstance(module.varargs, wrapt.FunctionWrapper)


def test_string_annotations_resolve_in_the_originals_module() -> None:
    """torch.library.infer_schema (vLLM registering a lazily defined op kernel, 0.21+ CPU
    GDN) evaluates ``from __future__ import annotations`` strings in ``__globals__``."""
    import typing

    tr = _install(_annotated)
    assert typing.get_type_hints(tr) == typing.get_type_hints(_annotated)
    assert tr.__globals__ is _annotated.__globals__
    assert not any(k.startswith("_ucm_tr_") for k in _annotated.__globals__)


def _annotated(x: SEEN_TYPE, y: int = 2) -> SEEN_TYPE:  # type: ignore[valid-type]
    return x


SEEN_TYPE = list


def test_one_compiled_shape_serves_functions_with_other_parameter_names() -> None:
    """Trampolines are compiled once per signature shape and renamed per target: each
    must bind its own keyword names (and only those)."""

    def first(alpha, beta=2):
        return ("first", alpha, beta)

    def second(gamma, delta=3):
        return ("second", gamma, delta)

    one, two = _install(first), _install(second)
    assert one.__code__.co_code == two.__code__.co_code  # the same compiled shape
    assert one(beta=5, alpha=1) == ("first", 1, 5)
    assert two(delta=7, gamma=4) == ("second", 4, 7)
    assert one.__code__.co_name == "first" and two.__code__.co_name == "second"
    with pytest.raises(TypeError, match="gamma"):
        one(gamma=1)
