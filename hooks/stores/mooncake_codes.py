"""Mooncake Store's status codes, and what this store makes of each: a put stored,
skipped (the cluster is full) or failed; a get's miss; and which rejections leave a
registered buffer safe to reuse (any other may leave a transfer running into it: the
buffer is then quarantined, :mod:`.mooncake_buffers`).
"""

from __future__ import annotations

OK = 0
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
RPC_FAIL = -900
RPC_TIMEOUT = -901

CODE_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}

# Rejections that happen before any transfer is submitted (or after it completed): the
# buffer may be reused. Anything else may leave I/O in flight into the buffer.
_SAFE_COMMON = frozenset(
    {NO_AVAILABLE_HANDLE, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS}
    | {RPC_FAIL, RPC_TIMEOUT}
)
SAFE_PUT = _SAFE_COMMON | {INVALID_PARAMS}
SAFE_GET = _SAFE_COMMON | {INVALID_PARAMS, LEASE_EXPIRED}  # -600: buffer too small
MISS = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, LEASE_EXPIRED})


def code_name(rc: int) -> str:
    """``-900 (RPC_FAIL)`` style text for an error message."""
    return f"{rc} ({CODE_NAMES.get(rc, 'unknown')})"
