"""The values that pass between a connector, its :class:`DumpClient` and the scheduler.

Kept apart from both so that each can name them without importing the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ucm_patch.hooks.events import EventSource
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.hooks.dump.client import DumpClient
    from ucm_patch.hooks.stores.base import KVStore

# DumpTask.source for a task with no event to wait on.
NO_EVENT = int(EventSource.NONE)

# DumpTask.status: written by the worker that ran the task, read when the task is retired.
OK, FAILED, STORE_FULL, UNEXPECTED, CANCELLED = range(5)

#: Payload type: host values aligned with keys, or a callable run after the event.
Payload = Sequence[Any] | Callable[["DumpTask"], Any]


class FinishedDumps(NamedTuple):
    """What ``get_finished`` reports for one step."""

    sending: set[str]
    """Requests whose dumps are all done: return as vLLM's ``finished_sending``."""
    failed: set[str]
    """Subset of ``sending`` with at least one failed or skipped dump (not fully stored)."""


class Batch:
    """The dumps of one step for a set of requests (one per connector per step)."""

    __slots__ = (
        "client",
        "context",
        "done",
        "failed",
        "req_ids",
        "retired",
        "sealed",
        "store",
        "submitted",
        "tally",
    )

    def __init__(
        self, client: DumpClient, req_ids: tuple[str, ...], store: KVStore, context: Any
    ) -> None:
        self.client = client
        self.req_ids = req_ids
        self.store = store
        self.context = context  # opaque to the scheduler: the connector's per-step data
        # Two single-writer counters instead of one shared "pending": the submitting
        # (forward) thread only ever adds to ``submitted``, the retirer (under the
        # scheduler's lock) only to ``retired``, so a submit takes no lock.
        self.submitted = 0
        self.retired = 0
        self.tally = client.tally  # the client's per-source submit counts (same thread)
        self.sealed = False  # no more submits (wait_for_save ran)
        self.failed = False  # some dump failed or was skipped
        self.done = False  # sealed and every dump finished

    @property
    def pending(self) -> int:
        """Dumps submitted and not yet retired."""
        return self.submitted - self.retired


class DumpTask:
    """One dump: a preallocated slot of the scheduler, reused.

    Carries the batch, the storage ``row``, the ``keys``, the payload (``data``) and the
    event to wait on. A payload callable receives the task and may read ``row``, ``keys``
    and ``batch.req_ids`` / ``batch.context``; it must not keep a reference to the task (the
    slot is reused for a later dump once this one is retired).
    """

    __slots__ = (
        "batch",
        "data",
        "duration",
        "error",
        "event",
        "keys",
        "nbytes",
        "owned",
        "row",
        "source",
        "status",
    )

    def __init__(self) -> None:
        self.batch: Batch | None = None
        self.row = -1
        self.keys: Sequence[str] | None = None
        self.data: Payload | None = None
        self.event: Any = None
        self.owned = False
        self.source = NO_EVENT
        self.status = OK
        self.nbytes = 0
        self.duration = 0.0  # seconds the worker spent on it (event wait + payload + put)
        self.error = ""
