"""Publishes through the cleaner process for threads beside a forward
(hooks/stores/publish_channel.py): the protocol against a real index, a channel not
serving yet or late or gone (the writer publishes itself, waiting for nobody), and the
memory tier of a real two-tier store whose dump threads' publishes the cleaner process
runs, with nothing lost when it is killed."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support.serving_store import SEG, VALUE, open_store, serving, value
from ucm_patch.hooks.device import CpuDevice
from ucm_patch.hooks.dump.scheduler import DumpScheduler
from ucm_patch.hooks.stores import publish_channel
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.publish_channel import (
    CHANNELS,
    PublishChannels,
    PublishClient,
    beside_forward,
    is_beside_forward,
    serve,
)
from ucm_patch.hooks.stores.segment_index import LOC, SegmentIndex
from ucm_patch.hooks.stores.tier import record_bytes


def _digest(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _locs(seg: int, gen: int, n: int) -> list[tuple[bytes, bytes]]:
    return [(_digest(i), LOC.pack(seg, gen, i * 128, 100)) for i in range(n)]


class _Served:
    """What serve() runs requests on: a real index, and a lease claim given as a function
    (a tier's own is tested on a real store below)."""

    def __init__(self, index: object, claim: object = None) -> None:
        self.index = index
        self._claim = claim

    def claim_for(self, need: int, owner: int) -> tuple[int, int, int, bool] | None:
        assert callable(self._claim)
        return self._claim(need, owner)


class _Channel:
    """A client and a serving thread over two pipes, in this process."""

    def __init__(self, index: object, start: bool = True, claim: object = None) -> None:
        request_r, request_w = os.pipe()
        answer_r, answer_w = os.pipe()
        self.client = PublishClient(request_w, answer_r)
        self._server_fds = (request_r, answer_w)
        self.busy = threading.Lock()
        self.thread = threading.Thread(
            target=serve,
            args=(_Served(index, claim), request_r, answer_w, self.busy),
            daemon=True,
        )
        if start:
            self.start()

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.client._owed is not None and time.monotonic() < deadline:
            self.client._answered(0.05)  # the serving answer (number 0)
        assert self.client._owed is None

    def end_server(self) -> None:
        """The serving side goes away (its process ended)."""
        for fd in self._server_fds:
            os.close(fd)

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def index(tmp_path: Path) -> Iterator[SegmentIndex]:
    idx = SegmentIndex(str(tmp_path / "tier"), 0o700, 0o600, False, 8 << 20)
    yield idx
    idx.close()


def test_a_publish_through_the_channel_is_the_index_publish(index: SegmentIndex) -> None:
    me = os.getpid()
    gen = index.claim(3, None, me, empty=True)
    assert gen is not None
    chan = _Channel(index)
    try:
        locs = _locs(3, gen, 25)
        assert chan.client.publish(3, gen, me, locs, 0, 25 * 128) is True
        got = index.lookup([d for d, _loc in locs])
        assert [LOC.pack(*loc) for loc in got] == [loc for _d, loc in locs]
        assert index.segments()[3].owner == me  # kept: not released
        # released in the same request; then the segment is no longer this owner's: LOST
        more = _locs(3, gen, 30)[25:]
        assert chan.client.publish(3, gen, me, more, 25 * 128, 30 * 128, True) is True
        assert index.segments()[3].owner == 0
        assert chan.client.publish(3, gen, me, _locs(3, gen, 31)[30:], 0, 1, False) is False
        assert chan.client.sent == 3
    finally:
        chan.close()


def test_a_lease_through_the_channel_is_claimed_for_the_writer(index: SegmentIndex) -> None:
    me = os.getpid()
    asked: list[tuple[int, int]] = []

    def claim(need: int, owner: int) -> tuple[int, int, int, bool] | None:
        asked.append((need, owner))
        if len(asked) > 1:
            return None  # none ready
        gen = index.claim(5, None, owner, empty=True)
        assert gen is not None
        return 5, gen, 0, True

    chan = _Channel(index, claim=claim)
    try:
        got = chan.client.lease(4096, me)
        assert got == (5, index.segments()[5].gen, 0, True)
        assert index.segments()[5].owner == me
        assert chan.client.lease(4096, me) is False
        assert asked == [(4096, me), (4096, me)]
    finally:
        chan.close()


def test_one_request_publishes_several_segments_and_claims_leases(index: SegmentIndex) -> None:
    """A put's whole work on the index in one request: the publishes of every segment it
    wrote (a full one given back in its own, one with no records only given back), then
    the leases it wants; fewer leases than asked, none being ready, is DRY."""
    me = os.getpid()
    gens = {seg: index.claim(seg, None, me, empty=True) for seg in (1, 2, 3)}
    free = [7, 8]

    def claim(need: int, owner: int) -> tuple[int, int, int, bool] | None:
        if not free:
            return None
        seg = free.pop(0)
        gen = index.claim(seg, None, owner, empty=True)
        assert gen is not None
        return seg, gen, 0, True

    chan = _Channel(index, claim=claim)
    try:
        first, second = _locs(1, gens[1], 10), _locs(2, gens[2], 14)[10:]
        answer = chan.client.request(me, [
            (1, gens[1], 0, 10 * 128, True, first),
            (2, gens[2], 0, 4 * 128, False, second),
            (3, gens[3], 0, 0, True, []),
        ], need=4096, leases=3)  # fmt: skip
        assert answer is not None
        assert answer.published == [True, True, True]
        assert [lease[0] for lease in answer.leases] == [7, 8] and answer.dry
        rows = index.segments()
        assert (rows[1].owner, rows[2].owner, rows[3].owner) == (0, me, 0)
        assert (rows[7].owner, rows[8].owner) == (me, me)
        got = index.lookup([d for d, _loc in first + second])
        assert [LOC.pack(*loc) for loc in got] == [loc for _d, loc in first + second]
        # a segment not the writer's any more: that publish alone LOST
        gone = (1, gens[1], 0, 1, False, _locs(1, gens[1], 1))
        more = (2, gens[2], 512, 640, False, _locs(2, gens[2], 15)[14:])
        answer = chan.client.request(me, [gone, more])
        assert answer is not None and answer.published == [False, True]
        with pytest.raises(ValueError, match="at most"):
            chan.client.request(me, need=1, leases=publish_channel.MOST + 1)
    finally:
        chan.close()


def test_a_lease_answered_late_is_the_next_one(
    index: SegmentIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease claimed for this process after it stopped waiting is not left owned by
    nobody's knowledge (kept from eviction for the process's life): the next lease is it."""
    monkeypatch.setattr(publish_channel, "ANSWER_TIMEOUT_S", 0.05)
    me = os.getpid()
    go = threading.Event()
    claims = 0

    def claim(need: int, owner: int) -> tuple[int, int, int, bool] | None:
        nonlocal claims
        claims += 1
        assert go.wait(30)
        gen = index.claim(6, None, owner, empty=True)
        return 6, gen, 0, True

    chan = _Channel(index, claim=claim)
    try:
        assert chan.client.lease(4096, me) is None  # late: the caller looks itself
        go.set()
        deadline = time.monotonic() + 10
        while True:  # the late answer is read before the next request
            got = chan.client.lease(4096, me)
            if got:
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert got == (6, index.segments()[6].gen, 0, True)
        assert claims == 1  # that one, not a new claim
    finally:
        go.set()
        chan.close()


class _Failing:
    def publish(self, *args: object, **kwargs: object) -> bool:
        raise StoreError("store index: no room")


def test_a_failed_publish_is_left_to_the_writer(caplog: pytest.LogCaptureFixture) -> None:
    chan = _Channel(_Failing())
    try:
        with caplog.at_level("WARNING", logger=publish_channel.__name__):
            assert chan.client.publish(1, 1, os.getpid(), _locs(1, 1, 2), 0, 256) is None
            assert chan.client.publish(1, 1, os.getpid(), _locs(1, 1, 2), 0, 256) is None
        assert not chan.client.broken  # the channel works; the index refused
        assert sum("no room" in r.getMessage() for r in caplog.records) == 1  # once
    finally:
        chan.close()


def test_a_channel_not_serving_yet_waits_for_nobody(index: SegmentIndex) -> None:
    chan = _Channel(index, start=False)
    try:
        t = time.perf_counter()
        assert chan.client.publish(1, 1, os.getpid(), _locs(1, 1, 2), 0, 256) is None
        assert time.perf_counter() - t < publish_channel.ANSWER_TIMEOUT_S / 4
        assert chan.client._number == 0  # nothing was sent
        chan.start()
        gen = index.claim(1, None, os.getpid(), empty=True)
        assert chan.client.publish(1, gen, os.getpid(), _locs(1, gen, 2), 0, 256) is True
    finally:
        chan.close()


def test_waiting_for_the_channels_to_serve(index: SegmentIndex) -> None:
    """PublishChannels.wait_serving: False while a channel's process has not answered its
    first (number 0), True once every one has, whether read yet or not."""
    chans = [_Channel(index, start=False) for _ in range(2)]
    channels = PublishChannels([])
    channels.clients = [c.client for c in chans]
    try:
        t = time.perf_counter()
        assert channels.wait_serving(0.2) is False
        assert time.perf_counter() - t >= 0.15
        chans[0].thread.start()
        assert channels.wait_serving(0.2) is False  # the second one still does not serve
        chans[1].thread.start()
        assert channels.wait_serving(10) is True
        assert all(c.client._owed == 0 for c in chans)  # its answer is left to be read
        gen = index.claim(1, None, os.getpid(), empty=True)
        assert chans[0].client.publish(1, gen, os.getpid(), _locs(1, gen, 2), 0, 256) is True
        assert chans[0].client._owed is None and channels.wait_serving(0) is True
    finally:
        for c in chans:
            c.close()


def test_a_store_waits_for_its_cleaner_process_to_serve(tmp_path: Path) -> None:
    """LocalStore.wait_writes_ready after prepare_writes: True once the cleaner process
    answers on every channel (a put beside the forward then publishes through it at
    once); True at once for a store without a memory tier (no process to wait for)."""
    s = open_store(tmp_path)
    try:
        s.prepare_writes()
        assert s.memory is not None and s.memory.cleaner.publishers is not None
        assert s.wait_writes_ready(30) is True
        for client in s.memory.cleaner.publishers.clients:
            with client._lock:
                client._catch_up()
            assert client._owed is None, "a channel said to serve had not answered"
    finally:
        s.close()
    disk_only = LocalStore(tmp_path / "disk", capacity_bytes=8 * SEG, segment_bytes=SEG)
    assert disk_only.wait_writes_ready(0) is True
    disk_only.close()


class _Slow:
    """An index whose first publish waits for ``go``."""

    def __init__(self, index: SegmentIndex) -> None:
        self.index = index
        self.go = threading.Event()
        self.calls = 0

    def publish(self, *args: object, **kwargs: object) -> bool:
        self.calls += 1
        if self.calls == 1:
            assert self.go.wait(30)
        return self.index.publish(*args, **kwargs)  # type: ignore[arg-type]


def test_a_late_answer_is_skipped_and_the_writer_publishes_meanwhile(
    index: SegmentIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish_channel, "ANSWER_TIMEOUT_S", 0.05)
    me = os.getpid()
    gen = index.claim(2, None, me, empty=True)
    slow = _Slow(index)
    chan = _Channel(slow)
    try:
        assert chan.client.publish(2, gen, me, _locs(2, gen, 2), 0, 256) is None  # late
        assert chan.client.publish(2, gen, me, _locs(2, gen, 3), 0, 384) is None  # owed
        assert slow.calls == 1  # the second was never sent
        slow.go.set()
        deadline = time.monotonic() + 10
        while chan.client.publish(2, gen, me, _locs(2, gen, 4), 0, 512) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not chan.client.broken
        assert len([loc for loc in index.lookup([_digest(i) for i in range(4)]) if loc]) == 4
    finally:
        slow.go.set()
        chan.close()


def test_a_channel_whose_process_ended_is_broken(index: SegmentIndex) -> None:
    chan = _Channel(index, start=False)
    chan.end_server()  # gone before it served
    try:
        assert chan.client.publish(1, 1, os.getpid(), _locs(1, 1, 1), 0, 128) is None
        assert chan.client.broken  # its answers' end read EOF
        assert chan.client._number == 0  # nothing was sent
        assert chan.client.publish(1, 1, os.getpid(), _locs(1, 1, 1), 0, 128) is None
    finally:
        chan.close()


# -- a real two-tier store -------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    s = open_store(tmp_path)
    yield s
    s.close()


def _in_process_publishes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = SegmentIndex.publish

    def counted(self: SegmentIndex, *args: object, **kwargs: object) -> bool:
        calls.append(threading.get_ident())
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SegmentIndex, "publish", counted)
    return calls


def _in_process_calls(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> list[str]:
    calls: list[str] = []
    for name in names:
        real = getattr(SegmentIndex, name)

        def counted(self: SegmentIndex, *a: object, _real=real, _name=name, **k: object):
            if is_beside_forward():
                calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(SegmentIndex, name, counted)
    return calls


def _put_beside_forward(s: LocalStore, keys: Sequence[str]) -> list[bool]:
    out: list[bool] = []

    def run() -> None:
        beside_forward()
        for k in keys:
            out.extend(s.put_many([(k, value(k))]))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_a_thread_beside_the_forward_publishes_through_the_cleaner(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = serving(store)
    calls = _in_process_publishes(monkeypatch)
    index_calls = _in_process_calls(monkeypatch, ["claim", "segments", "release"])
    per_segment = SEG // record_bytes(VALUE)  # from the record layout
    keys = [f"k{i}" for i in range(3 * per_segment)]  # across segments (leases, releases)
    sent = client.sent
    assert all(_put_beside_forward(store, keys))
    assert calls == []  # not one publish in this process
    assert index_calls == []  # nor a lease's scan or claim, nor a release
    # one request per put: its publish, and once it filled a segment, the next lease
    # in the same request (the process kept one from the put of "start")
    assert client.sent - sent == len(keys)
    assert store.get_many(keys) == [value(k) for k in keys]
    # a thread not beside a forward publishes itself (a round trip costs it more)
    sent = client.sent
    assert all(store.put_many([("plain", value("plain"))]))
    assert len(calls) == 1 and client.sent == sent


def test_nothing_is_lost_when_the_cleaner_is_killed(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving(store)
    assert store.memory is not None
    pid = store.memory.cleaner.pid
    assert pid is not None
    calls = _in_process_publishes(monkeypatch)
    os.kill(pid, signal.SIGKILL)
    keys = [f"after{i}" for i in range(20)]
    t = time.perf_counter()
    assert all(_put_beside_forward(store, keys))
    assert time.perf_counter() - t < publish_channel.ANSWER_TIMEOUT_S  # nobody waited out
    assert calls  # published here
    assert store.get_many(keys) == [value(k) for k in keys]


def test_the_dump_workers_run_beside_the_forward() -> None:
    seen: list[bool] = []

    class _Store:
        def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
            seen.append(is_beside_forward())
            return [True] * len(items)

    sched = DumpScheduler(CpuDevice(), workers=1, blocking_finish=True, name="ucm-test-dump")
    try:
        client = sched.client("t")
        batch = client.open_batch(["r"], _Store())
        assert sched.submit(batch, 0, ["a"], [b"x"])
        sched.seal(batch)
        done = client.get_finished(["r"], timeout=30)
        assert done.sending == {"r"}
    finally:
        sched.shutdown()
    assert seen == [True]
    assert not is_beside_forward()  # this thread is not one


def test_answers_given_up_on_lose_nothing_and_fail_nothing(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every answer given up on at once: the writer publishes itself while the cleaner
    may publish the same batch (and give its full segment back) before or after it. A
    publish the cleaner already ran is not a lost segment, and nothing is lost."""
    serving(store)
    monkeypatch.setattr(publish_channel, "ANSWER_TIMEOUT_S", 0.0)
    real = SegmentIndex.publish

    def after_the_cleaner(self: SegmentIndex, *args: object, **kwargs: object) -> bool:
        time.sleep(0.05)  # the cleaner's publish of the same batch runs first
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SegmentIndex, "publish", after_the_cleaner)
    per_segment = SEG // record_bytes(VALUE)
    keys = [f"race{i}" for i in range(4 * per_segment)]
    assert all(_put_beside_forward(store, keys))
    assert store.get_many(keys) == [value(k) for k in keys]


