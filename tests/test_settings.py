"""Settings are parsed once, checked by one module, and declared by the module that reads
them (issue #28, item 1)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ucm_patch import activation, toggles
from ucm_patch.connector import config as connector_config
from ucm_patch.connector import kv_connector
from ucm_patch.errors import ConfigError
from ucm_patch.hooks import stores
from ucm_patch.hooks.settings import SettingError

REPO = Path(__file__).resolve().parent.parent
_SETTING = re.compile(r"^UCM_PATCH_[A-Z0-9_]+$")


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


def test_each_module_declares_the_settings_it_reads_and_the_core_names_none_of_theirs() -> None:
    declared = activation.declared_settings()
    assert declared and not declared & toggles.SETTING_VARS
    for path in sorted((REPO / "hooks").rglob("*.py")):
        names = _env_literals(path)
        if not names:
            continue
        module = "ucm_patch.hooks." + ".".join(
            path.relative_to(REPO / "hooks").with_suffix("").parts
        )
        own = set(__import__(module, fromlist=["ENV_SETTINGS"]).ENV_SETTINGS)
        assert names <= own, f"{module} reads {sorted(names - own)} without declaring them"
        assert own <= declared, f"{module}'s settings are not accepted: {sorted(own - declared)}"
    core = set().union(*(_env_literals(p) for p in (REPO / "ucm_patch").glob("*.py")))
    assert not core & declared, f"the core names settings of hooks/: {sorted(core & declared)}"


def test_declared_settings_pass_the_toggle_check_and_unknown_ones_do_not() -> None:
    env = {"UCM_PATCH_STORE_KEY": "0123456789abcdef", "UCM_PATCH_DUMP_EXIT_FLUSH_S": "2"}
    reg = activation.registry()
    resolver = toggles.ToggleResolver(reg.names, env=env, settings=activation.declared_settings)
    assert resolver.env_toggles == {}
    with pytest.raises(ConfigError, match="UCM_PATCH_STORE_KEY"):
        toggles.ToggleResolver(reg.names, env=env)  # nobody declared it
