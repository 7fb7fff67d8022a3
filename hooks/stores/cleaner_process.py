"""The cleaner process of a memory tier (:mod:`.segment_cleaner` starts one per writer).

It opens the two tiers again from their specs (:meth:`Tier.spec`), never the store: it
does not count as a user of the memory tier (whose last user's close spills and removes
it), and it allocates nothing (no warmer). It refills the memory tier's reserve, and the
disk tier's that puts written around a dry memory tier take from, in one recency order
over both (:func:`~.segment_cleaner.refill_two`), whenever one is short: it looks when
its writer wakes it (:class:`Waker`), when its spill ends, and every :data:`IDLE_POLL_S`
anyway. It also publishes the index entries, and takes the leases, of its writer's
threads that run beside a forward (:mod:`.publish_channel`), on a thread of its own. It
exits on SIGTERM (``close``: after the segment it is spilling), once its parent is gone
(killed included) or a tier's directory is, and ignores a terminal's SIGINT, which is
its parent's to handle.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import load_store_key
from ucm_patch.hooks.stores.publish_channel import serve
from ucm_patch.hooks.stores.segment_cleaner import around_reserve, refill_two
from ucm_patch.hooks.stores.tier import Tier

log = logging.getLogger(__name__)

#: How soon the cleaner looks again when its last round left work it could do now, and
#: otherwise at the latest: it waits for a wake (its writer took a ready segment or found
#: none, :meth:`~.segment_cleaner.SegmentCleaner.wake`; its spill ended; SIGTERM), and
#: looks every :data:`IDLE_POLL_S` anyway, for the segments other writers took (their
#: cleaners are woken too). Looking every :data:`BUSY_POLL_S` whenever puts arrived, as
#: it did before, several writers' cleaners took much of the CPU the puts and the spills
#: needed (docs/CONNECTOR.md, "Writing around a dry memory tier", has the figures).
BUSY_POLL_S, IDLE_POLL_S = 0.002, 0.02

#: The cleaner process's switch interval (a tenth of Python's default): how long its refill
#: or spill thread may hold this process's GIL while a publish thread has a writer's
#: request to answer. The writer's dump thread waits for that answer at the end of its
#: put (beside the forward, inside the native call that copied the put), so its put
#: ends when the answer comes (docs/CONNECTOR.md, "The copier", has the figures).
ANSWER_SWITCH_S = 0.0005

#: Niceness of the thread that writes spills to the disk tier. A put must not wait behind
#: a spill: where a writer and that thread share a core, the scheduler runs the writer
#: (measured: bench_stores, "two tiers", slowest call; docs/CONNECTOR.md, "A full store",
#: has the figures, and those of nice 5 and 10, which did less). Only that thread, never one that
#: holds an index transaction: a reader starved of CPU would hold LMDB's pages from
#: reuse while writers commit (segment_index.SPARE_MAP_BYTES; a whole cleaner process at
#: 19 filled the index's map beside 4 writers on 2 cores), and a thread that waits for a
#: write holds none. The cost, by design: on a host whose every core is busy at normal
#: priority, spills get little CPU, the reserve runs dry and puts skip (counted), rather
#: than slow the host's serving.
SPILL_WRITE_NICE = 19


class SpillWriter:
    """One thread that runs a spill's write (:attr:`Tier.run_spill_write`) at
    :data:`SPILL_WRITE_NICE`, while the cleaner's own thread waits for it: Linux gives each
    thread its own niceness, and lowering it needs no privilege (raising it back would)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, "ucm-spill-write", initializer=_lower_priority)

    def run(self, write: Callable[[], None]) -> None:
        self._pool.submit(write).result()  # its OSError raised here, as if run inline

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class SpillThread:
    """The cleaner's spills, one at a time on a thread of their own (its write on the
    :class:`SpillWriter`'s), so that the cleaner's own thread keeps refilling the disk
    tier's reserve meanwhile: puts written around a dry memory tier take from it, and a
    drop is one index transaction where a spill copies a whole segment at
    :data:`SPILL_WRITE_NICE`. Waiting for each spill, the disk's reserve ran dry behind
    it whenever writers filled every core, and they skipped (measured with 2 and 4
    writers on 2 cores: docs/CONNECTOR.md, "Writing around a dry memory tier")."""

    def __init__(
        self, memory: Tier, warn: RateLimitedLog, done: Callable[[], None] = lambda: None
    ) -> None:
        self._memory, self._warn, self._done = memory, warn, done
        self._pool = ThreadPoolExecutor(1, "ucm-spill")
        self._running: Future[None] | None = None
        self._stamp = 0  # the last use of the segment the running spill empties

    def running(self) -> bool:
        """Whether a spill runs now (the cleaner then waits for ``done``, not a poll)."""
        return self._running is not None and not self._running.done()

    def spilling(self) -> int | None:
        """The last use of the segment being spilled, None when no spill runs
        (:func:`~.segment_cleaner.refill_two` empties nothing newer meanwhile)."""
        return self._stamp if self.running() else None

    def start(self, victim: tuple[int, int, Any]) -> bool:
        """Start spilling ``victim``: False (nothing started) while a spill runs."""
        if self.running():
            return False
        self._stamp = victim[0]
        self._running = self._pool.submit(self._spill, victim)
        self._running.add_done_callback(lambda _f: self._done())  # once running() is False
        return True

    def _spill(self, victim: tuple[int, int, Any]) -> None:
        try:
            self._memory.empty_segment(victim)
        except Exception as exc:  # a store error, or a bug: said, and the next one runs
            self._warn.warning(
                "spill", "%s: spill failed: %s: %s", self._memory.path, type(exc).__name__, exc
            )

    def close(self) -> None:
        """Wait for the spill that runs (its segment is left whole, never half spilled)."""
        self._pool.shutdown(wait=True)


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SPILL_WRITE_NICE)
    except OSError:
        pass  # not permitted here: the spills run at the cleaner's priority


