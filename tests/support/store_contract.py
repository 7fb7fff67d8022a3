"""The contract every KVStore must keep, as plain functions both stores run.

Why plain functions instead of pytest tests: the Mooncake store can only run inside a
private network namespace, so its run happens in a driver process
(``tests/test_store_mooncake.py --driver``) that calls these same functions and reports
each result; the local store runs them directly under pytest. One list, two stores.

Each case takes a :class:`Harness` and raises AssertionError (or anything) on failure.
"""

from __future__ import annotations

import array
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ucm_patch.hooks.stores.base import KVStore, StoreError


@dataclass
class Harness:
    """What a case needs from a store under test.

    make:   a new store instance on the same backing data (same directory / same master).
    tamper: damage the stored value of a key in place: mode "flip" (one payload byte),
            "truncate" (drop the last bytes) or ("swap", other_key) (put the other key's
            stored bytes under this key).
    """

    make: Callable[[], KVStore]
    tamper: Callable[[KVStore, str, object], None]
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])

    def key(self, name: str) -> str:
        """A key unique to this run (stores such as Mooncake are shared between cases)."""
        return f"ucm-test/{self.run_id}/{name}"


def _blob(seed: int, n: int) -> bytes:
    """Deterministic, non-repeating test bytes (a bit flip anywhere changes the value)."""
    rnd = (seed * 2654435761) & 0xFFFFFFFF
    return (rnd.to_bytes(4, "little") + os.urandom(max(0, n - 4)))[:n]


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def case_roundtrip_types(h: Harness) -> None:
    """bytes, bytearray, memoryview and a typed (non-byte) memoryview all round-trip."""
    s = h.make()
    floats = array.array("f", [1.5, -2.25, 3.0, 4.125])
    items = [
        (h.key("bytes"), _blob(1, 1000)),
        (h.key("bytearray"), bytearray(_blob(2, 4096))),
        (h.key("memoryview"), memoryview(_blob(3, 333))[10:]),
        (h.key("typed"), memoryview(floats)),
        (h.key("one-byte"), b"\x00"),
    ]
    assert s.put_many(items) == [True] * len(items)
    keys = [k for k, _ in items]
    asked = [keys[0], h.key("absent"), *keys[1:]]
    got = s.get_many(asked)
    assert got[1] is None
    want = [bytes(v) if not isinstance(v, memoryview) else v.tobytes() for _, v in items]
    assert [got[0], *got[2:]] == want
    assert all(type(v) is bytes for v in got if v is not None)
    assert s.exists_many(asked) == [True, False, True, True, True, True]


def case_empty_batches(h: Harness) -> None:
    """Empty batches are valid and answer empty lists."""
    s = h.make()
    assert s.put_many([]) == []
    assert s.get_many([]) == []
    assert s.exists_many([]) == []


def case_first_value_wins(h: Harness) -> None:
    """Content-hash keys are immutable: a second put of a key is a no-op that returns True."""
    s = h.make()
    k, k2 = h.key("first"), h.key("dup-in-batch")
    assert s.put_many([(k, b"original")]) == [True]
    assert s.put_many([(k, b"replacement-value")]) == [True]
    assert s.put_many([(k2, b"A" * 64), (k2, b"B" * 32)]) == [True, True]
    assert s.get_many([k, k2]) == [b"original", b"A" * 64]


def case_stats_counters(h: Harness) -> None:
    """Counters move by exactly what happened (hits + misses == gets)."""
    s = h.make()
    k1, k2 = h.key("stat1"), h.key("stat2")
    before = dict(s.stats)
    s.put_many([(k1, b"x" * 100), (k2, b"y" * 50)])
    s.get_many([k1, h.key("nope"), k2])
    d = _delta(before, s.stats)
    assert d.get("puts") == 2, d
    assert d.get("bytes_written") == 150, d
    assert d.get("gets") == 3 and d.get("hits") == 2 and d.get("misses") == 1, d
    assert d.get("bytes_read") == 150, d
    assert "corrupt" not in d and "errors" not in d, d


