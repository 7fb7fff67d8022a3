"""The process's one dump scheduler: every KV-connector instance of a worker process
shares it (:func:`get_scheduler`), and it enters the process's exit sequence
(:mod:`ucm_patch.hooks.exit_sequence`) in its flush phase, before any store closes.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ucm_patch.hooks import exit_sequence
from ucm_patch.hooks.dump.scheduler import DumpScheduler
from ucm_patch.hooks.metrics import METRICS

_instance: DumpScheduler | None = None
_instance_pid = 0
_singleton_lock = threading.Lock()


def get_scheduler(**config: Any) -> DumpScheduler:
    """This process's DumpScheduler, created on first use with ``config``.

    Every connector instance in the process gets the same object (and should take its own
    :meth:`DumpScheduler.client`). A later call may repeat the config; a *different* value
    for a key raises ValueError naming the key (two connectors asking for incompatible
    schedulers is a configuration error). After a fork the child gets a fresh scheduler
    (threads do not survive fork). Without ``device`` the platform's device is used;
    metrics default to the process-wide ``METRICS`` (the one :func:`metrics.export` shows).
    """
    global _instance, _instance_pid
    with _singleton_lock:
        inst = _instance
        if inst is not None and _instance_pid == os.getpid() and not inst.closed:
            for key, value in config.items():
                if key not in inst.config:
                    raise TypeError(f"get_scheduler: unknown option {key!r}")
                current = inst.config[key]
                if key in ("device", "metrics"):
                    differs = value is not None and value is not current
                else:
                    differs = value != current
                if differs:
                    raise ValueError(
                        f"get_scheduler: {key}={value!r} differs from the running "
                        f"scheduler's {key}={current!r}"
                    )
            return inst
        config.setdefault("metrics", METRICS)
        inst = DumpScheduler(**config)
        _instance = inst
        _instance_pid = os.getpid()
        exit_sequence.flush_at_exit(shutdown_at_exit)  # before any store closes
        return inst


def reset_scheduler(timeout: float = 5.0, flush_s: float = 0.0) -> None:
    """Shut the singleton down and forget it (tests; exit). ``flush_s``: see
    :meth:`DumpScheduler.shutdown`."""
    global _instance
    with _singleton_lock:
        inst, _instance = _instance, None
    if inst is not None and _instance_pid == os.getpid():
        inst.shutdown(timeout, flush_s)


#: After the exit flush the join only lets idle workers go: a dump still running then is
#: stuck in its store and is counted lost (the workers are daemon threads).
EXIT_JOIN_S = 0.2


def shutdown_at_exit() -> None:
    """The exit flush, then shutdown (idempotent): the flush phase of the process's exit
    sequence (:mod:`ucm_patch.hooks.exit_sequence`), which closes the stores only after
    it, since a store closed before the flush would fail every dump still in flight."""
    with _singleton_lock:
        inst = _instance
    flush_s = inst.exit_flush_s if inst is not None else 0.0
    reset_scheduler(timeout=EXIT_JOIN_S, flush_s=flush_s)


__all__ = ["EXIT_JOIN_S", "get_scheduler", "reset_scheduler", "shutdown_at_exit"]
