"""Parse and validate the connector's ``kv_connector_extra_config`` (fail at start, not later).

vLLM hands the connector whatever JSON the user wrote after ``--kv-transfer-config``. A
misspelt key would otherwise be ignored silently and the deployment would run with a
default it never asked for, so every key is checked here, when the connector is built:
an unknown key or a bad value raises :class:`ConnectorConfigError` (a ``ValueError``)
naming the key and the accepted values.

Two kinds of keys share the dict:

* store keys (``store`` and every ``local_*`` / ``mooncake_*`` key): validated by
  :func:`ucm_patch.hooks.stores.parse_store_config`, which owns them, once: the
  :class:`~ucm_patch.hooks.stores.StoreConfig` it returns is what the store is built from;
* connector keys (:data:`CONNECTOR_KEYS`): how loads and dumps are run; the dump
  engine's own (``dump_*``, ``blocking_finish``) come from its table,
  :data:`ucm_patch.hooks.dump.keys.DUMP_KEYS`, which its scheduler reads too.

Each key has one default and one check, in its table; :class:`ConnectorConfig` has no
defaults of its own (:func:`parse_connector_config` fills every field). Every value check
is :mod:`ucm_patch.hooks.value_checks`'s (one module for every table).

Nothing here imports vLLM or torch: the parser is usable (and tested) without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucm_patch.hooks import value_checks as v
from ucm_patch.hooks.dump.keys import DUMP_KEYS, copy_threads
from ucm_patch.hooks.stores import (
    STORE_KEYS,
    StoreConfig,
    StoreConfigError,
    parse_store_config,
    split_store_config,
)
from ucm_patch.hooks.value_checks import SettingError

LOAD_MODES = ("auto", "layerwise", "async")
#: Tokens of one attention value by default (``chunk_tokens``): LMCache's chunk size; 16
#: GPU pages of 64 KiB (16-token blocks) make a 1 MiB value.
CHUNK_TOKENS = 256


class ConnectorConfigError(SettingError):
    """A ``kv_connector_extra_config`` key is unknown or has a bad value (message names it)."""


# key -> (parser, default, help)
CONNECTOR_KEYS: v.Table = {
    "namespace": (
        v.text,
        None,
        "replaces the model path and the weight files' mtimes in the key fingerprint "
        "(their names, sizes and sampled content still count); set the same value on "
        "instances that load the same weights from different paths or hosts",
    ),
    "chunk_tokens": (
        v.int_in(1, 1 << 20),
        CHUNK_TOKENS,
        "tokens of one stored attention value: that many tokens of whole blocks of one "
        "row (at least one block), stored back to back; hits are whole chunks. 256 makes "
        "1 MiB values of 64 KiB GPU pages (docs/CONNECTOR.md#chunks)",
    ),
    "load_mode": (
        v.one_of(*LOAD_MODES),
        "auto",
        "layerwise: load row by row during the forward (one attention KV-cache group "
        "only); async: load between steps; auto: layerwise when possible, else async",
    ),
    "load_prefetch_rows": (
        v.int_in(1, 64),
        None,
        "rows loaded ahead of the forward (layerwise); default: load_workers",
    ),
    "load_workers": (
        v.int_in(1, 32),
        None,
        "threads reading the store for loads; default: copy_threads() (a quarter of the "
        "CPUs this process may run on, 2 to 8)",
    ),
    **DUMP_KEYS,
}


@dataclass(frozen=True)
class ConnectorConfig:
    """The validated ``kv_connector_extra_config``: the store's part parsed once into
    :attr:`store_config` (what ``make_store`` builds from), the connector's keys below
    (no defaults here: each key's is in :data:`CONNECTOR_KEYS`)."""

    store_config: StoreConfig
    namespace: str | None
    chunk_tokens: int
    load_mode: str
    load_prefetch_rows: int
    load_workers: int
    dump_workers: int
    dump_queue_capacity: int
    dump_on_full: str
    dump_full_wait_s: float
    dump_exit_flush_s: float | None
    blocking_finish: bool

    @property
    def store_kind(self) -> str:
        return self.store_config.kind

    @property
    def store(self) -> Mapping[str, Any]:
        """Every store key with its parsed value (read-only)."""
        return self.store_config.values

    def describe(self) -> str:
        """One line for the start-up log."""
        where = self.store.get("local_path") or self.store.get("mooncake_master")
        return (
            f"store={self.store_kind}({where}) load_mode={self.load_mode} "
            f"prefetch_rows={self.load_prefetch_rows} dump_workers={self.dump_workers}"
        )


def accepted_keys() -> list[str]:
    """Every key the connector accepts (connector keys and store keys)."""
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
    for key in rest:
        if key not in CONNECTOR_KEYS:
            raise ConnectorConfigError(
                f"{key}: unknown kv_connector_extra_config key for UCMPatchConnector; "
                f"accepted keys: {accepted_keys()}"
            )
    values = v.parse_table(CONNECTOR_KEYS, rest, ConnectorConfigError)
    for key in ("load_workers", "dump_workers"):
        if values[key] is None:
            values[key] = copy_threads()
    if values["load_prefetch_rows"] is None:  # every load thread has a row to read
        values["load_prefetch_rows"] = values["load_workers"]
    try:
        store = parse_store_config(store_part)
    except StoreConfigError as exc:
        raise ConnectorConfigError(str(exc)) from exc
    return ConnectorConfig(store_config=store, **values)