def _corruption(h: Harness, name: str, mode: object) -> None:
    s = h.make()
    k = h.key(name)
    value = _blob(7, 70_000)
    assert s.put_many([(k, value)]) == [True]
    assert s.get_many([k]) == [value]
    h.tamper(s, k, mode)
    corrupt_before = s.stats["corrupt"]
    assert s.get_many([k]) == [None], "corrupt data was served"
    assert s.stats["corrupt"] == corrupt_before + 1
    assert s.exists_many([k]) == [False], "corrupt value was not removed"
    assert s.put_many([(k, value)]) == [True]
    assert s.get_many([k]) == [value], "a re-put after corruption must be readable"


def case_bit_flip_never_served(h: Harness) -> None:
    """One flipped payload bit: None, counted corrupt, removed; a re-put works."""
    _corruption(h, "flip", "flip")


def case_truncated_never_served(h: Harness) -> None:
    """A truncated value (half-written file, short object): None, corrupt, removed."""
    _corruption(h, "truncate", "truncate")


def case_value_under_wrong_key(h: Harness) -> None:
    """Another key's intact value stored under this key fails the key-bound checksum."""
    s = h.make()
    other = h.key("swap-source")
    assert s.put_many([(other, _blob(9, 5000))]) == [True]
    _corruption(h, "swap-target", ("swap", other))


def case_sizes_and_second_instance(h: Harness) -> None:
    """Mixed sizes (tiny to several MiB) round-trip and a second instance reads them."""
    s = h.make()
    sizes = [1, 19, 20, 21, 4095, 300_000, 1 << 20, (3 << 20) + 5, 77]
    items = [(h.key(f"size-{n}"), _blob(n, n)) for n in sizes]
    assert s.put_many(items) == [True] * len(items)
    keys = [k for k, _ in items]
    assert s.get_many(keys) == [v for _, v in items]
    other = h.make()
    assert other.exists_many(keys) == [True] * len(keys)
    assert other.get_many(list(reversed(keys))) == [v for _, v in reversed(items)]


def _mismatches(batch: list[tuple[str, bytes]], got: list[bytes | None]) -> list[str]:
    """Each key read back other than put, and how: missing (a miss, or a get that failed
    and said so by None) or other bytes. It has failed in a full unit run here and
    passed alone: which of the two it was decides where to look."""
    out = []
    for (key, want), value in zip(batch, got, strict=True):
        if value is None:
            out.append(f"{key}: missing")
        elif value != want:
            same = len(value) == len(want)
            out.append(f"{key}: {len(value)} bytes for {len(want)}" if not same
                       else f"{key}: other bytes of its size")  # fmt: skip
    return out


def case_concurrent_threads(h: Harness) -> None:
    """Threads putting and getting (shared and own keys) all see exact values."""
    s = h.make()
    shared = [(h.key(f"shared-{i}"), _blob(100 + i, 20_000 + i)) for i in range(8)]
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            own = [(h.key(f"t{t}-{i}"), _blob(1000 * t + i, 5_000 + 97 * i)) for i in range(25)]
            for start in range(0, len(own), 5):
                batch = own[start : start + 5] + shared[t % 4 : t % 4 + 3]
                assert s.put_many(batch) == [True] * len(batch)
                got = s.get_many([k for k, _ in batch])
                assert got == [v for _, v in batch], (
                    f"thread {t} read wrong data: {_mismatches(batch, got)}; "
                    f"store counters {dict(getattr(s, 'stats', {}))}"
                )
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def case_bad_keys_rejected(h: Harness) -> None:
    """Keys must be non-empty str: ValueError naming the bad key, nothing stored."""
    s = h.make()
    for bad in ("", 123, None, b"bytes-key"):
        for call in (
            lambda b=bad: s.put_many([(b, b"v")]),
            lambda b=bad: s.get_many([b]),
            lambda b=bad: s.exists_many([b]),
        ):
            try:
                call()
            except ValueError as exc:
                assert repr(bad) in str(exc), str(exc)
            else:
                raise AssertionError(f"key {bad!r} was accepted")


def case_close_is_final(h: Harness) -> None:
    """close() is idempotent; afterwards every operation raises StoreError."""
    s = h.make()
    k = h.key("closed")
    assert s.put_many([(k, b"v")]) == [True]
    s.close()
    s.close()
    for call in (
        lambda: s.put_many([(k, b"v")]),
        lambda: s.get_many([k]),
        lambda: s.exists_many([k]),
    ):
        try:
            call()
        except StoreError:
            continue
        raise AssertionError("operation after close() did not raise StoreError")
    assert h.make().get_many([k]) == [b"v"], "close() must not drop stored data"


