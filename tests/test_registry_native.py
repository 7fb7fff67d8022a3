"""The registry's apply-time checks: native hooks, signature changes, version ceilings.

Targets live in a real module registered in ``sys.modules`` (the post-import hook fires
at once); versions are those of the installed ``wrapt`` distribution, so a range "past the
ceiling" is computed from it, never typed in.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator

import pytest
import wrapt
from packaging.version import Version

from ucm_patch.errors import ConfigError, PatchFailed
from ucm_patch.records import PatchRecord
from ucm_patch.registry import Registry
from ucm_patch.source_checks import assigned, binding, leading, signature

MOD = "ucm_registry_native_test_mod"
WRAPT = Version(wrapt.__version__)
IN_RANGE = f">={WRAPT.major},<{WRAPT.major + 1}"
PAST = f">=0.0.1,<{WRAPT.major}.{WRAPT.minor}"  # installed wrapt is past this ceiling
OLDER = ">=0.0.1,<0.0.2"  # an older era of the same patch
SAVE = ("layer_name", "kv_cache_layer")


def wait_for_kv_layer_from_connector(layer_name: str) -> None:
    pass


def maybe_save_kv_layer_to_connector(layer_name: str, kv_cache_layer: object) -> None:
    pass


def natively_bracketed(func):
    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        wait_for_kv_layer_from_connector(self.prefix)
        result = func(self, *args, **kwargs)
        maybe_save_kv_layer_to_connector(self.prefix, [])
        return result

    return wrapper


class Layer:
    prefix = "layer"

    def plain(self, x, y):
        return x + y

    @natively_bracketed
    def native(self, x, y):
        return x + y

    def half(self, x, y):  # vLLM-Ascend main's GDN core: wait, anonymous save
        wait_for_kv_layer_from_connector(self.prefix)
        out = x + y
        maybe_save_kv_layer_to_connector("", [])
        return out

    def renamed(self, q, y):
        return q + y


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    mod = types.ModuleType(MOD)

    class Fresh(Layer):  # a class per test: registries patch it
        pass

    for attr in ("plain", "native", "half", "renamed"):
        setattr(Fresh, attr, Layer.__dict__[attr])
    mod.Layer = Fresh
    sys.modules[MOD] = mod
    yield mod
    del sys.modules[MOD]


class Factory:
    """A layer-record factory that remembers which hooks it was asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, ...] | None] = []

    def __call__(self, hooks: tuple[str, ...] | None = None):
        self.asked.append(hooks)
        return lambda w, i, a, k: w(*a, **k)


def _rec(attr: str, requires: str = IN_RANGE, era: str = "new", **kw) -> PatchRecord:
    kw.setdefault("make_wrapper", Factory())
    kw.setdefault("expect", (leading(("self", "x", "y")),))
    return PatchRecord(
        "gdn_layerwise",
        era,
        f"{MOD}:Layer.{attr}",
        {"wrapt": requires},
        why="w",
        upstream="u",
        removal="r",
        hooks=("wait", "save"),
        **kw,
    )


def _state(reg: Registry, rid: str) -> tuple[str, str]:
    row = next(r for r in reg.report() if r["id"] == rid)
    return row["state"], row["reason"]


def test_a_natively_bracketed_target_stands_down(module):
    original = module.Layer.__dict__["native"]
    reg = Registry([_rec("native")])
    reg.activate(env={})
    state, reason = _state(reg, "gdn_layerwise@new")
    assert state == "native"
    assert "natively_bracketed.<locals>.wrapper" in reason
    assert "wait_for_kv_layer_from_connector" in reason and "maybe_save" in reason
    assert module.Layer.__dict__["native"] is original  # untouched


def test_half_native_target_gets_only_the_missing_save(module):
    factory = Factory()
    reg = Registry([_rec("half", make_wrapper=factory)])
    reg.activate(env={})
    state, reason = _state(reg, "gdn_layerwise@new")
    assert state == "applied"
    assert factory.asked == [("save",)]
    assert reason.startswith("adds save only; native wait:")
    assert "anonymous save ignored" in reason


def test_a_plain_target_gets_the_full_bracket(module):
    factory = Factory()
    reg = Registry([_rec("plain", make_wrapper=factory)])
    reg.activate(env={})
    assert _state(reg, "gdn_layerwise@new") == ("applied", "")
    assert factory.asked == [None]  # the plain factory call: every hook


def test_a_changed_signature_fails_with_both_parameter_lists(module):
    original = module.Layer.__dict__["renamed"]
    reg = Registry([_rec("renamed")])
    reg.activate(env={})
    state, reason = _state(reg, "gdn_layerwise@new")
    assert state == "failed"
    assert reason == (
        f"signature changed: expected (self, x, y, ...), found (self, q, y) on {MOD}:Layer.renamed"
    )
    assert module.Layer.__dict__["renamed"] is original  # never wrapped


def test_a_changed_signature_raises_in_strict_mode(module):
    reg = Registry([_rec("renamed")])
    with pytest.raises(PatchFailed, match="signature changed"):
        reg.activate(env={}, strict=True)


def test_past_the_ceiling_the_newest_era_is_untested_and_off(module):
    original = module.Layer.__dict__["plain"]
    reg = Registry([_rec("plain", PAST), _rec("plain", OLDER, era="old")])
    reg.activate(env={})
    state, reason = _state(reg, "gdn_layerwise@new")
    assert state == "untested-version"
    assert f"past the ceiling <{WRAPT.major}.{WRAPT.minor}" in reason
    assert "UCM_PATCH_ALLOW_UNTESTED" in reason
    assert _state(reg, "gdn_layerwise@old")[0] == "skipped-version"  # not the newest era
    assert module.Layer.__dict__["plain"] is original
    row = next(r for r in reg.report() if r["id"] == "gdn_layerwise@new")
    assert row["ceiling"] == {"wrapt": f"<{WRAPT.major}.{WRAPT.minor}"}


