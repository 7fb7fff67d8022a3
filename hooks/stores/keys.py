"""The store keys of vLLM's ``kv_connector_extra_config``: one table per store, the one
source of each key's default and check (:func:`~ucm_patch.hooks.stores.parse_store_config`
checks what the user wrote with them; the stores' constructors take their defaults from
:func:`key_default`, so that a store built directly, by a test or a tool, and one built
from the config agree)."""

from __future__ import annotations

from typing import Any

from ucm_patch.hooks import value_checks as v
from ucm_patch.hooks.value_checks import parse_size

# key -> (parser, default, help). A default of None means "computed" (see make_store).
LOCAL_KEYS: v.Table = {
    "local_path": (v.path, None, "directory (default: user cache dir /ucm_patch/kv)"),
    "local_capacity_bytes": (
        v.size_at_least(1),
        None,
        "LRU capacity for the directory, shared by all processes (default 10GiB, capped at "
        "start by free space + bytes stored); at least 4 of the connector's largest values, "
        "else refused at start",
    ),
    "local_memory_bytes": (
        parse_size,
        None,
        "memory tier shared by the host's processes, spilling to local_path; 0 disables it "
        "(default: an eighth of the tmpfs, at most 2GiB, left out when under 4 of the "
        "connector's largest values); a set size under that is refused at start",
    ),
    "local_memory_path": (
        v.path,
        None,
        "memory tier directory, on a tmpfs (default: $XDG_RUNTIME_DIR/ucm_patch/<id>, "
        "else /dev/shm/ucm_patch-<uid>/<id>)",
    ),
    "local_memory_keep_bytes": (
        parse_size,
        0,
        "bytes of the memory tier kept in the tmpfs once no process uses it (a restarted "
        "server reads them warm): the last process to close the store spills the rest to "
        "local_path first. 0 (default): spilled in full and the tier removed, so a stopped "
        "server gives its RAM back, as vLLM's own CPU offloading does",
    ),
    "local_segment_bytes": (
        v.size_at_least(4096),
        64 << 20,
        "size of the files values are packed into, fixed per directory at its creation "
        "(default 64MiB; grown to hold the connector's largest value; a directory made "
        "with smaller ones is refused at start)",
    ),
    "local_fsync": (v.flag, False, "fsync segment + index on every put (default false)"),
    "local_dir_mode": (v.file_mode(0o700), 0o700, "mode of new directories (default 0700)"),
    "local_file_mode": (v.file_mode(0o600), 0o600, "mode of new store files (default 0600)"),
}
MOONCAKE_KEYS: v.Table = {
    "mooncake_master": (v.host_port, "127.0.0.1:50051", "master RPC address host:port"),
    "mooncake_protocol": (v.one_of("tcp", "rdma"), "tcp", "transfer protocol"),
    "mooncake_metadata_server": (v.text, "P2PHANDSHAKE", "P2PHANDSHAKE or an http:// URL"),
    "mooncake_local_hostname": (v.text, "127.0.0.1", "address other clients reach us at"),
    "mooncake_rdma_devices": (v.any_text, "", "RDMA device names (rdma only)"),
    "mooncake_global_segment_bytes": (parse_size, 1 << 30, "memory this client contributes"),
    "mooncake_local_buffer_bytes": (v.size_at_least(1 << 20), 16 << 20, "client local buffer"),
    "mooncake_staging_bytes": (
        v.size_at_least(64 << 10),
        64 << 20,
        "size of each registered buffer",
    ),
    "mooncake_staging_buffers": (v.int_in(1, 64), 2, "registered buffers (concurrent ops)"),
    "mooncake_quarantine_s": (
        v.seconds_up_to(3600),
        60.0,
        "hold-back of a buffer after a failed transfer",
    ),
    "mooncake_setup_retries": (v.int_in(1, 1000), None, "MC_STORE_CLIENT_SETUP_RETRIES"),
}
STORE_KEYS = frozenset({"store", *LOCAL_KEYS, *MOONCAKE_KEYS})


def key_default(key: str) -> Any:
    """The table's default of store key ``key`` (None: computed, as its help says)."""
    return (LOCAL_KEYS if key.startswith("local_") else MOONCAKE_KEYS)[key][1]


__all__ = ["LOCAL_KEYS", "MOONCAKE_KEYS", "STORE_KEYS", "key_default"]
