"""Leases asked for when a step starts (``KVStore.expect_puts``): the forward's thread
tells the store how much the step's dumps will put, the memory tier sends one lease
request for it to its cleaner process and never waits for the answer
(``PublishClient.send_ahead``); the dump threads' puts then take the leases answered
(``take_ahead``, read with the GIL kept) instead of each asking for its own, and leases
no put took are given back once idle. The connector's bind tells the store its step's
dumps, counted from the step's metadata."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_harness import (  # store_fixture: the ``store`` fixture
    ControlledLocalStore,
    Req,
    blocks,
    new_req,
    store_fixture,  # noqa: F401
)
from tests.support.connector_harness import sched_output as so
from tests.support.serving_store import SEG, VALUE, open_store, serving, value
from tests.test_connector_gpu_layouts import BS, TOKENS, GpuHarness
from tests.test_page_views import NHD
from tests.test_store_beside_writes import _beside, _copies, _python_sends
from ucm_patch import connector
from ucm_patch.hooks.stores import publish_channel
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.tier import Tier, record_bytes


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalStore]:
    s = open_store(tmp_path)
    yield s
    s.close()


def _mine(tier: Tier) -> set[int]:
    """The segments this process holds leased."""
    return {seg for seg, row in tier.index.segments().items() if row.owner == os.getpid()}


def _answered(client: publish_channel.PublishClient) -> None:
    """Until the answer to ``client``'s request is there to read."""
    assert select.select([client._answer_fd], [], [], 30)[0], "never answered"


def _no_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait for an answer (``select``, the one GIL give-up of a request) fails."""

    def waited(*_a: Any) -> Any:
        raise AssertionError("waited for an answer")

    monkeypatch.setattr(publish_channel.select, "select", waited)


def test_a_request_sent_ahead_is_answered_and_taken_without_a_wait(
    local: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    channels = serving(local)
    memory = local.memory
    assert memory is not None
    client = channels.for_thread()
    size = record_bytes(VALUE)
    before = _mine(memory)
    assert client.send_ahead(os.getpid(), size, 2) and client.owes
    # one answer owed: a second request is not sent, and nothing waits for the first
    assert not client.send_ahead(os.getpid(), size, 1)
    _answered(client)
    with monkeypatch.context() as m:
        _no_waits(m)
        got = client.take_ahead()
    assert len(got) == 2 and not client.owes
    assert {seg for seg, *_ in got} <= _mine(memory) - before  # claimed for this process
    assert all(end + size <= SEG for _seg, _gen, end, _ready in got)
    assert client.take_ahead() == []  # taken once
    for seg, gen, end, ready in got:  # given back
        memory._seal_quietly(memory._leased(seg, gen, end, ready=ready))
    assert _mine(memory) == before


def test_puts_told_ahead_ask_for_no_lease_of_their_own(
    local: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving(local)
    memory = local.memory
    assert memory is not None
    memory.release_idle_leases(0)  # as after an idle second: no lease kept
    assert not memory.holds_kept_lease()
    assert memory.cleaner.wait_idle(30)  # the reserve refilled
    per_segment = SEG // record_bytes(VALUE)
    # a segment and a half: the request ahead asks for two and one more, at most the
    # reserve; the first claimed may be the one given back, with a value in it
    keys = [f"k{i}" for i in range(per_segment + per_segment // 2)]
    assert memory.reserve >= 2 and 2 * (per_segment - 1) >= len(keys)
    python_sends = _python_sends(monkeypatch)
    copies = _copies(monkeypatch)
    local.expect_puts(len(keys), len(keys) * VALUE, 1)  # on the forward's thread
    assert len(python_sends) == 1 and memory._ahead is not None  # the request ahead
    _answered(memory._ahead[1])
    channels = memory.cleaner.publishers
    assert channels is not None
    sent = channels.sent
    assert all(_beside(lambda: local.put_many([(k, value(k)) for k in keys])))
    # the put found its leases kept: no request for them from Python, one native call
    # that copied every value and sent the publishes
    assert len(python_sends) == 1
    assert copies == [("send", len(keys))]
    assert channels.sent - sent == 1
    assert memory._ahead is None
    assert local.get_many(keys) == [value(k) for k in keys]


def test_a_process_keeping_leases_enough_asks_nothing_ahead(
    local: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving(local)  # its put left one lease kept
    memory = local.memory
    assert memory is not None and len(memory._kept) == 1
    python_sends = _python_sends(monkeypatch)
    # a value needs a segment, and one more (the first claimed may hold values): one
    # kept, one asked for
    local.expect_puts(1, VALUE, 1)
    assert len(python_sends) == 1 and memory._ahead is not None
    _answered(memory._ahead[1])
    memory.release_idle_leases(3600)  # the cleaner thread's pass: the answer kept
    assert memory._ahead is None and len(memory._kept) == 2
    local.expect_puts(1, VALUE, 1)  # enough kept: nothing asked
    assert len(python_sends) == 1 and memory._ahead is None
    memory.release_idle_leases(0)
    local.expect_puts(1, VALUE, 1)  # none kept now: one request
    assert len(python_sends) == 2 and memory._ahead is not None


def test_leases_answered_ahead_that_no_put_took_are_given_back_when_idle(
    local: LocalStore,
) -> None:
    serving(local)
    memory = local.memory
    assert memory is not None
    memory.release_idle_leases(0)
    before = _mine(memory)
    local.expect_puts(2 * (SEG // record_bytes(VALUE)), 2 * SEG, 1)
    assert memory._ahead is not None
    client = memory._ahead[1]
    _answered(client)
    deadline = time.monotonic() + 30
    while not _mine(memory) - before:  # claimed for this process in the cleaner process
        assert time.monotonic() < deadline
        time.sleep(0.01)
    memory.release_idle_leases(0)  # the cleaner thread's pass: kept, then idle, given back
    assert memory._ahead is None and not client.owes
    assert _mine(memory) == before


def test_bind_tells_the_store_its_steps_dumps(
    store: ControlledLocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connector's bind tells the store, once per step, how many values its dumps
    put and their bytes (from the step's metadata and the rows' page views), and over
    how many dump threads."""
    told: list[tuple[int, int, int]] = []
    real = store.expect_puts

    def expect_puts(values: int, nbytes: int, puts: int) -> None:
        told.append((values, nbytes, puts))
        real(values, nbytes, puts)

    monkeypatch.setattr(store, "expect_puts", expect_puts)
    h = GpuHarness("flash_attn", NHD)
    ws = h.worker._worker_side
    req = Req("r0", list(TOKENS), block_size=BS)
    h.sched.get_num_new_matched_tokens(req, 0)
    ids = [3, 7, 11, 2]
    h.sched.update_state_after_alloc(req, blocks(ids), 0)
    md = h.step(so([new_req("r0", [ids], 0)], scheduled={"r0": len(TOKENS)}))
    assert connector.wait_for_dumps(30.0)
    values = nbytes = 0
    for group, block_ids, _hash in md.dumps["r0"]:
        for r in ws.layout.rows_of_group[group]:
            view = ws.views[r]
            assert view is not None
            values += 1
            nbytes += len(block_ids) * view.page_bytes
    assert values > 0
    assert told == [(values, nbytes, ws.sched.config["workers"])]
