"""Toggle precedence and every bad-input case of the resolver."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ucm_patch import environment
from ucm_patch.errors import ConfigError
from ucm_patch.toggles import ToggleResolver, parse_bool

KNOWN = {"gdn_layerwise", "kv_ready_event"}


def resolver(env: dict[str, str] | None = None, code: dict | None = None) -> ToggleResolver:
    return ToggleResolver(KNOWN, code=code, env=env or {})


@pytest.mark.parametrize("word", ["1", "true", "ON", "Yes", " on "])
def test_true_words(word: str) -> None:
    assert parse_bool(word, "X") is True


@pytest.mark.parametrize("word", ["0", "false", "Off", "NO"])
def test_false_words(word: str) -> None:
    assert parse_bool(word, "X") is False


def test_default_applies_without_any_toggle() -> None:
    r = resolver()
    assert r.decide("gdn_layerwise", True) == (True, "default")
    assert r.decide("kv_ready_event", False) == (False, "default")


def write(tmp_path: Path, text: str, name: str = "t.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_code_over_env_over_file_over_default(tmp_path: Path) -> None:
    cfg = write(tmp_path, "[patches]\ngdn_layerwise = false\nkv_ready_event = true\n")
    file_only = resolver({"UCM_PATCH_CONFIG": cfg})
    assert file_only.decide("kv_ready_event", False).enabled is True
    assert file_only.decide("gdn_layerwise", True).source.startswith("config ")
    env_and_file = resolver({"UCM_PATCH_CONFIG": cfg, "UCM_PATCH_GDN_LAYERWISE": "on"})
    assert env_and_file.decide("gdn_layerwise", True) == (True, "env UCM_PATCH_GDN_LAYERWISE")
    all_three = resolver(
        {"UCM_PATCH_CONFIG": cfg, "UCM_PATCH_GDN_LAYERWISE": "on"}, code={"gdn_layerwise": False}
    )
    assert all_three.decide("gdn_layerwise", True) == (False, "code")


def test_version_scoped_rules_first_match_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write(
        tmp_path,
        """
[[patches.gdn_layerwise]]
enabled = false
when = { vllm = "<0.19" }

[[patches.gdn_layerwise]]
enabled = true
when = { vllm = ">=0.30" }

[patches.kv_ready_event]
enabled = true
when = { vllm-ascend = ">=0.13" }
""",
    )
    monkeypatch.setenv("UCM_PATCH_VLLM_VERSION", "0.18.1")
    r = resolver({"UCM_PATCH_CONFIG": cfg, "UCM_PATCH_VLLM_VERSION": "0.18.1"})
    assert r.decide("gdn_layerwise", True).enabled is False
    monkeypatch.setenv("UCM_PATCH_VLLM_VERSION", "0.32.0")
    r = resolver({"UCM_PATCH_CONFIG": cfg})
    d = r.decide("gdn_layerwise", False)
    assert d.enabled is True and "[1]" in d.source
    # vllm-ascend is not installed: the scoped rule makes no decision, the default holds
    assert r.decide("kv_ready_event", False) == (False, "default")


def test_json_config(tmp_path: Path) -> None:
    cfg = write(tmp_path, json.dumps({"patches": {"kv_ready_event": True}}), "t.json")
    assert resolver({"UCM_PATCH_CONFIG": cfg}).decide("kv_ready_event", False).enabled


BAD_ENV = [
    ({"UCM_PATCH_GDN_LAYERWISE": "maybe"}, r"UCM_PATCH_GDN_LAYERWISE='maybe'.*1/0, true/false"),
    (
        {"UCM_PATCH_GDN_LAYERWSE": "0", "UCM_PATCH_STRICT": "1"},
        r"UCM_PATCH_GDN_LAYERWSE \(did you mean UCM_PATCH_GDN_LAYERWISE\?\) is not a "
        r"ucm_patch variable",
    ),
    (
        {"UCM_PATCH_CONFIG": "/nonexistent/x.toml"},
        r"UCM_PATCH_CONFIG='/nonexistent/x.toml' "
        r"cannot be read",
    ),
]


@pytest.mark.parametrize(("env", "message"), BAD_ENV)
def test_bad_environment_is_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolver(env)


BAD_FILES = [
    (
        "[patches]\ngdn_layerwize = false\n",
        r"patches.gdn_layerwize: unknown patch name "
        r"'gdn_layerwize'; valid: gdn_layerwise, kv_ready",
    ),
    ("[patches]\ngdn_layerwise = 'off'\n", r"patches.gdn_layerwise = 'off': expected true/false"),
    ("[patches.gdn_layerwise]\nenabled = 1\n", r"patches.gdn_layerwise.enabled = 1: expected"),
    ("[patches.gdn_layerwise]\nwhen = {}\n", r"missing 'enabled'"),
    (
        "[patches.gdn_layerwise]\nenabled = true\nwhen = { vllm = 'new' }\n",
        r"when.vllm = 'new' is not a PEP 440 range",
    ),
    (
        "[patches.gdn_layerwise]\nenabled = true\nwhen = { sglang = '>1' }\n",
        r"unknown distribution 'sglang'; accepted: torch, vllm, vllm-ascend",
    ),
    ("[patches.gdn_layerwise]\nenabled = true\nextra = 1\n", r"unknown key\(s\) \['extra'\]"),
    ("[toggles]\nx = 1\n", r"unknown top-level key\(s\) \['toggles'\]"),
    ("[patches\n", r"is not valid TOML"),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
def test_bad_config_file_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    cfg = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        resolver({"UCM_PATCH_CONFIG": cfg})


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ({"gdn": False}, r"unknown patch name 'gdn'; valid: gdn_layerwise, kv_ready_event"),
        ({"gdn_layerwise": "no"}, r"expected True or False"),
    ],
)
def test_bad_code_toggles(code: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolver(code=code)


def test_unknown_variable_is_one_warning_not_an_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #36: one WARNING per process names each unknown variable and the nearest
    known name; the known toggles still apply. ``strict`` (or UCM_PATCH_STRICT=1) raises."""
    monkeypatch.setattr(environment, "_warned", set())
    env = {"UCM_PATCH_KV_READY_EVNT": "1", "UCM_PATCH_NOPE": "1", "UCM_PATCH_GDN_LAYERWISE": "0"}
    with caplog.at_level(logging.WARNING, logger="ucm_patch"):
        r = resolver(env)
        resolver(env)  # the same names again: said once per process
    assert r.env_toggles == {"gdn_layerwise": False}
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "ucm_patch"]
    assert len(lines) == 1 and caplog.records[0].levelno == logging.WARNING
    assert "UCM_PATCH_KV_READY_EVNT (did you mean UCM_PATCH_KV_READY_EVENT?)" in lines[0]
    assert "UCM_PATCH_NOPE;" in lines[0]  # nothing close: named alone
    with pytest.raises(ConfigError, match=r"UCM_PATCH_KV_READY_EVNT .* are not ucm_patch var"):
        ToggleResolver(KNOWN, env=env, strict=True)
    with pytest.raises(ConfigError, match="UCM_PATCH_NOPE"):
        resolver({**env, "UCM_PATCH_STRICT": "1"})


def test_settings_are_not_mistaken_for_patch_names() -> None:
    r = resolver({"UCM_PATCH_STRICT": "1", "UCM_PATCH_DEBUG": "0", "UCM_PATCH_REPORT_DIR": "/x"})
    assert r.env_toggles == {}
