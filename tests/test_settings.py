"""Settings are parsed once and checked by one module (issue #28, item 1); every
``UCM_PATCH*`` environment variable is declared, read and parsed by ``ucm_patch.environment``
(issue #36, item 2)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ucm_patch import activation, environment, toggles
from ucm_patch.connector import config as connector_config
from ucm_patch.connector import kv_connector
from ucm_patch.errors import ConfigError
from ucm_patch.hooks import stores
from ucm_patch.hooks.dump.lifecycle import exit_flush_seconds
from ucm_patch.hooks.stores.framing import load_store_key
from ucm_patch.hooks.value_checks import SettingError

REPO = Path(__file__).resolve().parent.parent
_SETTING = re.compile(r"^UCM_PATCH(_[A-Z0-9_]+)?$")


def test_the_connector_parses_its_store_config_once(tmp_path: Path, monkeypatch) -> None:
    calls: list[object] = []
    real = stores.parse_store_config

    def counting(config: object) -> stores.StoreConfig:
        calls.append(config)
        return real(config)  # type: ignore[arg-type]

    monkeypatch.setattr(stores, "parse_store_config", counting)
    monkeypatch.setattr(connector_config, "parse_store_config", counting)
    cfg = connector_config.parse_connector_config(
        {"local_path": str(tmp_path / "kv"), "local_memory_bytes": 0, "load_workers": 3}
    )
    monkeypatch.setattr(kv_connector, "_stores", {})
    store = kv_connector.shared_store(cfg)
    try:
        assert len(calls) == 1, "the store config was parsed again to build the store"
        assert cfg.store_config.values["local_path"] == str(tmp_path / "kv")
        assert cfg.store is cfg.store_config.values  # held once, not copied
    finally:
        store.close()


def test_one_check_module_raises_each_tables_own_error() -> None:
    with pytest.raises(connector_config.ConnectorConfigError, match=r"^load_workers: "):
        connector_config.parse_connector_config({"load_workers": 0})
    with pytest.raises(stores.StoreConfigError, match=r"^local_fsync: ") as info:
        stores.parse_store_config({"local_fsync": "yes"})
    assert isinstance(info.value.__cause__, SettingError)
    for module in ("ucm_patch/connector/config.py", "hooks/stores/__init__.py"):
        tree = ast.parse((REPO / module).read_text(encoding="utf-8"))
        raises = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            and node.name.startswith("_")
            and any(isinstance(n, ast.Raise) for n in ast.walk(node))
        ]
        assert not raises, f"{module} carries its own value checks: {[f.name for f in raises]}"


def _env_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and _SETTING.match(node.value)
    }


def test_every_variable_is_named_in_one_module_and_documented() -> None:
    """Issue #36: every ``UCM_PATCH*`` variable is declared, read and parsed in
    ``ucm_patch.environment``; no other installed module names one as a string of its own
    (they take the parsed value, or the environment module's constant), and each declared
    variable is documented."""
    assert environment.SWITCH in environment.VARIABLES
    named = {}
    for folder in ("ucm_patch", "hooks", "patches"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path != REPO / "ucm_patch" / "environment.py" and _env_literals(path):
                named[str(path.relative_to(REPO))] = sorted(_env_literals(path))
    assert not named, f"UCM_PATCH* variables named outside ucm_patch/environment.py: {named}"
    assert _env_literals(REPO / "ucm_patch" / "environment.py") >= set(environment.VARIABLES)
    docs = (REPO / "README.md").read_text(encoding="utf-8") + "".join(
        p.read_text(encoding="utf-8") for p in (REPO / "docs").glob("*.md")
    )
    undocumented = sorted(v for v in environment.VARIABLES if f"`{v}" not in docs)
    assert not undocumented, f"declared but documented nowhere: {undocumented}"


def test_the_hooks_settings_pass_the_toggle_check() -> None:
    env = {"UCM_PATCH_STORE_KEY": "0123456789abcdef", "UCM_PATCH_DUMP_EXIT_FLUSH_S": "2"}
    reg = activation.registry()
    resolver = toggles.ToggleResolver(reg.names, env=env, strict=True)
    assert resolver.env_toggles == {}
    assert exit_flush_seconds(env) == 2.0
    assert load_store_key(env) == b"0123456789abcdef"


def test_each_variable_is_parsed_once_while_the_environment_stays_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read in one place, parsed once: the dump engine asking twice parses the variable
    once; a program that changes it afterwards (a test, a launcher) is seen."""
    var = environment.VARIABLES[environment.DUMP_EXIT_FLUSH_S]
    calls: list[str] = []

    def counting(name: str, value: str) -> object:
        calls.append(value)
        return real(name, value)

    real = var.parse
    monkeypatch.setattr(var, "parse", counting)
    monkeypatch.setenv(environment.DUMP_EXIT_FLUSH_S, "3")
    assert exit_flush_seconds() == exit_flush_seconds() == 3.0
    assert environment.current() is environment.current()
    assert calls == ["3"]
    monkeypatch.setenv(environment.DUMP_EXIT_FLUSH_S, "4")
    assert exit_flush_seconds() == 4.0 and calls == ["3", "4"]
    monkeypatch.setenv(environment.DUMP_EXIT_FLUSH_S, "soon")
    with pytest.raises(ConfigError, match="UCM_PATCH_DUMP_EXIT_FLUSH_S='soon'"):
        exit_flush_seconds()