def test_a_forked_child_closes_its_copy_while_a_request_is_in_flight(
    index: SegmentIndex,
) -> None:
    """A child forked while a thread waits for an answer (the lock taken) closes its
    copy of the channel at exit without that lock, which no thread of it will release."""
    chan = _Channel(index)
    try:
        assert chan.client._lock.acquire()  # a request in flight in another thread
        pid = os.fork()
        if pid == 0:  # the child: close, then report how it went
            try:
                chan.client.close()
                os._exit(0 if chan.client.broken else 1)
            finally:
                os._exit(2)
        deadline = time.monotonic() + 10
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the child's close waited for a lock no thread of it holds")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not chan.client.broken  # the parent's channel is untouched
    finally:
        if chan.client._lock.locked():
            chan.client._lock.release()
        chan.close()


def test_each_thread_beside_the_forward_has_a_channel_of_its_own(store: LocalStore) -> None:
    """A dump thread never waits behind another's request: each takes a channel of its
    own, served by a thread of its own in the cleaner process; past CHANNELS they share."""
    channels = serving(store)
    assert store.memory is not None
    got: list[PublishClient | None] = []

    def take() -> None:
        beside_forward()
        client = store.memory.cleaner.publisher  # type: ignore[union-attr]
        got.append(client)
        assert client is store.memory.cleaner.publisher  # type: ignore[union-attr]
        key = f"own{len(got)}"
        assert store.put_many([(key, value(key))]) == [True]

    for _ in range(CHANNELS + 1):
        t = threading.Thread(target=take)
        t.start()
        t.join()
    firsts = got[:CHANNELS]
    assert len({id(c) for c in firsts}) == CHANNELS  # one each
    assert got[CHANNELS] in firsts  # then shared
    assert all(c is not None and c.sent >= 1 for c in firsts)  # every one served
    assert channels.sent >= CHANNELS + 1
