"""The dump engine: per-layer KV dumps run off the forward pass (installed as
``ucm_patch.hooks.dump``).

:mod:`.types` holds the values passed around, :mod:`.client` one connector's request-id
space, :mod:`.scheduler` the task slots and completion (its worker threads in
:mod:`.workers`, its flush and shutdown in :mod:`.lifecycle`), :mod:`.process_scheduler`
the process's one scheduler, :mod:`.keys` the connector keys it takes. docs/DUMPS.md
tells how a connector drives them.
"""

from ucm_patch.hooks.dump.client import DumpClient
from ucm_patch.hooks.dump.process_scheduler import (
    get_scheduler,
    reset_scheduler,
    shutdown_at_exit,
)
from ucm_patch.hooks.dump.scheduler import DumpScheduler
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
