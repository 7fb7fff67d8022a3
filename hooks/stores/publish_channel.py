"""Index publishes and leases run by a memory tier's cleaner process for threads beside
the forward.

py-lmdb gives the GIL up in every call, ``Cursor.putmulti`` once per key. Beside vLLM's
forward, a thread that keeps the GIL, each take back waits up to the switch interval:
a dump thread's publish of a row paid one such wait for several of its keys, and
one that lost the GIL inside its transaction held LMDB's writer lock meanwhile (the
figures: docs/CONNECTOR.md, "Dumps beside the forward"). Sent here, the publish is the same
:meth:`~.segment_index.SegmentIndex.publish`, run by the cleaner process, which runs no
forward; the thread gives the GIL up twice (the request's write, the answer's wait).
So is a lease's scan of the segment table and its claim
(:meth:`~.tier_leases.TierLeases.claim_for`), which cost as many takes.

Only threads that run beside a forward send (:func:`beside_forward`: the dump scheduler's
workers mark themselves); a put from any other thread publishes itself, as it costs a
round trip to another process. Anything wrong with the channel (no cleaner process, it
died, no answer in :data:`ANSWER_TIMEOUT_S`, an error in the publish) makes the writer
publish itself, which is always correct: a publish is idempotent (the first value of a
digest wins; the segment's end only grows) and checks that the segment is still the
writer's, so one that ran late in the cleaner changes nothing.

A request: :data:`REQUEST` then ``n`` records of a digest and its packed location; the
answer: :data:`ANSWER` (the request's number, :data:`PUBLISHED`, :data:`LOST` or
:data:`ERROR`, and a lease's segment). A lease given to a writer whose answer came late
is its own all the same (owner: its pid): the client keeps it, and its next lease is
that one, with no request.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import threading
from collections.abc import Sequence
from typing import Protocol

from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.segment_index import DIGEST, LOC, SegmentIndex

log = logging.getLogger(__name__)

#: request number, kind, segment, generation, owner pid, start, end (a lease: the bytes
#: needed), release, records
REQUEST = struct.Struct("<IBIQIQQBI")
PUBLISH, LEASE = 1, 2
#: request number, status, and a lease's segment, generation, end and ready
ANSWER = struct.Struct("<IBIQQB")
PUBLISHED, LOST, ERROR = 1, 0, 2  # a lease: PUBLISHED with one, LOST with none ready
RECORD = DIGEST + LOC.size
#: How long a writer waits for an answer before publishing itself (a cleaner stopped or
#: starved of CPU: the publish is still correct either way).
ANSWER_TIMEOUT_S = 2.0

_local = threading.local()


def beside_forward() -> None:
    """Mark this thread as one that runs beside a forward: its memory tier publishes go
    through the cleaner process (the dump scheduler's workers call this once)."""
    _local.beside = True


def is_beside_forward() -> bool:
    return getattr(_local, "beside", False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, n: int) -> bytes:
    """``n`` bytes, or fewer at the end of the stream."""
    parts, got = [], 0
    while got < n:
        part = os.read(fd, n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class PublishClient:
    """The writer's end: one request at a time per process (the index's writer lock
    serializes publishes anyway), answered by number. The channel is used only while no
    answer is owed: not before the process's first (number 0: it serves; a process
    starting imports and opens its tiers meanwhile, and the first dumps of a new process
    wait for nobody), nor after a request given up on (:data:`ANSWER_TIMEOUT_S`) until
    its answer came. Meanwhile the writer publishes itself."""

    def __init__(self, request_fd: int, answer_fd: int) -> None:
        self._request_fd = request_fd
        self._answer_fd = answer_fd
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._number = 0
        self._owed: int | None = 0  # the answer awaited before the next request
        self._orphans: list[tuple[int, int, int, bool]] = []  # leases answered late
        self.broken = False
        self.sent = 0  # requests answered PUBLISHED or LOST (tests, tools)

    def publish(
        self,
        seg: int,
        gen: int,
        owner: int,
        locs: Sequence[tuple[bytes, bytes]],
        start: int,
        end: int,
        release: bool = False,
    ) -> bool | None:
        """What :meth:`SegmentIndex.publish` answers, run by the cleaner process; None
        when it could not be (the caller publishes itself)."""
        head = (PUBLISH, seg, gen, owner, start, end, release, len(locs))
        answer = self._call(head, b"".join([d + loc for d, loc in locs]))
        return None if answer is None else answer[0] == PUBLISHED

    def lease(self, need: int, owner: int) -> tuple[int, int, int, bool] | bool | None:
        """What :meth:`~.tier_leases.TierLeases.claim_for` answers, run by the cleaner
        process: (segment, generation, end, ready) claimed for ``owner``; False when none
        is ready; None when it could not be (the caller looks itself)."""
        with self._lock:
            self._catch_up()
            if self._orphans:
                return self._orphans.pop()
        answer = self._call((LEASE, 0, 0, owner, 0, need, False, 0), b"")
        if answer is None:
            return None
        status, seg, gen, end, ready = answer
        return (seg, gen, end, bool(ready)) if status == PUBLISHED else False

    def _call(self, head: tuple[int, ...], body: bytes) -> tuple[int, int, int, int, int] | None:
        """Send one request, wait for its answer: (status, segment, generation, end,
        ready); None when there is none to use (not serving, owed, late, ended, ERROR)."""
        with self._lock:
            self._catch_up()
            if self.broken or self._owed is not None:
                return None
            self._number = number = self._number % 0xFFFFFFFF + 1
            try:
                _write_all(self._request_fd, REQUEST.pack(number, *head) + body)
            except OSError:
                self.broken = True  # the process ended
                return None
            self._owed = number
            answer = self._answered(ANSWER_TIMEOUT_S)
            if answer is None or answer[0] == ERROR:
                return None
            self.sent += 1
            return answer

    def _catch_up(self) -> None:
        """Read the answer owed to a request given up on, if it came meanwhile (without
        waiting); a lease in it is kept for the next one (called with the lock held)."""
        if self._owed is not None and not self.broken:
            late = self._answered(0.0)
            if late is not None and late[0] == PUBLISHED and late[2]:
                self._orphans.append((late[1], late[2], late[3], bool(late[4])))

    def _answered(self, timeout: float) -> tuple[int, int, int, int, int] | None:
        """Read answers until the owed one (within ``timeout``): its fields past the
        number, then nothing is owed; None when it has not come (or the process ended:
        broken)."""
        try:
            while select.select([self._answer_fd], [], [], timeout)[0]:
                answer = _read_exactly(self._answer_fd, ANSWER.size)
                if len(answer) < ANSWER.size:
                    break  # the process ended
                number, status, seg, gen, end, ready = ANSWER.unpack(answer)
                if number == self._owed:
                    self._owed = None
                    return status, seg, gen, end, ready
                if status == PUBLISHED and gen:  # a lease answered late: ours all the same
                    self._orphans.append((seg, gen, end, bool(ready)))
            else:
                return None
        except OSError:
            pass
        self.broken = True
        return None

    def close(self) -> None:
        """Close both ends: under the lock (a request in flight finishes or gives up first,
        so that no read meets a descriptor number reused), except in a forked child,
        whose copy of the lock may have been taken by a thread that does not exist there."""
        if os.getpid() != self._pid:
            self._close_fds()
            return
        with self._lock:
            self._close_fds()

    def _close_fds(self) -> None:
        self.broken = True
        for fd in (self._request_fd, self._answer_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._request_fd = self._answer_fd = -1


class Served(Protocol):
    """What the cleaner process serves from: its memory tier."""

    index: SegmentIndex

    def claim_for(self, need: int, owner: int) -> tuple[int, int, int, bool] | None: ...


def serve(tier: Served, request_fd: int, answer_fd: int, busy: threading.Lock) -> None:
    """The cleaner process's end: run each request on ``tier`` (a publish into its index,
    a lease claimed for the writer) and answer it, until the writer's end closes. One
    that fails is answered :data:`ERROR` (the writer does it itself and meets the error
    there), logged once here. Each runs holding ``busy``: the process takes it before it
    closes the tier, and keeps it."""
    warned = False
    try:
        _write_all(answer_fd, ANSWER.pack(0, PUBLISHED, 0, 0, 0, 0))  # serving: number 0
    except OSError:
        return
    while True:
        try:
            head = _read_exactly(request_fd, REQUEST.size)
            if len(head) < REQUEST.size:
                return  # the writer is gone
            number, kind, seg, gen, owner, start, end, release, n = REQUEST.unpack(head)
            body = _read_exactly(request_fd, n * RECORD)
        except OSError:
            return
        if len(body) < n * RECORD:
            return
        got: tuple[int, int, int, bool] | None = None
        try:
            with busy:
                if kind == LEASE:
                    got = tier.claim_for(end, owner)
                    status = LOST if got is None else PUBLISHED
                else:
                    cuts = range(0, n * RECORD, RECORD)
                    locs = [(body[i : i + DIGEST], body[i + DIGEST : i + RECORD]) for i in cuts]
                    ok = tier.index.publish(seg, gen, owner, locs, start, end, bool(release))
                    status = PUBLISHED if ok else LOST
        except StoreError as exc:
            if not warned:
                log.warning("request for process %d failed here: %s", owner, exc)
                warned = True
            status = ERROR
        try:
            _write_all(answer_fd, ANSWER.pack(number, status, *(got or (0, 0, 0, False))))
        except OSError:
            return  # the writer is gone


__all__ = [
    "ANSWER",
    "ANSWER_TIMEOUT_S",
    "ERROR",
    "LOST",
    "PUBLISHED",
    "REQUEST",
    "PublishClient",
    "beside_forward",
    "is_beside_forward",
    "serve",
]