def case_get_many_into_reads_in_place(h: Harness) -> None:
    """``get_many_into`` (what the connector's loads call) fills the caller's buffers with
    the stored payloads, answers False for a missing, corrupt or other-size value, counts
    like ``get_many``, and copies no value into ``bytes`` on the way (tracemalloc: the
    base class's default, which reads through ``get_many``, allocates every value)."""
    import tracemalloc

    s = h.make()
    size = 200_000
    values = [_blob(70 + i, size) for i in range(4)]
    keys = [h.key(f"into-{i}") for i in range(4)]
    other, bad = h.key("into-other-size"), h.key("into-corrupt")
    assert (
        s.put_many([*zip(keys, values, strict=True), (other, b"x" * 10), (bad, values[0])])
        == [True] * 6
    )
    h.tamper(s, bad, "flip")
    arena = bytearray(size * 7)
    bufs = [memoryview(arena)[i * size : (i + 1) * size] for i in range(7)]
    wanted = [*keys, h.key("into-missing"), other, bad]
    before = dict(s.stats)
    tracemalloc.start()
    try:
        got = s.get_many_into(wanted, bufs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [True] * 4 + [False] * 3, got
    assert [bytes(b) for b in bufs[:4]] == values
    d = _delta(before, s.stats)
    assert (d.get("hits"), d.get("misses"), d.get("corrupt")) == (4, 3, 1), d
    assert d.get("bytes_read") == 4 * size, d
    assert peak < size, f"get_many_into allocated {peak} bytes for {size}-byte values"
    try:
        s.get_many_into(keys, bufs[:2])
    except ValueError as exc:
        assert "4 keys for 2 buffers" in str(exc), exc
    else:
        raise AssertionError("get_many_into accepted 4 keys for 2 buffers")


def case_get_many_scattered_writes_pages_where_told(h: Harness) -> None:
    """``get_many_scattered`` (the connector's loads into a KV cache in host memory)
    writes each value's pages where its target says, run by run (here: each 1000-byte
    page's two halves swapped), answers False for a missing, corrupt or other-size value,
    and counts like ``get_many``."""
    from ucm_patch.hooks.stores.memcopy import address
    from ucm_patch.hooks.stores.scatter import PagePlan, Scatter

    s = h.make()
    page, pages = 1000, 3
    plan = PagePlan(page, ((0, page // 2, page // 2), (page // 2, 0, page // 2)))
    values = [_blob(90 + i, page * pages) for i in range(2)]
    keys = [h.key(f"scatter-{i}") for i in range(2)]
    other, bad = h.key("scatter-other-size"), h.key("scatter-corrupt")
    assert (
        s.put_many([*zip(keys, values, strict=True), (other, b"x" * 10), (bad, values[0])])
        == [True] * 4
    )
    h.tamper(s, bad, "flip")
    cache = memoryview(bytearray(page * pages * 5))
    base = address(cache)
    assert base is not None
    to = [
        Scatter(plan, tuple(base + (k * pages + j) * page for j in range(pages))) for k in range(5)
    ]
    wanted = [*keys, h.key("scatter-missing"), other, bad]
    before = dict(s.stats)
    assert s.get_many_scattered(wanted, to) == [True, True, False, False, False]
    for k, value in enumerate(values):
        for j in range(pages):
            got = bytes(cache[(k * pages + j) * page :][:page])
            want = value[j * page : (j + 1) * page]
            assert got == want[page // 2 :] + want[: page // 2], (k, j)
    d = _delta(before, s.stats)
    assert (d.get("hits"), d.get("misses"), d.get("corrupt")) == (2, 3, 1), d
    try:
        s.get_many_scattered(keys, to[:1])
    except ValueError as exc:
        assert "2 keys for 1 targets" in str(exc), exc
    else:
        raise AssertionError("get_many_scattered accepted 2 keys for 1 target")


CASES: dict[str, Callable[[Harness], None]] = {
    name[len("case_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}
