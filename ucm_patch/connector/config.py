"""Parse and validate the connector's ``kv_connector_extra_config`` (fail at start, not later).

vLLM hands the connector whatever JSON the user wrote after ``--kv-transfer-config``. A
misspelt key would otherwise be ignored silently and the deployment would run with a
default it never asked for, so every key is checked here, when the connector is built:
an unknown key or a bad value raises :class:`ConnectorConfigError` (a ``ValueError``)
naming the key and the accepted values.

Two kinds of keys share the dict:

* store keys (``store`` and every ``local_*`` / ``mooncake_*`` key): validated by
  :func:`ucm_patch.hooks.stores.parse_store_config`, which owns them;
* connector keys (:data:`CONNECTOR_KEYS`): how loads and dumps are run.

Nothing here imports vLLM or torch: the parser is usable (and tested) without them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ucm_patch.hooks.stores import (
    StoreConfigError,
    parse_store_config,
    split_store_config,
)

LOAD_MODES = ("auto", "layerwise", "async")
ON_FULL = ("skip", "wait")


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` key is unknown or has a bad value (message names it)."""


def _int_in(lo: int, hi: int) -> Callable[[str, object], int]:
    def parse(key: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConnectorConfigError(f"{key}: expected an int in [{lo}, {hi}], got {value!r}")
        return value

    return parse


def _one_of(*choices: str) -> Callable[[str, object], str]:
    def parse(key: str, value: object) -> str:
        if value not in choices:
            raise ConnectorConfigError(f"{key}: expected one of {list(choices)}, got {value!r}")
        return str(value)

    return parse


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConnectorConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _namespace(key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConnectorConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConnectorConfigError(f"{key}: expected a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ConnectorConfigError(f"{key}: expected a finite number >= 0, got {value!r}")
    return float(value)


# key -> (parser, default, help)
CONNECTOR_KEYS: dict[str, tuple[Callable[[str, object], Any], Any, str]] = {
    "namespace": (
        _namespace,
        None,
        "replaces the model path and the weight files' mtimes in the key fingerprint "
        "(their names, sizes and sampled content still count); set the same value on "
        "instances that load the same weights from different paths or hosts",
    ),
    "load_mode": (
        _one_of(*LOAD_MODES),
        "auto",
        "layerwise: load row by row during the forward (one attention KV-cache group "
        "only); async: load between steps; auto: layerwise when possible, else async",
    ),
    "load_prefetch_rows": (_int_in(1, 64), 2, "rows loaded ahead of the forward (layerwise)"),
    "load_workers": (_int_in(1, 32), 2, "threads reading the store for loads"),
    "dump_workers": (_int_in(1, 32), 2, "threads of the dump scheduler"),
    "dump_queue_capacity": (_int_in(1, 1 << 20), 1024, "dumps in flight before back-pressure"),
    "dump_on_full": (_one_of(*ON_FULL), "skip", "queue full: skip the dump or wait briefly"),
    "dump_full_wait_s": (_seconds, 0.002, "longest wait for a queue slot (dump_on_full=wait)"),
    "dump_exit_flush_s": (
        _seconds,
        None,
        "longest wait for dumps in flight at connector shutdown and at process exit (then "
        "they are counted lost); default: UCM_PATCH_DUMP_EXIT_FLUSH_S, else 10 s",
    ),
    "blocking_finish": (
        _bool,
        False,
        "get_finished waits for a finished request's dumps (UCM #989 behaviour) instead "
        "of reporting it in a later step",
    ),
}


@dataclass(frozen=True)
class ConnectorConfig:
    """The validated ``kv_connector_extra_config``."""

    store_kind: str
    store: dict[str, Any]
    """Every store key with its parsed value (``parse_store_config`` output)."""
    store_config: dict[str, Any]
    """The store keys as the user gave them (what :func:`make_store` takes)."""
    namespace: str | None = None
    load_mode: str = "auto"
    load_prefetch_rows: int = 2
    load_workers: int = 2
    dump_workers: int = 2
    dump_queue_capacity: int = 1024
    dump_on_full: str = "skip"
    dump_full_wait_s: float = 0.002
    dump_exit_flush_s: float | None = None
    blocking_finish: bool = False
    raw: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the start-up log."""
        where = self.store.get("local_path") or self.store.get("mooncake_master")
        return (
            f"store={self.store_kind}({where}) load_mode={self.load_mode} "
            f"prefetch_rows={self.load_prefetch_rows} dump_workers={self.dump_workers}"
        )


def accepted_keys() -> list[str]:
    """Every key the connector accepts (connector keys and store keys)."""
    from ucm_patch.hooks.stores import STORE_KEYS

    return sorted({*CONNECTOR_KEYS, *STORE_KEYS})


def parse_connector_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config``; raise :class:`ConnectorConfigError` on any fault.

    ``None`` or ``{}`` gives the defaults: a local store under the user's cache directory.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConnectorConfigError(
            f"kv_connector_extra_config: expected a JSON object, got {type(extra).__name__}"
        )
    for key in extra:
        if not isinstance(key, str):
            raise ConnectorConfigError(
                f"kv_connector_extra_config: keys must be strings, got {key!r}"
            )
    store_part, rest = split_store_config(extra)
    values: dict[str, Any] = {}
    for key, value in rest.items():
        spec = CONNECTOR_KEYS.get(key)
        if spec is None:
            raise ConnectorConfigError(
                f"{key}: unknown kv_connector_extra_config key for UCMPatchConnector; "
                f"accepted keys: {accepted_keys()}"
            )
        values[key] = spec[0](key, value)
    try:
        kind, store = parse_store_config(store_part)
    except StoreConfigError as exc:
        raise ConnectorConfigError(str(exc)) from exc
    for key, (_parser, default, _help) in CONNECTOR_KEYS.items():
        values.setdefault(key, default)
    return ConnectorConfig(
        store_kind=kind,
        store=store,
        store_config=dict(store_part),
        raw=dict(extra),
        **values,
    )
