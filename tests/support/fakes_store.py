"""A KVStore whose latency, bandwidth, capacity and failures the test controls.

Why a fake and not the local store: the scheduler tests need to hold a put "busy" at an
exact moment (to prove the forward side does not wait), fail exactly the puts they choose,
and simulate slow storage without touching the disk. The store contract (first value wins,
flags per item, StoreError on failure) is the one in ``ucm_patch.hooks.stores.base``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

from ucm_patch.hooks.stores.base import KVStore, StoreError


class FakeStore(KVStore):
    """Thread-safe in-memory store with test controls.

    * ``latency_s`` / ``bandwidth_Bps``: every ``put_many`` sleeps ``latency_s + bytes /
      bandwidth_Bps`` (sleep releases the GIL, like real I/O).
    * ``hold(pred)``: puts with a key matching ``pred`` (default: all) block until
      ``release()``; ``wait_busy(n)`` waits until ``n`` puts are blocked or running.
    * ``fail_keys`` / ``error_rate`` / ``fail_next(n)``: raise StoreError for those puts.
    * ``capacity_items``: puts beyond it return False per item (store full).
    """

    name = "fake"

    def __init__(
        self,
        latency_s: float = 0.0,
        bandwidth_Bps: float | None = None,
        capacity_items: int | None = None,
        error_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.latency_s = latency_s
        self.bandwidth_Bps = bandwidth_Bps
        self.capacity_items = capacity_items
        self.error_rate = error_rate
        self.fail_keys: set[str] = set()
        self._fail_next = 0
        self._rng = random.Random(seed)
        self.data: dict[str, bytes] = {}
        self.put_log: list[tuple[str, ...]] = []  # keys per successful put_many, in order
        self._cv = threading.Condition()
        self._gate = threading.Event()
        self._gate.set()
        self._hold_pred: Callable[[str], bool] | None = None
        self.busy = 0  # puts currently inside put_many
        self.puts_started = 0
        self.busy_time_s = 0.0  # total time spent inside put_many (all threads)

    # -- controls --------------------------------------------------------------------
    def hold(self, pred: Callable[[str], bool] | None = None) -> None:
        """Block puts whose keys match ``pred`` (all puts when None) until release()."""
        with self._cv:
            self._hold_pred = pred if pred is not None else (lambda _k: True)
            self._gate.clear()

    def release(self) -> None:
        with self._cv:
            self._hold_pred = None
            self._gate.set()

    def fail_next(self, n: int) -> None:
        """The next ``n`` puts raise StoreError."""
        with self._cv:
            self._fail_next += n

    def wait_busy(self, n: int, timeout: float = 5.0) -> bool:
        """Wait until at least ``n`` puts are inside put_many."""
        with self._cv:
            return self._cv.wait_for(lambda: self.busy >= n, timeout)

    # -- KVStore ---------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        keys = tuple(k for k, _ in items)
        t0 = time.perf_counter()
        with self._cv:
            self.busy += 1
            self.puts_started += 1
            self._cv.notify_all()
            held = self._hold_pred is not None and any(self._hold_pred(k) for k in keys)
            fail = False
            if self._fail_next:
                self._fail_next -= 1
                fail = True
            elif any(k in self.fail_keys for k in keys):
                fail = True
            elif self.error_rate and self._rng.random() < self.error_rate:
                fail = True
        try:
            if held:
                self._gate.wait()
            nbytes = sum(len(bytes(v)) for _, v in items)
            delay = self.latency_s + (nbytes / self.bandwidth_Bps if self.bandwidth_Bps else 0)
            if delay > 0:
                time.sleep(delay)
            with self._cv:
                if fail:
                    self.stats["errors"] += 1
                    raise StoreError(f"fake store: injected failure for keys {list(keys)[:3]}")
                flags: list[bool] = []
                for key, value in items:
                    if key in self.data:
                        flags.append(True)
                    elif self.capacity_items is not None and len(self.data) >= self.capacity_items:
                        self.stats["skipped_full"] += 1
                        flags.append(False)
                    else:
                        self.data[key] = bytes(value)
                        self.stats["bytes_written"] += len(self.data[key])
                        flags.append(True)
                self.stats["puts"] += len(items)
                self.put_log.append(keys)
                return flags
        finally:
            with self._cv:
                self.busy -= 1
                self.busy_time_s += time.perf_counter() - t0
                self._cv.notify_all()

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._cv:
            self.stats["gets"] += len(keys)
            return [self.data.get(k) for k in keys]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        with self._cv:
            return [k in self.data for k in keys]