class Waker:
    """What the cleaner's thread waits on: its writer's wake pipe (``wake_fd``, -1:
    none) and a pipe of its own, written when a spill ends and on a signal
    (``signal.set_wakeup_fd``: SIGTERM ends the wait at once)."""

    def __init__(self, wake_fd: int) -> None:
        self._own_r, self._own_w = os.pipe()
        for fd in (self._own_r, self._own_w, *([wake_fd] if wake_fd >= 0 else [])):
            os.set_blocking(fd, False)
        self._fds = [self._own_r, *([wake_fd] if wake_fd >= 0 else [])]
        signal.set_wakeup_fd(self._own_w)

    def poke(self) -> None:
        """Wake the wait (from any thread)."""
        try:
            os.write(self._own_w, b"\0")
        except OSError:
            pass  # full: a wake is pending

    def wait(self, timeout: float) -> None:
        """Until a wake or ``timeout``; every pending wake read (one look serves them all).
        A writer's pipe closed (its process ended) is no longer waited on, and its read
        end is closed then."""
        ready = select.select(self._fds, [], [], timeout)[0]
        for fd in ready:
            try:
                if os.read(fd, 4096) == b"":
                    self._fds.remove(fd)
                    os.close(fd)
            except BlockingIOError:
                pass

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for fd in {*self._fds, self._own_r, self._own_w}:
            os.close(fd)


def _present(*tiers: Tier) -> bool:
    """Whether every tier's directory is still there (one removed behind the store, or
    by a store's last close, ends this process)."""
    return all(os.fstat(t.dir_fd).st_nlink > 0 for t in tiers)


def main(args: dict[str, Any]) -> None:
    """Run until SIGTERM or until the parent ``args["parent"]`` is gone: ``args`` holds
    the ``memory`` and ``disk`` tiers' specs."""
    logging.basicConfig(level=logging.WARNING, format="ucm_patch cleaner %(process)d: %(message)s")
    # a publish thread answers a writer waiting at the end of its put: the refill's
    # Python must not hold it off for the default switch interval (ANSWER_SWITCH_S)
    sys.setswitchinterval(ANSWER_SWITCH_S)
    stopping = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    parent = int(args["parent"])
    if not all(os.path.isdir(args[t]["path"]) for t in ("memory", "disk")):
        return  # removed before this process got to it: nothing to clean, nothing to make
    secret = load_store_key()
    disk = Tier(**args["disk"], secret=secret)
    try:
        memory = Tier(**args["memory"], spill=disk.take_spill, secret=secret, warm=False)
    except BaseException:
        disk.close()
        raise
    warn = RateLimitedLog(log, 30.0)
    writer = SpillWriter()
    disk.run_spill_write = writer.run
    waker = Waker(int(args.get("wake_fd", -1)))
    spills = SpillThread(memory, warn, waker.poke)
    busy = threading.Lock()  # held by a publish for the writer; taken for good at the end
    # the writer's dump threads publish and lease through here (.publish_channel): a
    # thread per channel, a channel per dump thread
    for i, (request_fd, answer_fd) in enumerate(args.get("publish_fds") or ()):
        threading.Thread(
            target=serve, args=(memory, request_fd, answer_fd, busy), name=f"ucm-publish-{i}",
            daemon=True,
        ).start()  # fmt: skip
    try:
        seen_disk, unfinished = b"", True
        reserve = 0 if disk.fsync else around_reserve(disk.count)
        while not stopping.is_set() and os.getppid() == parent and _present(memory, disk):
            disk_stamps = disk.stamps()  # puts written around and hits land on disk
            moved, seen_disk = disk_stamps != seen_disk, disk_stamps
            try:
                unfinished = refill_two(
                    memory,
                    disk,
                    stopping,
                    reserve,
                    moved or unfinished,
                    spills.start,
                    spills.spilling,
                )
            except (StoreError, OSError) as exc:
                unfinished = True
                warn.warning("round", "%s: cleaner round failed: %s", memory.path, exc)
            # work left that a look can do now (not a spill's end to wait for): look soon
            waker.wait(BUSY_POLL_S if unfinished and not spills.running() else IDLE_POLL_S)
    finally:
        spills.close()
        waker.close()
        writer.close()
        busy.acquire()  # no publish runs into the index closed next
        memory.close()
        disk.close()


__all__ = [
    "ANSWER_SWITCH_S",
    "BUSY_POLL_S",
    "IDLE_POLL_S",
    "SPILL_WRITE_NICE",
    "SpillThread",
    "SpillWriter",
    "Waker",
    "main",
]
