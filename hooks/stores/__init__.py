"""KV block stores and :func:`make_store`, which builds one from connector config.

The config is the store part of vLLM's ``kv_connector_extra_config``::

    {"store": "local", "local_path": "/data/kv", "local_capacity_bytes": "64GiB"}
    {"store": "mooncake", "mooncake_master": "10.0.0.5:50051", "mooncake_protocol": "tcp"}

With no config at all a local store under the user's cache directory is used
(``$XDG_CACHE_HOME/ucm_patch/kv``, else ``~/.cache/ucm_patch/kv``). Every key is validated:
an unknown key, a key of the other store, or a bad value raises :class:`StoreConfigError`
(a ``ValueError``) that names the key and lists what is accepted. The connector's own keys
do not belong here: :func:`split_store_config` separates them by prefix.

Sizes are ints (bytes) or strings with a binary unit: ``"512MiB"``, ``"64GiB"``. Decimal
units (``"GB"``) are refused because tools disagree on whether they mean 10^9 or 2^30.
Importing this package never imports ``mooncake``; only building a Mooncake store does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from ucm_patch.hooks.stores.base import KVStore, StoreError

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_HOST_PORT_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):(?P<port>\d{1,5})$")
STORE_KINDS = ("local", "mooncake")
PREFIXES = ("local_", "mooncake_")


class StoreConfigError(ValueError):
    """A store config key is unknown or its value is invalid; the message names the key."""


# -- value parsers: (key, value) -> parsed value, raising StoreConfigError -------------------


def parse_size(key: str, value: object, minimum: int = 0) -> int:
    """Bytes from an int or a ``"<number><KiB|MiB|GiB|TiB>"`` string."""
    if isinstance(value, bool):
        raise StoreConfigError(f"{key}: expected a size in bytes, got bool {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise StoreConfigError(
                f"{key}: unknown unit {m.group(2)!r} in {value!r}; use bytes or one of "
                "KiB, MiB, GiB, TiB"
            )
        size = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise StoreConfigError(
            f"{key}: expected a size (int bytes or a string like '512MiB'), got {value!r}"
        )
    if size < minimum:
        raise StoreConfigError(f"{key}: must be at least {minimum} bytes, got {value!r}")
    return size


def _positive_size(key: str, value: object) -> int:
    return parse_size(key, value, minimum=1)


def _staging_size(key: str, value: object) -> int:
    return parse_size(key, value, minimum=64 << 10)


def _local_buffer_size(key: str, value: object) -> int:
    return parse_size(key, value, minimum=1 << 20)


def _segment_size(key: str, value: object) -> int:
    return parse_size(key, value, minimum=4096)


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise StoreConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _int_in(lo: int, hi: int) -> Callable[[str, object], int]:
    def parse(key: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise StoreConfigError(f"{key}: expected an int in [{lo}, {hi}], got {value!r}")
        return value

    return parse


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
        raise StoreConfigError(f"{key}: expected seconds in (0, 3600], got {value!r}")
    return float(value)


def _text(key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise StoreConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _any_text(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise StoreConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _path(key: str, value: object) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return os.path.expanduser(_text(key, value))


def _one_of(*choices: str) -> Callable[[str, object], str]:
    def parse(key: str, value: object) -> str:
        if value not in choices:
            raise StoreConfigError(f"{key}: expected one of {list(choices)}, got {value!r}")
        return value  # type: ignore[return-value]

    return parse


def _host_port(key: str, value: object) -> str:
    m = _HOST_PORT_RE.match(value) if isinstance(value, str) else None
    if m is None or not 0 < int(m.group("port")) < 65536:
        raise StoreConfigError(f"{key}: expected 'host:port' (port 1-65535), got {value!r}")
    return value  # type: ignore[return-value]


def _mode(owner_bits: int) -> Callable[[str, object], int]:
    """A permission mode (int like 0o700 or an octal string like "0700") that keeps the
    owner's ``owner_bits``: a mode that locks the store out of its own files would only
    fail later, one put at a time."""

    def parse(key: str, value: object) -> int:
        mode: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            mode = value
        elif isinstance(value, str) and re.fullmatch(r"\s*(0o?)?[0-7]{1,4}\s*", value):
            mode = int(value.strip().removeprefix("0o") or "0", 8)
        if mode is None or not 0 <= mode <= 0o777:
            raise StoreConfigError(
                f"{key}: expected a permission mode such as 0o{owner_bits:o} or "
                f"'0{owner_bits:o}' (octal, at most 0777), got {value!r}"
            )
        if mode & owner_bits != owner_bits:
            raise StoreConfigError(
                f"{key}: the owner needs at least 0{owner_bits:o} (read/write"
                f"{'/search' if owner_bits & 0o100 else ''}), got 0{mode:o}"
            )
        return mode

    return parse


def default_local_path() -> str:
    """``$XDG_CACHE_HOME/ucm_patch/kv``, else ``~/.cache/ucm_patch/kv``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ucm_patch", "kv")


