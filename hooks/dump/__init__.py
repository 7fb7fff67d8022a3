"""The dump engine: per-layer KV dumps run off the forward pass (installed as
``ucm_patch.hooks.dump``).

:mod:`.types` holds the values passed around, :mod:`.client` one connector's request-id
space, :mod:`.scheduler` the process's worker threads and task slots. docs/DUMPS.md tells
how a connector drives them.
"""

from ucm_patch.hooks.dump.client import DumpClient
from ucm_patch.hooks.dump.scheduler import (
    DumpScheduler,
    get_scheduler,
    reset_scheduler,
    shutdown_at_exit,
)
from ucm_patch.hooks.dump.types import Batch, DumpTask, FinishedDumps, Payload

__all__ = [
    "Batch",
    "DumpClient",
    "DumpScheduler",
    "DumpTask",
    "FinishedDumps",
    "Payload",
    "get_scheduler",
    "reset_scheduler",
    "shutdown_at_exit",
]
