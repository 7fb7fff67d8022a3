"""The dump engine's keys of vLLM's ``kv_connector_extra_config``: one table, the one
source of each key's default and check.

The connector's config parser takes these keys into its own table
(:data:`ucm_patch.connector.config.CONNECTOR_KEYS`) and checks what the user wrote with
them; :class:`~.scheduler.DumpScheduler` takes its defaults from here and checks its
arguments with the same checks, so a scheduler built without the connector (tests,
benchmarks) cannot disagree with one the connector builds.
"""

from __future__ import annotations

import os
from typing import Any

from ucm_patch.hooks import value_checks as v

#: What a full queue does with a new dump: skip it at once, or wait up to
#: ``dump_full_wait_s`` for a slot.
ON_FULL = ("skip", "wait")
#: Seconds the exit flush waits for dumps in flight when neither ``dump_exit_flush_s`` nor
#: the environment says (:func:`~.scheduler.exit_flush_seconds`).
DEFAULT_EXIT_FLUSH_S = 10.0

# key -> (check, default, help). A default of None is computed where the help says.
DUMP_KEYS: v.Table = {
    "dump_workers": (
        v.int_in(1, 32),
        None,
        "threads of the dump scheduler; default: copy_threads(), as load_workers",
    ),
    "dump_queue_capacity": (v.int_in(1, 1 << 20), 1024, "dumps in flight before back-pressure"),
    "dump_on_full": (v.one_of(*ON_FULL), "skip", "queue full: skip the dump or wait briefly"),
    "dump_full_wait_s": (v.seconds, 0.002, "longest wait for a queue slot (dump_on_full=wait)"),
    "dump_exit_flush_s": (
        v.seconds,
        None,
        "longest wait for dumps in flight at connector shutdown and at process exit (then "
        "they are counted lost); default: UCM_PATCH_DUMP_EXIT_FLUSH_S, else "
        f"{DEFAULT_EXIT_FLUSH_S:g} s",
    ),
    "blocking_finish": (
        v.flag,
        False,
        "get_finished waits for a finished request's dumps (UCM #989 behaviour) instead "
        "of reporting it in a later step",
    ),
}

#: :class:`~.scheduler.DumpScheduler`'s argument -> its key in :data:`DUMP_KEYS`.
SCHEDULER_ARGS = {
    "workers": "dump_workers",
    "capacity": "dump_queue_capacity",
    "on_full": "dump_on_full",
    "full_wait_s": "dump_full_wait_s",
    "blocking_finish": "blocking_finish",
}


def default(key: str) -> Any:
    """The default of ``key`` (None: computed, as its help says)."""
    return DUMP_KEYS[key][1]


def checked(arg: str, value: object) -> Any:
    """``value`` for the scheduler's argument ``arg``, checked by its key's check; a
    :class:`~ucm_patch.hooks.value_checks.SettingError` (a ``ValueError``) names both."""
    key = SCHEDULER_ARGS[arg]
    return DUMP_KEYS[key][0](f"DumpScheduler {arg} ({key})", value)


def copy_threads(cpus: int | None = None) -> int:
    """The default number of dump threads, and of the connector's load threads: a quarter
    of ``cpus`` (default: the CPUs this process may run on), at least 2, at most 8.

    Why it scales: every byte a dump or a load moves is copied and hashed by one of these
    threads, without the GIL (:mod:`ucm_patch.hooks.stores.memcopy`, XXH3), so a GPU's
    KV production (several GB/s) needs several of them at once; two threads on a
    16-core GPU host left the dumps behind the prefill. A quarter leaves the CPUs vLLM
    itself uses (its engine loop, tokenizers, other ranks) their share."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(8, (cpus or 1) // 4))


__all__ = [
    "DEFAULT_EXIT_FLUSH_S",
    "DUMP_KEYS",
    "ON_FULL",
    "SCHEDULER_ARGS",
    "checked",
    "copy_threads",
    "default",
]