# key -> (parser, default, help). A default of None means "computed" (see make_store).
LOCAL_KEYS: dict[str, tuple[Callable[[str, object], Any], Any, str]] = {
    "local_path": (_path, None, "directory (default: user cache dir /ucm_patch/kv)"),
    "local_capacity_bytes": (
        _positive_size,
        None,
        "LRU capacity for the directory, shared by all processes (default 10GiB, capped at "
        "start by free space + bytes stored)",
    ),
    "local_memory_bytes": (
        parse_size,
        None,
        "memory tier shared by the host's processes, spilling to local_path; 0 disables it "
        "(default: an eighth of the tmpfs, at most 2GiB)",
    ),
    "local_memory_path": (
        _path,
        None,
        "memory tier directory, on a tmpfs (default: $XDG_RUNTIME_DIR/ucm_patch/<id>, "
        "else /dev/shm/ucm_patch-<uid>/<id>)",
    ),
    "local_segment_bytes": (
        _segment_size,
        64 << 20,
        "size of the files values are packed into, fixed per directory at its creation "
        "(default 64MiB; a value must fit in one)",
    ),
    "local_fsync": (_bool, False, "fsync segment + index on every put (default false)"),
    "local_dir_mode": (_mode(0o700), 0o700, "mode of new directories (default 0700)"),
    "local_file_mode": (_mode(0o600), 0o600, "mode of new store files (default 0600)"),
}
MOONCAKE_KEYS: dict[str, tuple[Callable[[str, object], Any], Any, str]] = {
    "mooncake_master": (_host_port, "127.0.0.1:50051", "master RPC address host:port"),
    "mooncake_protocol": (_one_of("tcp", "rdma"), "tcp", "transfer protocol"),
    "mooncake_metadata_server": (_text, "P2PHANDSHAKE", "P2PHANDSHAKE or an http:// URL"),
    "mooncake_local_hostname": (_text, "127.0.0.1", "address other clients reach us at"),
    "mooncake_rdma_devices": (_any_text, "", "RDMA device names (rdma only)"),
    "mooncake_global_segment_bytes": (parse_size, 1 << 30, "memory this client contributes"),
    "mooncake_local_buffer_bytes": (_local_buffer_size, 16 << 20, "client local buffer"),
    "mooncake_staging_bytes": (_staging_size, 64 << 20, "size of each registered buffer"),
    "mooncake_staging_buffers": (_int_in(1, 64), 2, "registered buffers (concurrent ops)"),
    "mooncake_quarantine_s": (_seconds, 60.0, "hold-back of a buffer after a failed transfer"),
    "mooncake_setup_retries": (_int_in(1, 1000), None, "MC_STORE_CLIENT_SETUP_RETRIES"),
}
_KEYS_OF = {"local": LOCAL_KEYS, "mooncake": MOONCAKE_KEYS}
STORE_KEYS = frozenset({"store", *LOCAL_KEYS, *MOONCAKE_KEYS})


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


def parse_store_config(config: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """Validate ``config``; return the store kind and every key with its parsed value."""
    config = dict(config or {})
    kind = config.pop("store", "local")
    if kind not in STORE_KINDS:
        raise StoreConfigError(f"store: expected one of {list(STORE_KINDS)}, got {kind!r}")
    accepted = _KEYS_OF[kind]
    parsed: dict[str, Any] = {}
    for key, value in config.items():
        if key not in accepted:
            other = next((k for k, keys in _KEYS_OF.items() if key in keys), None)
            why = f"it belongs to store {other!r}" if other else "unknown key"
            raise StoreConfigError(
                f"{key}: not accepted for store {kind!r} ({why}); accepted keys: "
                f"{sorted(['store', *accepted])}"
            )
        parsed[key] = accepted[key][0](key, value)
    for key, (_parser, default, _help) in accepted.items():
        parsed.setdefault(key, default)
    if kind == "local" and parsed["local_path"] is None:
        parsed["local_path"] = default_local_path()
    return kind, parsed


def make_store(config: Mapping[str, Any] | None = None) -> KVStore:
    """Build the configured store (default: a local store in the user's cache dir).

    Raises :class:`StoreConfigError` for bad config and :class:`StoreError` when the store
    cannot start (directory not creatable, Mooncake master unreachable).
    """
    kind, c = parse_store_config(config)
    if kind == "local":
        from ucm_patch.hooks.stores.local import LocalStore, default_memory_bytes

        memory_path = c["local_memory_path"]
        memory_bytes = c["local_memory_bytes"]
        if memory_bytes is None:
            memory_bytes = default_memory_bytes(memory_path, c["local_path"])
        return LocalStore(
            c["local_path"],
            c["local_capacity_bytes"],
            fsync=c["local_fsync"],
            dir_mode=c["local_dir_mode"],
            file_mode=c["local_file_mode"],
            memory_bytes=memory_bytes,
            memory_path=memory_path,
            segment_bytes=c["local_segment_bytes"],
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
    "StoreConfigError",
    "StoreError",
    "default_local_path",
    "make_store",
    "parse_size",
    "parse_store_config",
    "split_store_config",
]
