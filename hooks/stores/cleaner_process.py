"""The cleaner process of a memory tier (:mod:`.segment_cleaner` starts one per writer).

It opens the two tiers again from their specs (:meth:`Tier.spec`), never the store: it
does not count as a user of the memory tier (whose last user's close spills and removes
it), and it allocates nothing (no warmer). It refills the memory tier's reserve, and the
disk tier's that puts written around a dry memory tier take from, in one recency order
over both (:func:`~.segment_cleaner.refill_two`), whenever one is short, looking every
:data:`ACTIVE_POLL_S` while puts or hits land (either tier's recency stamps change) and
every :data:`IDLE_POLL_S` once none have for :data:`IDLE_AFTER_S`. It exits
on SIGTERM (``close``: after the segment it is spilling), once its parent is gone
(killed included) or a tier's directory is, and ignores a terminal's SIGINT, which is
its parent's to handle.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import load_store_key
from ucm_patch.hooks.stores.segment_cleaner import around_reserve, refill_two
from ucm_patch.hooks.stores.tier import Tier

log = logging.getLogger(__name__)

#: How often the reserve is checked while puts arrive, and once none have for
#: :data:`IDLE_AFTER_S` (a segment of the connector's size fills in a few times the
#: active period at a GPU's rate of KV).
ACTIVE_POLL_S, IDLE_POLL_S, IDLE_AFTER_S = 0.002, 0.02, 1.0

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

    def __init__(self, memory: Tier, warn: RateLimitedLog) -> None:
        self._memory, self._warn = memory, warn
        self._pool = ThreadPoolExecutor(1, "ucm-spill")
        self._running: Future[None] | None = None

    def start(self, victim: tuple[int, int, Any]) -> bool:
        """Start spilling ``victim``: False (nothing started) while a spill runs."""
        if self._running is not None and not self._running.done():
            return False
        self._running = self._pool.submit(self._spill, victim)
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


def _present(*tiers: Tier) -> bool:
    """Whether every tier's directory is still there (one removed behind the store, or
    by a store's last close, ends this process)."""
    return all(os.fstat(t.dir_fd).st_nlink > 0 for t in tiers)


def main(args: dict[str, Any]) -> None:
    """Run until SIGTERM or until the parent ``args["parent"]`` is gone: ``args`` holds
    the ``memory`` and ``disk`` tiers' specs."""
    logging.basicConfig(level=logging.WARNING, format="ucm_patch cleaner %(process)d: %(message)s")
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
    spills = SpillThread(memory, warn)
    try:
        seen, seen_disk, active_until, unfinished = b"", b"", 0.0, True
        reserve = 0 if disk.fsync else around_reserve(disk.count)
        while not stopping.is_set() and os.getppid() == parent and _present(memory, disk):
            now = time.monotonic()
            stamps, disk_stamps = memory.stamps(), disk.stamps()  # puts around land on disk
            moved = disk_stamps != seen_disk
            if stamps != seen or moved:  # a put or a hit since the last look
                seen, seen_disk, active_until = stamps, disk_stamps, now + IDLE_AFTER_S
            try:
                unfinished = refill_two(
                    memory, disk, stopping, reserve, moved or unfinished, spills.start
                )
            except (StoreError, OSError) as exc:
                unfinished = True
                warn.warning("round", "%s: cleaner round failed: %s", memory.path, exc)
            stopping.wait(ACTIVE_POLL_S if now < active_until else IDLE_POLL_S)
    finally:
        spills.close()
        writer.close()
        memory.close()
        disk.close()


__all__ = [
    "ACTIVE_POLL_S",
    "IDLE_AFTER_S",
    "IDLE_POLL_S",
    "SPILL_WRITE_NICE",
    "SpillThread",
    "SpillWriter",
    "main",
]
