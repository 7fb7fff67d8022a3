"""The cleaner process of a memory tier (:mod:`.segment_cleaner` starts one per writer).

It opens the two tiers again from their specs (:meth:`Tier.spec`), never the store: it
does not count as a user of the memory tier (whose last user's close spills and removes
it), and it allocates nothing (no warmer). It refills the reserve whenever it is short,
looking every :data:`ACTIVE_POLL_S` while puts or hits land (the tier's recency stamps
change) and every :data:`IDLE_POLL_S` once none have for :data:`IDLE_AFTER_S`. It exits
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
from typing import Any

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import load_store_key
from ucm_patch.hooks.stores.segment_cleaner import refill
from ucm_patch.hooks.stores.tier import Tier

log = logging.getLogger(__name__)

#: How often the reserve is checked while puts arrive, and once none have for
#: :data:`IDLE_AFTER_S` (a segment of the connector's size fills in a few times the
#: active period at a GPU's rate of KV).
ACTIVE_POLL_S, IDLE_POLL_S, IDLE_AFTER_S = 0.002, 0.02, 1.0


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
    try:
        seen, active_until = b"", 0.0
        while not stopping.is_set() and os.getppid() == parent and _present(memory, disk):
            now = time.monotonic()
            stamps = memory.stamps()
            if stamps != seen:  # a put or a hit since the last look
                seen, active_until = stamps, now + IDLE_AFTER_S
            try:
                refill(memory, stopping)
            except (StoreError, OSError) as exc:
                warn.warning("round", "%s: cleaner round failed: %s", memory.path, exc)
            stopping.wait(ACTIVE_POLL_S if now < active_until else IDLE_POLL_S)
    finally:
        memory.close()
        disk.close()


__all__ = ["ACTIVE_POLL_S", "IDLE_AFTER_S", "IDLE_POLL_S", "main"]
