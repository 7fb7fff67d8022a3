"""What a matrix child (scripts/matrix_child.py) runs in vLLM's worker processes too.

vLLM 0.22 on CPU runs its worker in a process of its own even in single-process mode;
the child reaches it with ``LLM.collective_rpc``, which pickles a function of an
importable module by reference (one of the child's own ``__main__`` would travel by
value, with the handler and locks it refers to). Each worker process has its own store,
loggers and connector counters.
"""

from __future__ import annotations

import logging
from typing import Any


def raise_on_read() -> None:
    """From now on every read of a local store raises (not a ``StoreError``: a store, or
    a bug, that breaks the contract); its lookups still find what it holds."""
    from ucm_patch.hooks.stores.local import LocalStore

    def exploding(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("store exploded")

    LocalStore.get_many = exploding  # type: ignore[method-assign]
    LocalStore.get_many_into = exploding  # type: ignore[method-assign]  (loads: a device)
    LocalStore.get_many_scattered = exploding  # type: ignore[method-assign]  (a host cache)


class ErrorLines(logging.Handler):
    """``logger: message`` of every ERROR record (vLLM's and ucm_patch's loggers)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


#: ERROR lines of this process's loggers, once :func:`watch_errors` ran (in a worker too).
ERRORS = ErrorLines()


def watch_errors(worker: Any = None, how: str = "") -> int:
    """Collect this process's ERROR lines (vLLM's and ucm_patch's loggers) and, for
    ``how == "raising"``, make its store reads raise: run here and in each worker by
    ``collective_rpc`` (pickled by reference: a worker process has its own store and
    loggers). Its pid."""
    import os

    # the connector logs under vLLM's logger ("vllm.ucm_patch..."), the rest under ucm_patch
    for name in ("vllm", "ucm_patch"):
        if ERRORS not in logging.getLogger(name).handlers:
            logging.getLogger(name).addHandler(ERRORS)
    if how == "raising":
        raise_on_read()
    return os.getpid()


def worker_counters(worker: Any = None) -> tuple[int, dict[str, Any], list[str]]:
    """(this process's pid, its connector counters, its ERROR lines): run in each worker
    by ``collective_rpc``."""
    import os

    from ucm_patch import connector

    return os.getpid(), connector.stats(), list(ERRORS.lines)
