"""The cleaner of one tier: keeps the emptying of segments and idle leases off the put path.

Two jobs, both things a put used to do (or leave undone) on its own thread:

* **The reserve** (a tier that spills: the memory tier). Empty segments are kept ready
  ahead of need, like a database's page cleaner: whenever fewer than
  :attr:`Tier.reserve` are ready, the least recently used segment is spilled to the next
  tier in one write (:meth:`Tier.adopt`) and emptied. A put never spills: when the
  reserve runs dry faster than the disk takes the spills, the put's values go around the
  memory tier into segments of the disk tier that the cleaner process also keeps ready
  (:func:`refill_two`: one recency order over both tiers), and past that are answered
  False at once (skipped, counted in ``reserve_dry``), which the dump scheduler records
  as a request not stored. Before, a put needing a segment spilled a whole one first, on
  the dump thread (docs/CONNECTOR.md#a-full-store-spills-off-the-put-path: the
  measurements).
* **Idle leases.** A process keeps the segment it appends to between puts: one index
  transaction per put instead of three, and no segment handed back and forth between
  processes. A lease left unused for :data:`LEASE_IDLE_S` is given back by a thread of
  the process, so that an idle process does not keep a segment from eviction.

**The reserve is refilled by a process of its own** (:mod:`.cleaner_process`), started by
the first put, not by a thread. Measured (docs/CONNECTOR.md): beside a thread that runs
Python without pause, as a dump thread or vLLM's forward does, a cleaner thread spilled
at a fraction of what a process did, because each of its system calls and index
transactions gives up the GIL and waits up to the switch interval to get it back. Where
the process cannot be started, a thread of the writer does its work, with a warning.

Each writing process has its cleaner, and they refill the one reserve at once: measured
with 2 and 4 writers on 2 cores, one cleaner at a time (an ``flock``) got a share of the
CPU that fell with every writer added, and the host's put rate with it; several spill
at the rate of the disk. Emptying is the tier's compare-and-set on the index
(:meth:`SegmentIndex.claim`), so two cleaners never spill one segment twice, and a
cleaner killed mid-spill leaves its segment to the next one: its pid is dead, so the
segment is free to take, and its values stay indexed where they were until then. A
cleaner process that dies is started again by its writer (the reserve would stay dry).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.nowait_io import write_nowait
from ucm_patch.hooks.stores.publish_channel import CHANNELS, PublishChannels, PublishClient

log = logging.getLogger(__name__)

#: A lease kept this long without a put is given back (the segment can then be evicted).
LEASE_IDLE_S = 1.0
#: How often the thread of a process looks at its idle leases.
POLL_S = 0.25
#: Longest a close waits for the cleaner process to finish its segment before killing it.
STOP_S = 10.0
_CHILD = (
    "import json, sys; a = json.loads(sys.argv[1]); sys.path[:0] = a['sys_path']; "
    "from ucm_patch.hooks.stores.cleaner_process import main; main(a)"
)


class Cleaned(Protocol):
    """What the cleaner uses of a tier (:class:`~ucm_patch.hooks.stores.tier.Tier`)."""

    name: str
    path: str
    reserve: int
    count: int

    def spec(self) -> dict[str, Any]: ...
    def release_idle_leases(self, idle_s: float = ...) -> None: ...
    def empty_one_for_reserve(self) -> bool: ...
    def reserve_short(self) -> bool: ...


def reserve_for(count: int) -> int:
    """Empty segments a spilling tier of ``count`` segments keeps ready: an eighth of them,
    at least 2 (a put taking one while the other is refilled), at most half."""
    return max(1, min(count // 2, max(2, count // 8)))


def refill(tier: Cleaned, stopping: threading.Event | None = None) -> None:
    """Empty segments until the reserve is full (or ``stopping`` is set). The cleaners of
    several writers run at once: each empties another segment (the index's
    compare-and-set), so the reserve may end a few segments over, never short."""
    while not (stopping is not None and stopping.is_set()) and tier.empty_one_for_reserve():
        pass


#: Most empty segments the cleaner keeps ready in the disk tier (:func:`around_reserve`).
AROUND_MAX = 16


def around_reserve(count: int) -> int:
    """Empty segments the cleaner keeps ready in a disk tier of ``count`` segments for
    puts written around a dry memory tier (:meth:`LocalStore._put`), which never empty
    one themselves: as many as a memory tier of that size keeps (:func:`reserve_for`),
    at most :data:`AROUND_MAX` (a large disk tier needs no more: each writer takes one
    at a time while the cleaner empties the next). Measured with 1, 2 and 4 writers on
    a full store (docs/CONNECTOR.md): 2 of 64 left the writers skipping a third of their
    values, 8 and 16 under a twentieth."""
    return min(AROUND_MAX, reserve_for(count))


#: Most segments one :func:`refill_two` call empties before it looks at ``stopping``.
_MOST_PER_CALL = 64


class Emptied(Cleaned, Protocol):
    """What :func:`refill_two` uses of the two tiers (:class:`~.tier.Tier`)."""

    def reserve_state(self) -> tuple[int, list[tuple[int, int, Any]]]: ...
    def empty_segment(self, victim: tuple[int, int, Any], drop: bool = False) -> bool: ...


def refill_two(
    memory: Emptied,
    disk: Emptied,
    stopping: threading.Event | None = None,
    disk_reserve: int | None = None,
    disk_moved: bool = True,
    start_spill: Callable[[tuple[int, int, Any]], bool] | None = None,
    spilling: Callable[[], int | None] | None = None,
) -> bool:
    """Keep both reserves full, the memory tier's and ``disk_reserve`` segments of the
    disk tier's (None: :func:`around_reserve`; 0 where no put goes around: a disk tier
    that fsyncs), in **one recency order over the two tiers**: the segment emptied is
    always the store's least recently used one, whichever tier holds it (a hit
    refreshes a disk segment's place too).

    * The memory tier's oldest segment is spilled to the disk tier while that has
      segments beyond its reserve; once the disk is full, it is spilled only when it is
      newer than the disk's oldest (which the spill then evicts), and dropped otherwise:
      a spill there would copy values only to evict newer ones for them.
    * The disk tier's reserve is refilled by dropping its oldest segment, unless the
      memory tier holds an older one: that one goes first.

    Without puts written around the memory tier this is the spill of :func:`refill` (the
    memory tier always holds the newest values). With them, the disk tier holds values
    newer than the memory tier's oldest, which a spill would otherwise evict first.

    ``disk_moved=False`` (the disk tier's recency stamps did not change since the last
    call: no segment of it was taken, put into or hit) skips reading the disk tier's
    segment table unless the memory tier's reserve is short: that read grows with the
    disk tier, the memory tier's does not. True when it stopped with work left (the
    next call must read the disk tier again).

    ``start_spill``: spills run elsewhere (the cleaner process's spill thread), started
    by it: False when one is still running, so that this call returns with work left
    and its caller keeps refilling the disk tier's reserve by drops meanwhile (a spill
    copies a whole segment at a low priority; puts written around a dry memory tier
    take from that reserve). None: spilled here. ``spilling``: the last use of the
    segment whose spill runs there (None: none runs). While it runs, no segment used
    more recently is emptied: that one is the store's oldest, and emptying a newer one
    first would evict newer values while older ones stay (a spill starved of CPU runs
    long). Puts then go around the memory tier, or are skipped, until it ends."""
    if disk_reserve is None:
        disk_reserve = around_reserve(disk.count)
    for _ in range(_MOST_PER_CALL):
        if stopping is not None and stopping.is_set():
            return True
        m_ready, m_victims = memory.reserve_state()
        if not disk_moved and not (m_ready < memory.reserve and m_victims):
            return False
        disk_moved = True  # emptied since: read it again
        d_ready, d_victims = disk.reserve_state()
        memory_short = m_ready < memory.reserve and bool(m_victims)
        # short only with a segment of its own to empty: a memory segment dropped gives it none
        disk_short = d_ready < disk_reserve and bool(d_victims)
        if not (memory_short or disk_short):
            return False
        oldest_m = m_victims[0] if m_victims else None
        oldest_d = d_victims[0] if d_victims else None
        in_flight = spilling() if spilling is not None else None
        if oldest_m is not None and (oldest_d is None or oldest_m[0] <= oldest_d[0]):
            # the store's oldest segment is in memory: spilled while the disk has room
            # beyond its reserve, dropped once the disk would evict newer values for it
            if d_ready <= disk_reserve:
                if in_flight is not None and oldest_m[0] > in_flight:
                    return True  # the one being spilled is older: it goes first
                memory.empty_segment(oldest_m, drop=True)
            elif not _spill(memory, oldest_m, start_spill):
                return True
        elif disk_short and oldest_d is not None:
            if in_flight is not None and oldest_d[0] > in_flight:
                return True
            disk.empty_segment(oldest_d, drop=True)
        elif oldest_m is not None:  # newer than the disk's oldest, which the spill evicts
            if not _spill(memory, oldest_m, start_spill):
                return True
    return True


def _spill(
    memory: Emptied,
    victim: tuple[int, int, Any],
    start_spill: Callable[[tuple[int, int, Any]], bool] | None,
) -> bool:
    """Spill ``victim`` here, or start its spill elsewhere: False when one still runs."""
    if start_spill is None:
        memory.empty_segment(victim)
        return True
    return start_spill(victim)


class WakePipe:
    """The pipe a writer wakes its cleaner process through (:meth:`SegmentCleaner.wake`):
    the process waits on its read end instead of looking at the index every few
    milliseconds, which took the CPU of the puts and the spills wherever several writers'
    cleaners looked at once (docs/CONNECTOR.md, "Writing around a dry memory tier", has
    the figures). The write end is non-blocking (a full pipe already holds a wake not read yet)
    and closed under its lock, so that no wake writes to a descriptor number reused."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()

    def wake(self) -> None:
        # written with the GIL kept (.nowait_io): beside vLLM's forward, the GIL given up
        # for os.write's system call cost a dump thread a wait of up to the switch interval
        with self._lock:
            if self._write_fd >= 0:
                with contextlib.suppress(OSError):  # full: a wake is pending; or no reader
                    write_nowait(self._write_fd, b"\0")

    def close_read_end(self) -> None:
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def close(self) -> None:
        with self._lock:
            self.close_read_end()
            if self._write_fd >= 0:
                os.close(self._write_fd)
                self._write_fd = -1


