"""Per-process counters of the KV connector (both sides), for tests, the demo and logs.

The dump scheduler keeps its own metrics (:data:`ucm_patch.hooks.metrics.METRICS`); these
count what only the connector knows: lookups and hit tokens, loads, load errors, pinned
blocks, delayed frees. Counters only grow; :func:`snapshot` copies them.

Updated per step or per request, never per layer, from the scheduler thread, the forward
thread and the load threads, hence the lock. The ``*_s`` counters are seconds (floats):
where a load's time goes (:data:`SECONDS`).
"""

from __future__ import annotations

import threading

COUNTERS = (
    "lookups",
    "lookup_errors",
    "hit_requests",
    "hit_tokens",
    "loads_layerwise",
    "loads_sync_fallback",
    "loads_async",
    "rows_waited_in_layer",
    "loaded_pages",
    "load_errors",
    "load_failed_requests",
    "load_exceptions",
    "dump_steps",
    "dump_blocks",
    "dump_blocks_already_stored",
    "state_offer_mismatches",
    "dump_pages",
    "dump_pages_eager",
    "dump_pages_out_of_range",
    "pinned_blocks",
    "unpinned_blocks",
    "delayed_frees",
    "finished_sending",
    "finished_recving",
)
#: Seconds of the hits: the scheduler looking up the stored prefix (lookup), the load
#: threads' store calls (read: into host buffers for a device's cache, or straight into
#: the blocks of a cache in host memory) and their copies from those buffers into a
#: device's cache (copy: 0 where the store wrote the blocks itself), summed over threads,
#: and the forward thread waiting for a layerwise row it needs (stall).
SECONDS = ("lookup_s", "load_read_s", "load_copy_s", "load_stall_s")

_lock = threading.Lock()
_values: dict[str, float] = {**dict.fromkeys(COUNTERS, 0), **dict.fromkeys(SECONDS, 0.0)}


def bump(name: str, n: float = 1) -> None:
    """Add ``n`` to counter ``name`` (KeyError for an unknown name: a typo is a bug)."""
    with _lock:
        _values[name] += n


def snapshot() -> dict[str, float]:
    """A copy of every counter."""
    with _lock:
        return dict(_values)


def reset() -> None:
    """Zero every counter (tests)."""
    with _lock:
        for key in _values:
            _values[key] = 0.0 if key in SECONDS else 0
