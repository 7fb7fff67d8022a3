"""KV block stores and :func:`make_store`, which builds one from connector config.

The config is the store part of vLLM's ``kv_connector_extra_config``::

    {"store": "local", "local_path": "/data/kv", "local_capacity_bytes": "64GiB"}
    {"store": "mooncake", "mooncake_master": "10.0.0.5:50051", "mooncake_protocol": "tcp"}

With no config at all a local store under the user's cache directory is used
(``$XDG_CACHE_HOME/ucm_patch/kv``, else ``~/.cache/ucm_patch/kv``). Every key is validated:
an unknown key, a key of the other store, or a bad value raises :class:`StoreConfigError`
(a ``ValueError``) that names the key and lists what is accepted. The connector's own keys
do not belong here: :func:`split_store_config` separates them by prefix.

Values are checked by :mod:`ucm_patch.hooks.value_checks` (sizes: ints or ``"512MiB"``-style
strings). The config is parsed once into a :class:`StoreConfig`, which the connector keeps
and :func:`make_store` builds from. Importing this package never imports ``mooncake``; only
building a Mooncake store does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from ucm_patch import environment
from ucm_patch.hooks import value_checks as v
from ucm_patch.hooks.stores.base import KVStore, StoreConfigError, StoreError, ValueSizeError
from ucm_patch.hooks.stores.keys import LOCAL_KEYS, MOONCAKE_KEYS, STORE_KEYS, key_default
from ucm_patch.hooks.value_checks import parse_size

STORE_KINDS = ("local", "mooncake")
PREFIXES = ("local_", "mooncake_")


class StoreConfig(NamedTuple):
    """A validated store config, what :func:`make_store` builds from: the store kind and
    every key of that kind with its parsed value (defaults filled in, read-only)."""

    kind: str
    values: Mapping[str, Any]


def default_local_path() -> str:
    """``$XDG_CACHE_HOME/ucm_patch/kv``, else ``~/.cache/ucm_patch/kv``."""
    return os.path.join(environment.user_cache_dir(), "kv")


_KEYS_OF = {"local": LOCAL_KEYS, "mooncake": MOONCAKE_KEYS}


def split_store_config(extra: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a ``kv_connector_extra_config`` into (store keys, other keys) by prefix.

    ``store`` and every key starting with ``local_`` or ``mooncake_`` belong to the store,
    so a misspelt store key is rejected by :func:`make_store` instead of being ignored.
    """
    store: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in extra.items():
        is_store = key == "store" or (isinstance(key, str) and key.startswith(PREFIXES))
        (store if is_store else rest)[key] = value
    return store, rest


def parse_store_config(config: Mapping[str, Any] | None) -> StoreConfig:
    """Validate ``config`` (the store keys as the user gave them), once."""
    config = dict(config or {})
    kind = config.pop("store", "local")
    if kind not in STORE_KINDS:
        raise StoreConfigError(f"store: expected one of {list(STORE_KINDS)}, got {kind!r}")
    accepted = _KEYS_OF[kind]
    for key in config:
        if key not in accepted:
            other = next((k for k, keys in _KEYS_OF.items() if key in keys), None)
            why = f"it belongs to store {other!r}" if other else "unknown key"
            raise StoreConfigError(
                f"{key}: not accepted for store {kind!r} ({why}); accepted keys: "
                f"{sorted(['store', *accepted])}"
            )
    parsed = v.parse_table(accepted, config, StoreConfigError)
    if kind == "local" and parsed["local_path"] is None:
        parsed["local_path"] = default_local_path()
    return StoreConfig(kind, MappingProxyType(parsed))


def make_store(
    config: StoreConfig | Mapping[str, Any] | None = None, *, value_bytes: int = 0
) -> KVStore:
    """Build the configured store (default: a local store in the user's cache dir) from a
    :class:`StoreConfig`, or from the raw keys (parsed here, once).

    ``value_bytes``: the largest value the caller will put (the connector's, from its
    layout; 0: not known). A local store's segments are made to hold one, or the config
    is refused here, naming the keys and the size (:class:`~.local.LocalStore`); a memory
    tier of the default size too small for it is left out, with a warning.

    Raises :class:`StoreConfigError` for bad config and :class:`StoreError` when the store
    cannot start (directory not creatable, Mooncake master unreachable).
    """
    kind, c = config if isinstance(config, StoreConfig) else parse_store_config(config)
    if kind == "local":
        from ucm_patch.hooks.stores.local import LocalStore, default_memory_bytes

        memory_path = c["local_memory_path"]
        memory_bytes = c["local_memory_bytes"]
        if memory_bytes is None:
            memory_bytes = default_memory_bytes(memory_path, c["local_path"], value_bytes)
        return LocalStore(
            c["local_path"],
            c["local_capacity_bytes"],
            fsync=c["local_fsync"],
            dir_mode=c["local_dir_mode"],
            file_mode=c["local_file_mode"],
            memory_bytes=memory_bytes,
            memory_path=memory_path,
            segment_bytes=c["local_segment_bytes"],
            value_bytes=value_bytes,
            memory_keep_bytes=c["local_memory_keep_bytes"],
        )
    from ucm_patch.hooks.stores.mooncake import MooncakeStore

    return MooncakeStore(
        master=c["mooncake_master"],
        protocol=c["mooncake_protocol"],
        metadata_server=c["mooncake_metadata_server"],
        local_hostname=c["mooncake_local_hostname"],
        rdma_devices=c["mooncake_rdma_devices"],
        global_segment_bytes=c["mooncake_global_segment_bytes"],
        local_buffer_bytes=c["mooncake_local_buffer_bytes"],
        staging_bytes=c["mooncake_staging_bytes"],
        staging_buffers=c["mooncake_staging_buffers"],
        quarantine_s=c["mooncake_quarantine_s"],
        setup_retries=c["mooncake_setup_retries"],
    )


__all__ = [
    "LOCAL_KEYS",
    "MOONCAKE_KEYS",
    "STORE_KEYS",
    "KVStore",
    "StoreConfig",
    "StoreConfigError",
    "StoreError",
    "ValueSizeError",
    "default_local_path",
    "key_default",
    "make_store",
    "parse_size",
    "parse_store_config",
    "split_store_config",
]