def _end(
    proc: subprocess.Popen[bytes],
    parent: int,
    pipe: WakePipe | None = None,
    publisher: PublishChannels | None = None,
) -> None:
    """Stop a cleaner process started by ``parent`` (not a forked child's to stop):
    SIGTERM (it finishes its segment), SIGKILL after STOP_S. Its wake pipe and publish
    channel are closed (in a forked child too: its copies)."""
    if pipe is not None:
        pipe.close()
    if publisher is not None:
        publisher.close()
    if parent != os.getpid() or proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.terminate()
    try:
        proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class SegmentCleaner:
    """A tier's cleaner in this process: the lease thread, and the reserve's process
    (:meth:`use_process`) or, where that cannot run, the thread refilling it too."""

    def __init__(self, tier: Cleaned) -> None:
        self._tier = weakref.ref(tier)
        self._name = f"ucm-{tier.name}-tier-cleaner"
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipe: WakePipe | None = None  # tells the process to look (wake)
        self._publisher: PublishChannels | None = None  # for threads beside a forward
        self._ender: weakref.finalize | None = None  # ends the process, closes the pipe
        self._spec: dict[str, Any] | None = None  # the two tiers, for the process
        self._below: weakref.ref[Any] | None = None  # the tier spilled into
        self._spawn_failed = False
        self._pid = os.getpid()
        self._start_lock = threading.Lock()
        self._warn = RateLimitedLog(log, 30.0)

    def use_process(self, spill_tier: Emptied) -> None:
        """Refill the reserve in a process of its own, which spills into ``spill_tier``."""
        tier = self._tier()
        if tier is not None:
            self._spec = {"memory": tier.spec(), "disk": spill_tier.spec()}
            self._below = weakref.ref(spill_tier)

    @property
    def pid(self) -> int | None:
        """The cleaner process's pid, None when there is none (tests, tools)."""
        proc = self._proc
        return proc.pid if proc is not None and self._pid == os.getpid() else None

    @property
    def publisher(self) -> PublishClient | None:
        """The cleaner process's publish channel (:mod:`.publish_channel`), None when there
        is none that works (no process, it ended, a forked child: its parent's): this
        thread's (:meth:`~.publish_channel.PublishChannels.for_thread`)."""
        channels = self._publisher
        if channels is None or self._pid != os.getpid():
            return None
        client = channels.for_thread()
        return None if client.broken else client

    @property
    def publishers(self) -> PublishChannels | None:
        """Every channel of the cleaner process (tests, tools)."""
        return self._publisher if self._pid == os.getpid() else None

    def wake(self) -> None:
        """A ready segment was taken, or none was left: the reserve needs refilling. The
        process is told through its wake pipe (a byte, never waited for: a full pipe
        already holds a wake it has not read yet), the thread by its event."""
        self.ensure_started()
        if self._proc is None:
            self._wake.set()
            return
        pipe = self._pipe
        if pipe is not None:
            pipe.wake()

    def ensure_started(self) -> None:
        """Start what this process lacks: the lease thread, and the reserve's process."""
        if self._thread is not None and self._pid == os.getpid():
            if self._proc is not None or self._spec is None or self._spawn_failed:
                return
        with self._start_lock:
            if self._pid != os.getpid():  # a forked child: its parent's helpers are not its
                self._pid, self._thread, self._proc = os.getpid(), None, None
            if self._stop.is_set():
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            tier = self._tier()
            if tier is not None and tier.reserve and self._spec is not None:
                if self._proc is None and not self._spawn_failed:
                    self._proc = self._spawn(tier)

    def _spawn(self, tier: Cleaned) -> subprocess.Popen[bytes] | None:
        pipe = WakePipe()
        wake_r = pipe.read_fd
        ours, theirs = [], []  # per channel: (request, answer) ends
        for _ in range(CHANNELS):
            request_r, request_w = os.pipe()
            answer_r, answer_w = os.pipe()
            ours.append((request_w, answer_r))
            theirs.append((request_r, answer_w))
        publisher = PublishChannels(ours)
        args = {"parent": os.getpid(), "sys_path": sys.path, "wake_fd": wake_r,
                "publish_fds": theirs}  # fmt: skip
        args.update(self._spec or {})
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps(args)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(wake_r, *[fd for pair in theirs for fd in pair]),
            )
        except OSError as exc:
            pipe.close()
            publisher.close()
            self._spawn_failed = True
            log.warning(
                "%s tier %s: cleaner process not started (%s): a thread refills the reserve "
                "(spills compete with this process for the GIL)", tier.name, tier.path, exc,
            )  # fmt: skip
            return None
        finally:
            for pair in theirs:  # the process's ends (or nobody's)
                for fd in pair:
                    os.close(fd)
        pipe.close_read_end()  # the process's now
        if self._ender is not None:
            self._ender()  # the process that died: its pipes closed (once: a finalizer)
        self._pipe = pipe
        self._publisher = publisher
        # stop() ends it; so does dropping the tier without close() (a test's, a tool's)
        self._ender = weakref.finalize(tier, _end, proc, os.getpid(), pipe, publisher)
        return proc

    def wait_serving(self, timeout: float = 30.0) -> bool:
        """Wait until the cleaner process serves this process's publishes and leases
        (:meth:`~.publish_channel.PublishChannels.wait_serving`): True at once where
        there is none to wait for (no process: a thread does its work)."""
        channels = self.publishers
        return channels is None or channels.wait_serving(timeout)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until the reserve is full or nothing more can be emptied now (tests,
        tools, benchmarks that start on a quiet store): False on timeout."""
        tier = self._tier()
        if tier is None:
            return True
        deadline = time.monotonic() + timeout
        self.wake()
        while tier.reserve_short():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def stop(self) -> None:
        """Stop the thread and the process, each finishing the segment it is on."""
        self._stop.set()
        self._wake.set()
        mine = self._pid == os.getpid()  # a forked child has neither to wait for
        thread, proc = self._thread, self._proc
        if thread is not None and mine and thread is not threading.current_thread():
            thread.join()
        if proc is not None and mine:
            self._proc = None
            ender, self._ender = self._ender, None
            if ender is not None:
                ender()
            else:
                _end(proc, os.getpid())

    def _restart_if_dead(self, tier: Cleaned) -> None:
        """A cleaner process that died (killed, out of memory) is started again, at most
        once per :data:`POLL_S`: without it the reserve would stay dry for good."""
        proc = self._proc
        if proc is None or proc.poll() is None:
            return
        log.warning(
            "%s tier %s: cleaner process %d ended (status %s): starting another",
            tier.name, tier.path, proc.pid, proc.returncode,
        )  # fmt: skip
        with self._start_lock:
            if self._proc is proc and not self._stop.is_set():
                self._proc = self._spawn(tier)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            tier = self._tier()
            if tier is None:
                return
            below = None
            try:
                tier.release_idle_leases()
                self._restart_if_dead(tier)
                below = self._below() if self._below is not None else None
                if tier.reserve and self._proc is None and below is not None:
                    # the process's work, on this thread: both tiers, one recency order
                    reserve = 0 if below.spec()["fsync"] else None
                    refill_two(tier, below, self._stop, reserve)  # type: ignore[arg-type]
                elif tier.reserve and self._proc is None:
                    refill(tier, self._stop)
            except (StoreError, OSError) as exc:
                self._warn.warning(
                    "round", "%s tier %s: cleaner round failed: %s", tier.name, tier.path, exc
                )
            finally:
                del tier, below  # a store dropped without close() is not kept alive here


__all__ = [
    "AROUND_MAX",
    "LEASE_IDLE_S",
    "Cleaned",
    "Emptied",
    "SegmentCleaner",
    "WakePipe",
    "around_reserve",
    "refill",
    "refill_two",
    "reserve_for",
]
