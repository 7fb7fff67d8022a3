"""One default and one check per setting: the key tables are the source.

Walks every key of the connector's table (:data:`CONNECTOR_KEYS`, with the dump engine's
:data:`DUMP_KEYS`) and of the stores' (:data:`LOCAL_KEYS`, :data:`MOONCAKE_KEYS`) and
compares it with what the code that takes the value uses: the parsed config with nothing
set, the constructors' defaults, and the checks a scheduler built without the connector
runs. A default typed a second time somewhere, or a check that accepts what the table
refuses, fails here by the key's name.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from ucm_patch.connector.config import CONNECTOR_KEYS, ConnectorConfig, parse_connector_config
from ucm_patch.connector.layout import KVLayout
from ucm_patch.hooks.device import CpuDevice
from ucm_patch.hooks.dump import DumpScheduler
from ucm_patch.hooks.dump.keys import DUMP_KEYS, SCHEDULER_ARGS, copy_threads
from ucm_patch.hooks.stores import LOCAL_KEYS, MOONCAKE_KEYS, parse_store_config
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.mooncake import MooncakeStore
from ucm_patch.hooks.value_checks import SettingError

#: Keys whose default is computed (None in the table), and what parsing nothing gives.
COMPUTED = {
    "namespace": None,
    "load_workers": copy_threads(),
    "dump_workers": copy_threads(),
    "load_prefetch_rows": copy_threads(),  # load_workers'
    "dump_exit_flush_s": None,  # the scheduler's exit_flush_seconds() then
}

#: A LocalStore built directly (tests, tools) has one tier; the connector's store gets
#: the computed memory tier from make_store. The only constructor default that is not the
#: table's, and why.
DIRECT_LOCAL_STORE = {"local_memory_bytes": 0}

CANDIDATES: list[Any] = [0, -1, 1 << 40, "x", 2.5, -0.5, True, None, "drop", 1, "wait"]


def _param_defaults(fn: Any) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("key", sorted(CONNECTOR_KEYS))
def test_the_parsed_config_with_nothing_set_has_each_keys_table_default(key: str) -> None:
    default = CONNECTOR_KEYS[key][1]
    got = getattr(parse_connector_config({}), key)
    if default is None:
        assert key in COMPUTED, f"{key}: a computed default, not listed in COMPUTED"
        assert got == COMPUTED[key], key
    else:
        assert key not in COMPUTED, key
        assert got == default, key


def test_the_config_dataclass_has_no_default_of_its_own() -> None:
    """Every field is filled by the parser from the table: a dataclass default would be a
    second one, free to disagree (as ``load_prefetch_rows`` did)."""
    fields = {f.name: f for f in dataclasses.fields(ConnectorConfig)}
    assert set(fields) == {"store_config", *CONNECTOR_KEYS}
    with_default = [
        name
        for name, f in fields.items()
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert with_default == []


def test_the_layout_takes_chunk_tokens_from_the_config_only() -> None:
    for fn in (KVLayout.__init__, KVLayout.from_vllm):
        assert "chunk_tokens" in inspect.signature(fn).parameters
        assert "chunk_tokens" not in _param_defaults(fn), fn.__qualname__


@pytest.mark.parametrize("arg", sorted(SCHEDULER_ARGS))
def test_the_dump_schedulers_defaults_are_the_keys(arg: str) -> None:
    key = SCHEDULER_ARGS[arg]
    assert key in CONNECTOR_KEYS and CONNECTOR_KEYS[key] is DUMP_KEYS[key]
    assert _param_defaults(DumpScheduler.__init__)[arg] == DUMP_KEYS[key][1], arg
    sched = DumpScheduler(CpuDevice())
    try:
        assert sched.config[arg] == getattr(parse_connector_config({}), key), arg
    finally:
        sched.shutdown()


@pytest.mark.parametrize("arg", sorted(SCHEDULER_ARGS))
def test_the_dump_scheduler_checks_its_arguments_with_the_keys_checks(arg: str) -> None:
    """Each value the key's check refuses, the scheduler refuses, naming the key; one it
    accepts, the scheduler takes."""
    key = SCHEDULER_ARGS[arg]
    check = DUMP_KEYS[key][0]
    refused, accepted = [], []
    for value in CANDIDATES:
        try:
            check(key, value)
        except SettingError:
            refused.append(value)
        else:
            accepted.append(value)
    assert refused and accepted, (key, refused, accepted)
    for value in refused:
        if arg == "workers" and value is None:
            continue  # None: the computed default
        with pytest.raises(ValueError, match=key):
            DumpScheduler(CpuDevice(), **{arg: value})
    sched = DumpScheduler(CpuDevice(), **{arg: accepted[0]})
    sched.shutdown()


@pytest.mark.parametrize(
    ("table", "cls", "prefix"),
    [(LOCAL_KEYS, LocalStore, "local_"), (MOONCAKE_KEYS, MooncakeStore, "mooncake_")],
    ids=["local", "mooncake"],
)
def test_the_stores_constructor_defaults_are_the_keys(
    table: dict[str, Any], cls: type, prefix: str
) -> None:
    """make_store passes every key; a store built directly (tests, tools, benchmarks) gets
    the same default from its constructor, or none."""
    defaults = _param_defaults(cls.__init__)
    params = inspect.signature(cls.__init__).parameters
    kind = prefix.rstrip("_")
    parsed = parse_store_config({"store": kind}).values
    for key, (_check, default, _help) in table.items():
        arg = key[len(prefix) :]
        assert arg in params, f"{key}: no {cls.__name__} argument {arg!r}"
        if key == "local_path":
            continue  # the directory: required
        assert parsed[key] == default, key
        if key in DIRECT_LOCAL_STORE:
            assert defaults[arg] == DIRECT_LOCAL_STORE[key], key
        elif arg in defaults:
            assert defaults[arg] == default, f"{key}: {cls.__name__}({arg}={defaults[arg]!r})"
