"""The store interface the dump scheduler and the connector talk to.

Keys are content-hash strings (block hash + layout coordinates such as storage row and
rank); values are raw bytes of one chunk of blocks (or one state) of one storage row. A
store is shared by every thread of the dump scheduler's pool, so implementations must be
thread-safe.

Contract (all stores, verified by the shared store test-suite, tests/support/store_contract.py):

* Keys must be non-empty ``str``; anything else raises ValueError naming the key.
* ``put_many`` stores each value under its key unless the key already exists (content
  hashes are immutable, so the first value wins, also within one batch). It returns one
  flag per item: True stored or already present, False skipped because the store is full.
  Any other failure raises :class:`StoreError`; nothing is half-visible after a failed put
  (a reader sees the whole value or no value).
* ``get_many`` returns one ``bytes`` per key, or None when the key is missing *or its
  data failed the integrity check* (corrupt data is never served; it is counted in
  ``stats["corrupt"]`` and removed). Other failures (I/O error, server unreachable) raise
  :class:`StoreError`.
* ``exists_many`` answers presence without reading values (so without an integrity check);
  failures raise :class:`StoreError`.
* ``close`` is idempotent; afterwards every operation raises :class:`StoreError`. Stored
  data is not dropped by closing.
* ``stats`` is a dict of monotonically increasing counters: ``puts`` items offered to
  ``put_many``; ``skipped_full`` items answered False; ``bytes_written`` payload bytes
  sent/written; ``gets`` keys asked of ``get_many`` = ``hits`` + ``misses`` (a corrupt
  value is a miss and also counted in ``corrupt``); ``bytes_read`` payload bytes
  returned; ``errors`` calls that raised :class:`StoreError`; ``evictions`` values
  dropped for capacity (stores that evict themselves). Stores may add counters.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ucm_patch.hooks.stores.scatter import Scatter, check_targets, scatter_from, set_marks
from ucm_patch.hooks.value_checks import SettingError


class StoreError(RuntimeError):
    """A store operation failed (unreachable server, I/O error, read-only directory)."""


class StoreConfigError(SettingError):
    """A store config key is unknown or its value is invalid; the message names the key."""


class ValueSizeError(StoreConfigError):
    """The store as configured cannot hold the values it is opened for (``value_bytes`` of
    :func:`~ucm_patch.hooks.stores.make_store`): refused at start; the message names the
    keys to change and the value size."""


class KVStore(ABC):
    """Abstract KV block store."""

    name: str = "abstract"

    def __init__(self) -> None:
        self.stats: dict[str, int] = {
            "puts": 0,
            "gets": 0,
            "hits": 0,
            "misses": 0,
            "corrupt": 0,
            "errors": 0,
            "evictions": 0,
            "skipped_full": 0,
            "bytes_written": 0,
            "bytes_read": 0,
        }
        # Guards ``stats`` and ``_closed``, nothing else. A leaf lock: held for a few dict
        # updates only, never while taking another lock or calling out, so a store may take
        # it while holding a lock of its own, never the other way round.
        self._stats_lock = threading.Lock()
        self._closed = False

    # -- bookkeeping shared by the stores ---------------------------------------------------

    def _label(self) -> str:
        """How the store names itself in its errors (``local store '/data/kv'``); stores
        with more to say than their :attr:`name` override it."""
        return f"{self.name} store"

    def _check_open(self) -> None:
        """Raise :class:`StoreError` once the store is closed."""
        if self._closed:
            raise StoreError(f"{self._label()} is closed")

    def _mark_closed(self) -> bool:
        """Mark the store closed: True for the call that closed it, False after."""
        with self._stats_lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _count(self, **deltas: int) -> None:
        """Add to counters of :attr:`stats`."""
        with self._stats_lock:
            stats = self.stats
            for name, delta in deltas.items():
                stats[name] += delta

    def _set_counts(self, totals: Callable[[], Mapping[str, int]]) -> None:
        """Set counters of :attr:`stats` to totals kept elsewhere, read by ``totals()``
        under the lock (so two callers never set them out of order); ``totals`` takes no
        lock."""
        with self._stats_lock:
            self.stats.update(totals())

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        """Store values; True per item stored or present, False when skipped (full)."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values per key; None when missing or corrupt."""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence per key."""

    def get_many_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each key's value into the writable byte buffer of the same index; True per
        buffer filled, False when the value is missing, corrupt or not that size (the
        buffer's content is then undefined). Stores that can read in place override this
        (the local store reads files straight into the buffers: no ``bytes`` per value);
        this default copies from :meth:`get_many`."""
        if len(keys) != len(buffers):
            raise ValueError(f"get_many_into: {len(keys)} keys for {len(buffers)} buffers")
        out: list[bool] = []
        for value, buf in zip(self.get_many(keys), buffers, strict=True):
            if value is None or len(value) != len(buf):
                out.append(False)
                continue
            buf[:] = value
            out.append(True)
        return out

    def lookup_for_load(self, keys: Sequence[str]) -> Any:
        """Where the keys' values are, for a :meth:`get_many_scattered` soon after (its
        ``located``), so that the caller can look them up on a thread of its choosing;
        None (the default): the store looks them up in that call."""
        return None

    def get_many_scattered(
        self,
        keys: Sequence[str],
        targets: Sequence[Scatter],
        marks: Sequence[tuple[int, int]] = (),
        flags: Any = None,
        located: Any = None,
    ) -> list[bool]:
        """Write each key's value where the target of the same index says (its pages into
        another memory, a KV cache: :mod:`~ucm_patch.hooks.stores.scatter`); True per value
        written and verified, False when it is missing, corrupt or not the target's size
        (its pages may have been written then: they hold nothing usable). The caller
        checked every page address. Stores that read in place override this (the local
        store: straight from its segments); this default reads each value, then writes its
        runs.

        ``marks`` (end index in ``keys``, flag index) into ``flags``, a ctypes ``uint8``
        array: each flag set once the values before its end are written (rows a reader
        waits for one by one); this default sets them all at the end."""
        check_targets(keys, targets)
        out: list[bool] = []
        try:
            for value, target in zip(self.get_many(keys), targets, strict=True):
                if value is None or len(value) != target.nbytes:
                    out.append(False)
                    continue
                scatter_from(memoryview(value), target)
                out.append(True)
        finally:
            set_marks(marks, flags)
        return out

    def max_value_bytes(self) -> int | None:
        """The largest value a put can store; None where the store sets no such limit
        (the default: a Mooncake store's room is the cluster's, known only to its master)."""
        return None

    def register_host_memory(self, addr: int, size: int) -> bool:
        """Offer ``size`` bytes at ``addr``, a host buffer the caller keeps alive until
        :meth:`unregister_host_memory`, for zero-copy transfers: a value put from inside it
        is sent from there, without a copy into the store's own buffers. False: this store
        has no use for it (the default: the local store copies into its segments anyway)."""
        return False

    def unregister_host_memory(self, addr: int) -> None:  # noqa: B027 - optional hook
        """Withdraw a region :meth:`register_host_memory` accepted, before it is freed
        (no put from it may be in flight)."""

    def prepare_writes(self) -> None:  # noqa: B027 - optional hook
        """A process that will write starts what its writes use now, at start, not on its
        first put (the default: nothing to start)."""

    def expect_puts(self, values: int, nbytes: int, puts: int) -> None:  # noqa: B027
        """``values`` values of ``nbytes`` in all are about to be put, in about ``puts``
        puts from the dump threads (a step's dumps, told on the forward's thread when
        the step starts): a store may get ready for them now, but never waits here (the
        default: nothing to do)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release connections / handles. Idempotent."""
