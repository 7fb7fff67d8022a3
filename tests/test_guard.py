"""Call-time isolation: a wrapper that raises never breaks the host's call."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from ucm_patch.errors import PatchFailed
from ucm_patch.records import PatchRecord
from ucm_patch.registry import Registry

SIDE_EFFECTS: list[int] = []


def _core(x: int) -> int:
    SIDE_EFFECTS.append(x)
    if x < 0:
        raise ValueError("host error")
    return x * 2


def _core_varargs(*args: int) -> int:
    return _core(*args)


# The two installers the registry picks between: an exact-signature trampoline for a plain
# function with a fixed parameter list, wrapt's FunctionWrapper for ``*args`` (and for
# anything that is not a plain function). The guard must behave the same under both.
INSTALLERS = {"trampoline": _core, "wrapt": _core_varargs}


@pytest.fixture(params=sorted(INSTALLERS))
def target(request) -> Iterator[types.ModuleType]:
    mod = types.ModuleType("ucm_guard_target")
    mod.core = INSTALLERS[request.param]
    mod.installer = request.param
    sys.modules[mod.__name__] = mod
    SIDE_EFFECTS.clear()
    yield mod
    del sys.modules[mod.__name__]


def _installed_by(fn: object) -> str:
    return "trampoline" if type(fn) is types.FunctionType else "wrapt"


def _registry(where: str) -> Registry:
    def make_wrapper():
        def wrapper(wrapped, instance, args, kwargs):
            if where == "before":
                raise KeyError("pre-call bug")
            out = wrapped(*args, **kwargs)
            if where == "after":
                raise AttributeError("post-call bug")
            return out + 1

        return wrapper

    rec = PatchRecord(
        "guarded",
        "t",
        "ucm_guard_target:core",
        {"wrapt": ">=1"},
        make_wrapper,
        why="test record",
        upstream="test only here",
        removal="never at all",
    )
    return Registry([rec])


@pytest.mark.parametrize("where", ["before", "after"])
def test_wrapper_bug_is_reported_and_the_call_completes(target, where: str) -> None:
    reg = _registry(where)
    reg.activate()
    assert _installed_by(target.core) == target.installer
    assert target.core(3) == 6  # the original's result, computed exactly once
    assert SIDE_EFFECTS == [3]
    row = reg.report()[0]
    assert row["state"] == "failed"
    assert row["reason"].startswith("wrapper raised at call time: ")
    assert ("KeyError" if where == "before" else "AttributeError") in row["reason"]
    assert target.core(4) == 8 and SIDE_EFFECTS == [3, 4]  # pass-through from now on
    reg.revert()
    assert reg.report()[0]["state"] == "reverted"
    assert not hasattr(target.core, "__wrapped__")


def test_call_time_failure_logs_one_warning_per_record(target, caplog) -> None:
    """vLLM's log says what happened, once: a broken wrapper turns into a pass-through."""
    reg = _registry("before")
    reg.activate()
    with caplog.at_level("WARNING", logger="ucm_patch"):
        for x in range(5):
            assert target.core(x) == 2 * x
    warnings = [r for r in caplog.records if r.name == "ucm_patch"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].levelname == "WARNING"
    message = warnings[0].getMessage()
    assert "guarded@t" in message and "ucm_guard_target:core" in message
    assert "KeyError" in message and "pass-through" in message
    reg.revert()


def test_host_errors_propagate_untouched(target) -> None:
    reg = _registry("none")
    reg.activate()
    assert target.core(1) == 3  # wrapper active
    with pytest.raises(ValueError, match="host error"):
        target.core(-1)
    assert reg.report()[0]["state"] == "applied"  # not the patch's fault


def test_strict_mode_raises_at_call_time(target) -> None:
    reg = _registry("before")
    reg.activate(strict=True)
    with pytest.raises(PatchFailed, match="pre-call bug"):
        target.core(3)
    assert reg.report()[0]["state"] == "failed"


class _Switch:
    """A connector-state stand-in: ``agent`` None means idle."""

    agent: object | None = None


