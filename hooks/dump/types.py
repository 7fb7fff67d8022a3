"""The values that pass between a connector, its :class:`DumpClient` and the scheduler.

Kept apart from both so that each can name them without importing the other: this module
imports neither (``types`` <- ``client`` <- ``scheduler``, no circle; a test checks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from ucm_patch.hooks.events import EventSource
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.hooks.stores.base import KVStore

# DumpTask.source for a task with no event to wait on.
NO_EVENT = int(EventSource.NONE)

# DumpTask.status: written by the worker that ran the task, read when the task is retired.
OK, FAILED, STORE_FULL, UNEXPECTED, CANCELLED = range(5)

#: Payload type: host values aligned with keys, or a callable run after the event.
Payload = Sequence[Any] | Callable[["DumpTask"], Any]


class SubmitTally(list[list[int]]):
    """Dumps submitted by one client: ``tally[owned][source]``, one counter per event
    source (:class:`~ucm_patch.hooks.events.EventSource`) and ownership of the event.

    Written without a lock by the one thread that drives the client's connector (the
    submit path adds 1 at ``tally[owned][source]``: two C-level subscripts, no index
    arithmetic); the scheduler folds what was added since the last fold into its metrics
    under its lock (:meth:`added`).
    """

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__([[0] * len(EventSource), [0] * len(EventSource)])

    def added(self, since: SubmitTally) -> Iterator[tuple[int, bool, int]]:
        """(source, owned, n) of each counter that grew past ``since`` (a tally this one
        was folded into before), bringing ``since`` up to date."""
        for owned, (counts, folded) in enumerate(zip(self, since, strict=True)):
            for source, now in enumerate(counts):  # read once: the submitter may add
                n = now - folded[source]
                if n:
                    folded[source] = now
                    yield source, bool(owned), n


class BatchClient(Protocol):
    """What a :class:`Batch` and the scheduler need of the client that opened it."""

    tally: SubmitTally

    def batch_done(self, batch: Batch) -> None:
        """``batch`` completed (called under the scheduler's lock; must take no other)."""


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
        self, client: BatchClient, req_ids: tuple[str, ...], store: KVStore, context: Any
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
        "event_wait",
        "keys",
        "nbytes",
        "owned",
        "produce",
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
        self.event_wait = 0.0  # of which waiting for the KV-ready event (the GPU's time)
        self.produce = 0.0  # of which running a payload callable (a device-to-host copy)
        self.error = ""