@pytest.mark.parametrize("value", ["1", "gdn_layerwise", " gdn_layerwise , "])
def test_allow_untested_from_the_environment(module, value):
    reg = Registry([_rec("plain", PAST)])
    reg.activate(env={"UCM_PATCH_ALLOW_UNTESTED": value})
    state, reason = _state(reg, "gdn_layerwise@new")
    assert state == "applied"
    assert reason.endswith("allowed by env UCM_PATCH_ALLOW_UNTESTED")


def test_allowed_past_the_ceiling_still_needs_the_native_check(module):
    reg = Registry([_rec("native", PAST)])
    reg.activate(env={"UCM_PATCH_ALLOW_UNTESTED": "1"})
    assert _state(reg, "gdn_layerwise@new")[0] == "native"


def test_allowed_past_the_ceiling_still_needs_the_signature_check(module):
    reg = Registry([_rec("renamed", PAST)])
    reg.activate(env={"UCM_PATCH_ALLOW_UNTESTED": "1"})
    state, reason = _state(reg, "gdn_layerwise@new")
    assert state == "failed" and reason.startswith("signature changed")


def test_allow_untested_per_patch_in_the_config_file(module, tmp_path):
    cfg = tmp_path / "ucm.toml"
    cfg.write_text("[patches]\ngdn_layerwise = { allow_untested = true }\n")
    reg = Registry([_rec("plain", PAST)])
    reg.activate(env={"UCM_PATCH_CONFIG": str(cfg)})
    state, reason = _state(reg, "gdn_layerwise@new")
    assert state == "applied" and f"allowed by config {cfg}: patches.gdn_layerwise" in reason
    # the environment's "no" wins over the file
    reg2 = Registry([_rec("plain", PAST)])
    reg2.activate(env={"UCM_PATCH_CONFIG": str(cfg), "UCM_PATCH_ALLOW_UNTESTED": "0"})
    assert _state(reg2, "gdn_layerwise@new")[0] == "untested-version"


def test_allow_untested_names_must_exist(module):
    reg = Registry([_rec("plain", PAST)])
    with pytest.raises(ConfigError, match=r"UCM_PATCH_ALLOW_UNTESTED='gdn_layerwize'.*unknown"):
        reg.activate(env={"UCM_PATCH_ALLOW_UNTESTED": "gdn_layerwize"})


def test_config_allow_untested_must_be_a_bool(module, tmp_path):
    cfg = tmp_path / "ucm.toml"
    cfg.write_text('[patches]\ngdn_layerwise = { allow_untested = "yes" }\n')
    reg = Registry([_rec("plain", PAST)])
    with pytest.raises(ConfigError, match=r"patches.gdn_layerwise.allow_untested = 'yes'"):
        reg.activate(env={"UCM_PATCH_CONFIG": str(cfg)})


def test_a_retired_record_is_skipped_not_untested(module):
    reg = Registry([_rec("plain", PAST, retired="upstream does it from 9.9 (PR #1)")])
    reg.activate(env={"UCM_PATCH_ALLOW_UNTESTED": "1"})
    state, reason = _state(reg, "gdn_layerwise@new")
    assert state == "skipped-version" and "outside the required range" in reason


# -- apply-time parameter checks through a copy and a by-name import (vLLM-Ascend records) ----
@pytest.mark.parametrize(
    ("attr", "state"), [("plain", "applied"), ("renamed", "failed")], ids=["same", "changed"]
)
def test_a_copied_method_is_checked_against_the_function_it_copies(module, attr, state):
    """``assigned`` puts ``Source.core`` onto ``Layer.copied``: the live method must have the
    parameters the ``signature`` check states for ``Source.core``."""
    module.Layer.copied = module.Layer.__dict__[attr]
    expect = (
        signature(f"{MOD}:Source.core", ("self", "x", "y")),
        assigned(MOD, "Layer.copied", "Source.core"),
    )
    reg = Registry([_rec("copied", expect=expect)])
    reg.activate(env={})
    got, reason = _state(reg, "gdn_layerwise@new")
    assert got == state, reason
    if state == "failed":
        assert reason == (
            f"signature changed: expected (self, x, y), found (self, q, y) on {MOD}:Layer.copied"
        )


@pytest.mark.parametrize(("params", "state"), [(SAVE, "applied"), (("name", "kv"), "failed")])
def test_a_by_name_binding_is_checked_against_the_hook_it_imports(module, params, state):
    """``binding`` imports ``maybe_save_kv_layer_to_connector`` into the module: the live
    function must have the hook's parameters (the anonymous filter reads ``layer_name``)."""
    module.maybe_save_kv_layer_to_connector = maybe_save_kv_layer_to_connector
    expect = (
        binding(MOD, "maybe_save_kv_layer_to_connector"),
        signature("hooks_module:maybe_save_kv_layer_to_connector", params),
    )
    record = PatchRecord(
        "anon_filter",
        "new",
        f"{MOD}:maybe_save_kv_layer_to_connector",
        {"wrapt": IN_RANGE},
        why="w",
        upstream="u",
        removal="r",
        make_wrapper=lambda: lambda w, i, a, k: w(*a, **k),
        expect=expect,
    )
    reg = Registry([record])
    reg.activate(env={})
    got, reason = _state(reg, "anon_filter@new")
    assert got == state, reason
