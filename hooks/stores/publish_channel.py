"""Index publishes and leases run by a memory tier's cleaner process for threads beside
the forward.

py-lmdb gives the GIL up in every call, ``Cursor.putmulti`` once per key. Beside vLLM's
forward, a thread that keeps the GIL, each take back waits up to the switch interval:
a dump thread's publish of a row paid one such wait for several of its keys, and
one that lost the GIL inside its transaction held LMDB's writer lock meanwhile (the
figures: docs/CONNECTOR.md, "Dumps beside the forward"). Sent here, the publish is the same
:meth:`~.segment_index.SegmentIndex.publish`, run by the cleaner process, which runs no
forward. So is a lease's scan of the segment table and its claim
(:meth:`~.tier_leases.TierLeases.claim_for`), which cost as many takes.

One request carries a put's whole work on the index: the publishes of every segment it
wrote (each with its release when full) and the leases it wants (the segments it needs
next), answered together. The request is written and the answer read with the GIL kept
(:mod:`.nowait_io`, non-blocking pipes): the wait for the answer is the one time a
request gives the GIL up.

Only threads that run beside a forward send (:func:`beside_forward`: the dump scheduler's
workers mark themselves); a put from any other thread publishes itself, as it costs a
round trip to another process. Anything wrong with the channel (no cleaner process, it
died, no answer in :data:`ANSWER_TIMEOUT_S`, an error in the publish) makes the writer
publish itself, which is always correct: a publish is idempotent (the first value of a
digest wins; the segment's end only grows) and checks that the segment is still the
writer's, so one that ran late in the cleaner changes nothing.

A request: :data:`REQUEST`, then per publish :data:`FRAGMENT` and its records (a digest
and its packed location each); the answer: :data:`ANSWER`, a status byte per publish
(:data:`PUBLISHED` or :data:`LOST`), then :data:`LEASE_ROW` per lease claimed. A lease
given to a writer whose answer came late is its own all the same (owner: its pid): the
client keeps it, and its next lease is that one, with no request.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.nowait_io import read_nowait, write_nowait
from ucm_patch.hooks.stores.segment_index import DIGEST, LOC, SegmentIndex

log = logging.getLogger(__name__)

#: request number, owner pid, the bytes a lease needs room for, leases wanted, publishes
REQUEST = struct.Struct("<IIQHH")
#: one publish: segment, generation, start, end, release, records
FRAGMENT = struct.Struct("<IQQQBI")
#: answer number, status (:data:`DONE`, :data:`DRY`: fewer leases than asked, none was
#: ready, :data:`ERROR`: nothing of it is known done), publishes, leases
ANSWER = struct.Struct("<IBHH")
DONE, DRY, ERROR = 1, 3, 2
#: a publish's status in an answer
PUBLISHED, LOST = 1, 0
#: one lease claimed: segment, generation, end, ready
LEASE_ROW = struct.Struct("<IQQB")
RECORD = DIGEST + LOC.size
#: Most publishes, and most leases, in one request (the answer fits a fixed buffer).
MOST = 255
#: How long a writer waits for an answer before publishing itself (a cleaner stopped or
#: starved of CPU: the publish is still correct either way).
ANSWER_TIMEOUT_S = 2.0

#: One publish of a request: (segment, generation, start, end, release, its records
#: (digest, packed location)).
Fragment = tuple[int, int, int, int, bool, Sequence[tuple[bytes, bytes]]]
#: One lease claimed: (segment, generation, end, ready).
Claimed = tuple[int, int, int, bool]


class Answer(NamedTuple):
    """What a request got: per publish whether it was (False: the segment was not the
    writer's any more), the leases claimed, and whether fewer were because none was ready."""

    published: list[bool]
    leases: list[Claimed]
    dry: bool


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


#: What :meth:`PublishClient.request_after` runs to send a request: (request, request fd,
#: answer fd, timeout seconds) -> None (nothing done) or (written whole, answer readable).
SendWork = Callable[[bytes, int, int, float], "tuple[bool, bool] | None"]


def _body(owner: int, publishes: Sequence[Fragment], need: int, leases: int) -> bytes:
    """A request (its number 0: numbered when sent)."""
    body = [REQUEST.pack(0, owner, need, leases, len(publishes))]
    for seg, gen, start, end, release, locs in publishes:
        body.append(FRAGMENT.pack(seg, gen, start, end, release, len(locs)))
        body += [d + loc for d, loc in locs]
    return b"".join(body)


class PublishClient:
    """The writer's end of one channel (:class:`PublishChannels`: one per thread that
    uses them): one request at a time, answered by number. The channel is used only while no
    answer is owed: not before the process's first (number 0: it serves; a process
    starting imports and opens its tiers meanwhile, and the first dumps of a new process
    wait for nobody), nor after a request given up on (:data:`ANSWER_TIMEOUT_S`) until
    its answer came. Meanwhile the writer publishes itself."""

    def __init__(self, request_fd: int, answer_fd: int) -> None:
        self._request_fd = request_fd
        self._answer_fd = answer_fd
        # Both ends of ours never block: a request is written, and an answer read, with
        # the GIL kept (.nowait_io); only a wait for an answer not there yet gives it up.
        os.set_blocking(request_fd, False)
        os.set_blocking(answer_fd, False)
        self._answer = ctypes.create_string_buffer(ANSWER.size + MOST + MOST * LEASE_ROW.size)
        self._have = 0  # bytes of the next answer read so far
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._number = 0
        self._owed: int | None = 0  # the answer awaited before the next request
        self._orphans: list[Claimed] = []  # leases answered late
        self.broken = False
        self.sent = 0  # requests answered (tests, tools)

    def request(
        self, owner: int, publishes: Sequence[Fragment] = (), need: int = 0, leases: int = 0
    ) -> Answer | None:
        """Run ``publishes`` (each :meth:`SegmentIndex.publish`), then claim up to
        ``leases`` segments with room for ``need`` bytes
        (:meth:`~.tier_leases.TierLeases.claim_for`) for ``owner``, in the cleaner
        process: its :class:`Answer`; None when it could not be (the caller does it
        itself). Leases answered late to an earlier request come first, with no claim."""
        if len(publishes) > MOST or leases > MOST:
            raise ValueError(f"publish channel: {len(publishes)} publishes and {leases} "
                             f"leases in one request; at most {MOST} of each")  # fmt: skip
        with self._lock:
            self._catch_up()
            orphans = self._take_orphans(leases)
            leases -= len(orphans)
            if not publishes and not leases:
                return Answer([], orphans, False)
            answer = self._call(_body(owner, publishes, need, leases))
            return self._with_orphans(answer, orphans)

    def request_after(
        self, work: SendWork, owner: int, publishes: Sequence[Fragment], need: int = 0,
        leases: int = 0,
    ) -> tuple[bool, Answer | None]:  # fmt: skip
        """:meth:`request`, sent by ``work(request, request_fd, answer_fd, timeout_s)``: one
        native call that first does what must be done before the request (a put's copy:
        :func:`.rowcopy.frame_send`), then writes it and waits until its answer can be
        read, so that the caller takes the GIL back once for both. (Whether ``work`` ran,
        the answer or None as :meth:`request` answers.) ``work`` is not run when the
        channel cannot take a request now; when it answers None it did nothing. Either
        way the caller then does its work and publishes itself."""
        with self._lock:
            self._catch_up()
            if self.broken or self._owed is not None:
                return False, None
            orphans = self._take_orphans(leases)
            body = _body(owner, publishes, need, leases - len(orphans))
            self._number = number = self._number % 0xFFFFFFFF + 1
            try:
                sent = work(struct.pack("<I", number) + body[4:], self._request_fd,
                            self._answer_fd, ANSWER_TIMEOUT_S)  # fmt: skip
            except BaseException:
                self._orphans += orphans
                raise
            if sent is None:
                self._orphans += orphans
                return False, None
            whole, readable = sent
            if not whole:
                self.broken = True  # a request cut short: the stream is unreadable
                self._orphans += orphans
                return True, None
            self._owed = number
            return True, self._with_orphans(self._take_answer(readable), orphans)

    def send_ahead(self, owner: int, need: int, leases: int) -> bool:
        """Ask for up to ``leases`` segments with room for ``need`` bytes for ``owner``,
        and do not wait for them: the answer is read later by :meth:`take_ahead`, by any
        thread, with the GIL kept. False, with nothing sent, when another thread uses the
        channel now, an answer is owed on it, or it cannot take requests. A write to a
        non-blocking pipe with the GIL kept: a caller on the forward's thread waits for
        nothing."""
        if leases <= 0 or not self._lock.acquire(blocking=False):
            return False
        try:
            self._catch_up()
            return self._send_numbered(_body(owner, (), need, min(leases, MOST)))
        finally:
            self._lock.release()

    @property
    def owes(self) -> bool:
        """Whether an answer is owed on this channel, or leases answered late are held."""
        return self._owed is not None or bool(self._orphans)

    def take_ahead(self) -> list[Claimed]:
        """The leases answered so far to :meth:`send_ahead` (and to requests given up
        on), never waited for: what is there is read with the GIL kept. [] when none
        came yet, or when another thread uses the channel now."""
        if not self.owes or not self._lock.acquire(blocking=False):
            return []
        try:
            self._catch_up()
            got, self._orphans = self._orphans, []
            return got
        finally:
            self._lock.release()

    def _take_orphans(self, leases: int) -> list[Claimed]:
        """Up to ``leases`` of the leases answered late, for this request (lock held)."""
        orphans: list[Claimed] = []
        while self._orphans and len(orphans) < leases:
            orphans.append(self._orphans.pop())
        return orphans

    def _with_orphans(self, answer: Answer | None, orphans: list[Claimed]) -> Answer | None:
        """``answer`` with ``orphans`` first among its leases; None: they are kept."""
        if answer is None:
            self._orphans += orphans
            return None
        answer.leases[:0] = orphans
        return answer

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
        answer = self.request(owner, [(seg, gen, start, end, release, locs)])
        return None if answer is None else answer.published[0]

    def lease(self, need: int, owner: int) -> Claimed | bool | None:
        """What :meth:`~.tier_leases.TierLeases.claim_for` answers, run by the cleaner
        process: (segment, generation, end, ready) claimed for ``owner``; False when none
        is ready; None when it could not be (the caller looks itself)."""
        answer = self.request(owner, need=need, leases=1)
        if answer is None:
            return None
        return answer.leases[0] if answer.leases else False

    def _call(self, request: bytes) -> Answer | None:
        """Send ``request`` (its number 0: numbered here), wait for its answer; None when
        there is none to use (not serving, owed, late, ended, ERROR). With the lock held."""
        if not self._send_numbered(request):
            return None
        return self._take_answer(True)

    def _send_numbered(self, request: bytes) -> bool:
        """Number ``request`` and send it, its answer then owed; False when the channel
        cannot take it (not serving, an answer owed, ended). With the lock held."""
        if self.broken or self._owed is not None:
            return False
        self._number = number = self._number % 0xFFFFFFFF + 1
        try:
            self._send(struct.pack("<I", number) + request[4:])
        except OSError:
            self.broken = True  # the process ended, or stopped reading
            return False
        self._owed = number
        return True

    def _take_answer(self, wait: bool) -> Answer | None:
        """The owed answer, waited for up to :data:`ANSWER_TIMEOUT_S` when ``wait`` (else
        only what is there now); None when there is none to use (lock held)."""
        answer = self._answered(ANSWER_TIMEOUT_S if wait else 0.0)
        if answer is None or answer[0] == ERROR:
            return None
        self.sent += 1
        return Answer(answer[1], answer[2], answer[0] == DRY)

    def _catch_up(self) -> None:
        """Read the answer owed to a request given up on, if it came meanwhile (without
        waiting); the leases in it are kept for the next ones (with the lock held)."""
        if self._owed is not None and not self.broken:
            late = self._answered(0.0)
            if late is not None:
                self._orphans += late[2]

    def _send(self, data: bytes) -> None:
        """Write a request: at once with the GIL kept, the usual case (a pipe holds 64 KiB,
        and the cleaner process reads each request as it comes); what the pipe did not
        take, waiting for it to, within :data:`ANSWER_TIMEOUT_S` (OSError past that: a
        request cut short would make the stream unreadable, so the channel is given up)."""
        fd = self._request_fd
        sent = write_nowait(fd, data)
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise OSError(errno.ETIMEDOUT, "the cleaner process reads no requests")
            view = view[write_nowait(fd, bytes(view)) :]

    def _answered(self, timeout: float) -> tuple[int, list[bool], list[Claimed]] | None:
        """Read answers until the owed one (within ``timeout``): its status, publishes and
        leases, then nothing is owed; None when it has not come (or the process ended:
        broken). Leases in answers to requests given up on earlier are kept (orphans)."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                answer = self._next_answer(deadline)
                if answer is None:
                    return None
                number, status, published, leases = answer
                if number == self._owed:
                    self._owed = None
                    return status, published, leases
                self._orphans += leases  # a lease answered late: ours all the same
        except (OSError, EOFError):
            pass
        self.broken = True
        return None

    def _next_answer(self, deadline: float) -> tuple[int, int, list[bool], list[Claimed]] | None:
        """The next whole answer: read as far as it is there with the GIL kept, waiting
        (``select``, the one GIL give-up of a request) only while some of it is not, until
        ``deadline``: None then (what was read stays for the next call). EOFError: the
        process ended."""
        fd, buf = self._answer_fd, self._answer
        want = ANSWER.size
        while True:
            if self._have >= ANSWER.size:
                _n, _s, publishes, leases = ANSWER.unpack_from(buf)
                want = ANSWER.size + publishes + leases * LEASE_ROW.size
                if self._have >= want:
                    break
            got = read_nowait(fd, buf, self._have, want - self._have)
            if got > 0:
                self._have += got
                continue
            if got < 0:
                raise EOFError
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        self._have = 0
        number, status, publishes, leases = ANSWER.unpack_from(buf)
        raw = buf.raw
        at = ANSWER.size + publishes
        published = [b == PUBLISHED for b in raw[ANSWER.size : at]]
        claimed: list[Claimed] = []
        for _ in range(leases):
            seg, gen, end, ready = LEASE_ROW.unpack_from(raw, at)
            claimed.append((seg, gen, end, bool(ready)))
            at += LEASE_ROW.size
        return number, status, published, claimed

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


#: Channels a writer process opens to its cleaner process, each served by a thread of its
#: own there: a dump thread takes one for itself (the connector's dump threads, by
#: default fewer than this), so that it never waits behind another thread's request, a
#: wait that beside the forward also cost it a GIL take; threads past this many share.
CHANNELS = 4


class PublishChannels:
    """A writer process's channels to its cleaner process: one :class:`PublishClient` per
    thread that uses them (:meth:`for_thread`), first come first served, then shared."""

    def __init__(self, fds: Sequence[tuple[int, int]]) -> None:
        self.clients = [PublishClient(request_fd, answer_fd) for request_fd, answer_fd in fds]
        self._mine = threading.local()
        self._lock = threading.Lock()
        self._given = 0

    def for_thread(self) -> PublishClient:
        """This thread's channel (the same for its life)."""
        client = getattr(self._mine, "client", None)
        if client is None:
            with self._lock:
                client = self.clients[self._given % len(self.clients)]
                self._given += 1
            self._mine.client = client
        return client

    def wait_serving(self, timeout: float) -> bool:
        """Wait until the cleaner process serves every channel (its first answer is
        there to read, or was read): False on timeout. Nothing waits for this on the
        dump path, which publishes itself meanwhile; a benchmark whose process starts
        its first dump right after the store opened calls it, as in vLLM, where loading
        the model separates the connector's start from the first dump."""
        deadline = time.monotonic() + timeout
        for client in self.clients:
            if client._owed != 0 or client.broken:
                continue  # answered already (or given up on: nothing to wait for)
            left = max(0.0, deadline - time.monotonic())
            if not select.select([client._answer_fd], [], [], left)[0]:
                return False
        return True

    @property
    def sent(self) -> int:
        """Requests answered, on every channel (tests, tools)."""
        return sum(client.sent for client in self.clients)

    def close(self) -> None:
        for client in self.clients:
            client.close()


class Served(Protocol):
    """What the cleaner process serves from: its memory tier."""

    index: SegmentIndex

    def claim_for(self, need: int, owner: int) -> tuple[int, int, int, bool] | None: ...


def serve(tier: Served, request_fd: int, answer_fd: int, busy: threading.Lock) -> None:
    """The cleaner process's end: run each request on ``tier`` (its publishes into the
    index, then its leases claimed for the writer) and answer it, until the writer's end
    closes. A publish that fails makes the answer :data:`ERROR`, with nothing after it
    run (the writer does it itself and meets the error there); a lease claim that fails
    ends the leases answered. Each failure is logged once here. Each request runs holding
    ``busy``: the process takes it before it closes the tier, and keeps it."""
    warned = False
    try:
        _write_all(answer_fd, ANSWER.pack(0, DONE, 0, 0))  # serving: number 0
    except OSError:
        return
    while True:
        try:
            head = _read_exactly(request_fd, REQUEST.size)
            if len(head) < REQUEST.size:
                return  # the writer is gone
            number, owner, need, wanted, publishes = REQUEST.unpack(head)
            fragments = []
            for _ in range(publishes):
                frag = _read_exactly(request_fd, FRAGMENT.size)
                if len(frag) < FRAGMENT.size:
                    return
                seg, gen, start, end, release, n = FRAGMENT.unpack(frag)
                body = _read_exactly(request_fd, n * RECORD)
                if len(body) < n * RECORD:
                    return
                cuts = range(0, n * RECORD, RECORD)
                locs = [(body[i : i + DIGEST], body[i + DIGEST : i + RECORD]) for i in cuts]
                fragments.append((seg, gen, start, end, bool(release), locs))
        except OSError:
            return
        status, published, claimed = DONE, bytearray(), []
        with busy:
            try:
                for seg, gen, start, end, release, locs in fragments:
                    ok = tier.index.publish(seg, gen, owner, locs, start, end, release)
                    published.append(PUBLISHED if ok else LOST)
            except StoreError as exc:
                status, published = ERROR, bytearray()
                warned = warned or _warn(owner, exc)
            try:
                while status == DONE and len(claimed) < wanted:
                    got = tier.claim_for(need, owner)
                    if got is None:
                        status = DRY
                        break
                    claimed.append(got)
            except StoreError as exc:
                warned = warned or _warn(owner, exc)
        answer = [ANSWER.pack(number, status, len(published), len(claimed)), bytes(published)]
        answer += [LEASE_ROW.pack(*c) for c in claimed]
        try:
            _write_all(answer_fd, b"".join(answer))
        except OSError:
            return  # the writer is gone


def _warn(owner: int, exc: StoreError) -> bool:
    log.warning("request for process %d failed here: %s", owner, exc)
    return True


__all__ = [
    "ANSWER",
    "ANSWER_TIMEOUT_S",
    "CHANNELS",
    "DONE",
    "DRY",
    "ERROR",
    "FRAGMENT",
    "LEASE_ROW",
    "LOST",
    "MOST",
    "PUBLISHED",
    "REQUEST",
    "Answer",
    "Claimed",
    "Fragment",
    "PublishChannels",
    "PublishClient",
    "beside_forward",
    "is_beside_forward",
    "serve",
]
