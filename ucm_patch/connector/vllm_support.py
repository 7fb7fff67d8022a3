"""What the running vLLM lets the connector do, decided once at start, with the reason.

Two limits of older releases are found here, from the installed vLLM itself (never from a
version number alone), and each is said once, at start, as a WARNING under vLLM's logger:

* **Hybrid prefix hits** (Qwen3-Next, Qwen3.5) need the boundary GDN / Mamba states that
  vLLM offers a connector in ``SchedulerOutput.kv_connector_block_state`` (vLLM >= 0.29).
  A state is not positional, so without that offer no state can be stored and every
  hybrid lookup misses; vLLM 0.22's ``_mamba_block_aligned_split`` also asserts that no
  external tokens arrive ("External KV connector is not verified yet"), so a hit would kill
  the engine core. On such a vLLM the connector serves hybrid models as a no-op: no lookup,
  no dump (the pages would be written for nothing), no crash.
* **Keys across processes**: keys are vLLM's block hashes, chained from ``NONE_HASH``.
  Before 0.29 ``NONE_HASH`` is random per process unless ``PYTHONHASHSEED`` is set (from
  0.29 only for non-cryptographic hash functions), so another process (a restarted server,
  a second instance) can never find what this one stored. The connector still works inside
  the process, and says how to share.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

#: The vLLM release that first offers boundary states (``kv_connector_block_state``).
HYBRID_SINCE = "0.29"


def hybrid_unsupported_reason() -> str | None:
    """Why this vLLM cannot give a hybrid model prefix hits, or None when it can."""
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    if "kv_connector_block_state" in fields:
        return None
    return (
        f"hybrid prefix hits need vLLM >= {HYBRID_SINCE}: this vLLM's SchedulerOutput has "
        "no kv_connector_block_state, so the scheduler never offers the GDN/Mamba states "
        "at block boundaries that a hit must load (and vLLM 0.22's mamba split asserts "
        "'External KV connector is not verified yet' on any external token). The connector "
        "stays idle for this model: no lookups, no dumps"
    )


def random_hash_seed_reason(kv_cache_utils: Any = None, hash_algo: str | None = None) -> str | None:
    """Why this process's block hashes differ from every other process's, or None.

    ``kv_cache_utils``: vLLM's ``vllm.v1.core.kv_cache_utils`` (imported when omitted);
    ``hash_algo``: ``cache_config.prefix_caching_hash_algo``.
    """
    if os.environ.get("PYTHONHASHSEED") is not None:
        return None
    if kv_cache_utils is None:
        from vllm.v1.core import kv_cache_utils
    if hasattr(kv_cache_utils, "resolve_none_hash_seed"):  # vLLM >= 0.29
        if not (hash_algo or "").startswith("xxhash"):
            return None  # a fixed seed for cryptographic hashes: shareable
        why = f"prefix_caching_hash_algo={hash_algo!r} seeds NONE_HASH randomly per process"
    else:
        why = "this vLLM (< 0.29) seeds NONE_HASH randomly per process"
    return (
        f"PYTHONHASHSEED is not set and {why}: block hashes, and so the connector's keys, "
        "differ in every process, and nothing stored here can be found by a restarted "
        "server or another instance. Set PYTHONHASHSEED to the same value for every vLLM "
        "process that shares the store (e.g. PYTHONHASHSEED=0)"
    )