def _skipping_registry(
    skip_when, target: str = "ucm_guard_target:core", instance_of: type | None = None
) -> Registry:
    def make_wrapper():
        def wrapper(wrapped, instance, args, kwargs):
            if instance_of is not None:
                assert isinstance(instance, instance_of)
            return wrapped(*args, **kwargs) + 100

        return wrapper

    rec = PatchRecord(
        "skipping",
        "t",
        target,
        {"wrapt": ">=1"},
        make_wrapper,
        skip_when=skip_when,
        why="test record",
        upstream="test only here",
        removal="never at all",
    )
    return Registry([rec])


def _plain_idle() -> bool:
    return _Switch.agent is None


def _fast_idle() -> bool:
    return _Switch.agent is None


# What layerwise.idle offers: a frame-free callable, truthy while active.
_fast_idle.enabled_callable = lambda: lambda: _Switch.agent  # type: ignore[attr-defined]


@pytest.mark.parametrize("skip_when", [_plain_idle, _fast_idle], ids=["predicate", "frame-free"])
def test_skip_when_goes_straight_to_the_original_and_back(target, skip_when) -> None:
    reg = _skipping_registry(skip_when)
    reg.activate()
    try:
        _Switch.agent = None
        assert target.core(3) == 6  # idle: the wrapper does not run
        _Switch.agent = object()
        assert target.core(3) == 106  # active: it does
        _Switch.agent = None
        assert target.core(4) == 8
        assert SIDE_EFFECTS == [3, 3, 4]  # the original ran once per call on both paths
        assert reg.report()[0]["state"] == "applied"
    finally:
        _Switch.agent = None
        reg.revert()


def test_skip_when_on_a_method_binds_the_instance(target) -> None:
    class Layer:
        def __init__(self, k: int) -> None:
            self.k = k

        if target.installer == "trampoline":

            def core(self, x: int) -> int:
                return x * self.k

        else:

            def core(self, *args: int, **kwargs: int) -> int:
                return (args[0] if args else kwargs["x"]) * self.k

    target.Layer = Layer

    reg = _skipping_registry(_fast_idle, "ucm_guard_target:Layer.core", Layer)
    reg.activate()
    assert _installed_by(vars(Layer)["core"]) == target.installer
    try:
        layer = Layer(3)
        assert layer.core(2) == 6
        _Switch.agent = object()
        assert layer.core(2) == 106 and Layer.core(layer, x=2) == 106
        assert reg.report()[0]["state"] == "applied"
    finally:
        _Switch.agent = None
        reg.revert()


class _Platform:
    """A class whose target is a classmethod, as ``CpuPlatform.check_and_update_config``."""

    @classmethod
    def configure(cls, config: dict) -> str:
        config["by"] = cls
        return "configured"


@pytest.mark.parametrize("where", ["before", "after", "none"])
def test_classmethod_target_is_guarded_and_stays_a_classmethod(where: str) -> None:
    """A bug in a classmethod's wrapper is a pass-through (never reaches the host), the
    class arrives as the instance, and revert puts the original descriptor back."""
    mod = types.ModuleType("ucm_guard_classmethod")
    mod.Platform = type("Platform", (_Platform,), {"configure": _Platform.__dict__["configure"]})
    sys.modules[mod.__name__] = mod
    seen: list[object] = []

    def make_wrapper():
        def wrapper(wrapped, instance, args, kwargs):
            seen.append(instance)
            if where == "before":
                raise KeyError("pre-call bug")
            out = wrapped(*args, **kwargs)
            if where == "after":
                raise AttributeError("post-call bug")
            return out + "!"

        return wrapper

    rec = PatchRecord(
        "guarded_cm",
        "t",
        "ucm_guard_classmethod:Platform.configure",
        {"wrapt": ">=1"},
        make_wrapper,
        why="test record",
        upstream="test only here",
        removal="never at all",
    )
    reg = Registry([rec])
    try:
        reg.activate(patches={"guarded_cm": True}, env={})
        platform = mod.Platform
        assert isinstance(platform.__dict__["configure"], classmethod)
        config: dict = {}
        result = platform().configure(config)  # through an instance, as vLLM calls it
        assert config["by"] is platform and seen == [platform]
        row = reg.report()[0]
        if where == "none":
            assert result == "configured!" and row["state"] == "applied"
        else:
            assert result == "configured" and row["state"] == "failed", row
            assert platform.configure({}) == "configured"  # a pass-through from now on
        reg.revert()
        assert platform.__dict__["configure"] is _Platform.__dict__["configure"]
    finally:
        del sys.modules[mod.__name__]
