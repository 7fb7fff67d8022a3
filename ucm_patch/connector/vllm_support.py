"""What the running vLLM lets the connector do, decided once at start, with the reason.

Two limits of older releases are found here, from the installed vLLM itself (never from a
version number alone), and each is said once, at start, as a WARNING under vLLM's logger:

* **Hybrid prefix hits** (Qwen3-Next, Qwen3.5) need the boundary GDN / Mamba states that
  vLLM offers a connector in ``SchedulerOutput.kv_connector_block_state`` (vLLM >= 0.29).
  On 0.26 to 0.28 the connector finds them by position (the block a step ending on a
  boundary wrote, confirmed by its hash: ``SchedulerSide._boundary_offers``), where the
  scheduler lets an async load past the mamba align split and keeps its blocks out of
  the step's KV zeroing. Elsewhere (vLLM 0.22's ``_mamba_block_aligned_split`` asserts
  that no external tokens arrive, "External KV connector is not verified yet", so a hit
  would kill the engine core, unless the ``hybrid_async_load`` patch backports 0.23's and
  0.26's fixes there), and by design with speculative decoding or a hash block
  finer than the mamba block, the connector serves hybrid models as a no-op: no lookup,
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
#: The releases that serve hybrid prefix hits, as a refusal names them: 0.22 - 0.25 through
#: the ``hybrid_async_load`` patch (patches/vllm/hybrid_async_load.py: 0.22's split and
#: zeroing, 0.23 - 0.25's zeroing), 0.26 on by their own scheduler.
HYBRID_RELEASES = "vLLM 0.22 - 0.25 with the hybrid_async_load patch applied, or vLLM >= 0.26"

#: What a scheduler without state offers must show in its own source for the connector to
#: find the states by position instead (:meth:`SchedulerSide._boundary_offers`), besides
#: an async load that never runs the mamba align split (:func:`async_load_skips_align_split`:
#: the split asserts that no external token arrives on 0.22): the blocks of an async load
#: left out of the step's KV zeroing (0.26+; before, the zeroing could race the load's
#: write into them).
ZEROING_MARK = "_skip_zero_block_ids"
#: What the missing marks are called in a refusal.
SPLIT_MARK = "an async load past the mamba align split"


def async_load_skips_align_split(source: str) -> bool:
    """Whether the scheduler ``source`` (its class) never runs the mamba align split
    (``_mamba_block_aligned_split``) for a request whose load is async: a split under
    ``if ... and not load_kv_async`` (vLLM 0.23 - 0.26), or only in the branch after
    ``if load_kv_async:`` (0.27+). 0.22 runs it for every waiting request, and its
    assert kills the engine core on an external token. Read from the syntax tree
    (:func:`ucm_patch.mamba_split.skips_split_for_async`, the rule the
    ``hybrid_async_load`` patch reads too); unparsable source counts as no."""
    import ast

    from ucm_patch.mamba_split import skips_split_for_async

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return skips_split_for_async(tree)


def offers_states(scheduler_output_cls: Any = None) -> bool:
    """Whether vLLM offers boundary states in ``SchedulerOutput.kv_connector_block_state``."""
    if scheduler_output_cls is None:
        from vllm.v1.core.sched.output import SchedulerOutput as scheduler_output_cls
    return "kv_connector_block_state" in {f.name for f in dataclasses.fields(scheduler_output_cls)}


def hybrid_unsupported_reason(
    vllm_config: Any = None, scheduler_source: str | None = None,
    scheduler_output_cls: Any = None, hash_block_size: int = 0, state_block_size: int = 0,
    backported: bool | None = None,
) -> str | None:  # fmt: skip
    """Why this vLLM cannot give a hybrid model prefix hits, or None when it can.

    vLLM >= 0.29 offers the boundary states. Before, the connector finds them by
    position where the scheduler's own source shows that an async load skips the align
    split (:func:`async_load_skips_align_split`) and :data:`ZEROING_MARK` (vLLM 0.26 to
    0.28), except, by design, with speculative decoding (its mamba blocks move)
    or a hash block finer than the state block (``prefix_match_unit``: a state is
    copied into a block of its own): 0.29's offers follow those moves, a position
    cannot. On vLLM 0.22 - 0.25 the ``hybrid_async_load`` patch gives the scheduler both
    (:func:`_async_load_backported`; ``backported``, tests: whether it did).
    ``scheduler_source`` (tests): the scheduler's source instead of vLLM's."""
    if offers_states(scheduler_output_cls):
        return None
    if scheduler_source is None:
        scheduler_source = _scheduler_source()
    if backported is None:
        backported = _async_load_backported()
    missing = []
    if not backported:
        if not async_load_skips_align_split(scheduler_source):
            missing.append(SPLIT_MARK)
        if ZEROING_MARK not in scheduler_source:
            missing.append(f"{ZEROING_MARK!r}")
    if missing:
        return (
            f"hybrid prefix hits need {HYBRID_RELEASES}: this vLLM's SchedulerOutput has no "
            "kv_connector_block_state (the GDN/Mamba states at block boundaries that a hit "
            "must load, offered from 0.29), and its scheduler lacks what finding them by "
            f"position needs: {' and '.join(missing)} (the align split asserts 'External "
            "KV connector is not verified yet' on 0.22; before 0.26 the step's KV zeroing "
            "of an async load's blocks could race the load; on 0.22 - 0.25 the "
            "hybrid_async_load patch backports what is missing unless switched off or "
            "failed: ucm-patch status says which). The connector stays idle for "
            "this model: no lookups, no dumps"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        return (
            f"hybrid prefix hits need vLLM >= {HYBRID_SINCE} with speculative decoding: its "
            "mamba blocks move, and this vLLM does not say where (kv_connector_block_state). "
            "The connector stays idle for this model: no lookups, no dumps"
        )
    if hash_block_size and hash_block_size < state_block_size:
        return (
            f"hybrid prefix hits need vLLM >= {HYBRID_SINCE} with a hash block "
            f"({hash_block_size} tokens) finer than the mamba block ({state_block_size}; "
            "prefix_match_unit): a state is then copied into a block of its own, and this "
            "vLLM does not say which (kv_connector_block_state). The connector stays idle "
            "for this model: no lookups, no dumps"
        )
    return None


#: The patch that gives vLLM 0.22's scheduler what :data:`SPLIT_MARK` and
#: :data:`ZEROING_MARK` name (patches/vllm/hybrid_async_load.py), as its record ids start.
BACKPORT_PATCH = "hybrid_async_load@"


def _async_load_backported() -> bool:
    """Whether the ``hybrid_async_load`` patch wraps this process's ``Scheduler.schedule``
    (the installer marks what it installs with the record's id)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from ucm_patch.installer import MARKER

    installed = Scheduler.__dict__.get("schedule")
    return str(getattr(installed, MARKER, "")).startswith(BACKPORT_PATCH)


def _scheduler_source() -> str:
    """The installed vLLM scheduler's source ("": not readable, e.g. an install of
    compiled files only, where no mark is found and hybrid hits are refused)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    try:
        return inspect.getsource(Scheduler)
    except (OSError, TypeError):
        return ""


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
