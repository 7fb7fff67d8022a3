"""UCMPatchConnector scheduler + worker sides in one process (no engine): the rules.

Each test plays engine steps through :class:`tests.support.connector_harness.Harness` on the
real local store in a test directory (``connector_harness.ControlledLocalStore``: puts can
be held, single values removed or rewritten), and asserts one rule of
docs/CONNECTOR.md: what is dumped, what counts as a hit, what is loaded where, when a
request's blocks may be freed, what a load error reports, what pins hold.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool

from tests.support.connector_harness import (  # store_fixture: the ``store`` fixture
    BS,
    LAYERS,
    NUM_BLOCKS,
    ControlledLocalStore,
    Harness,
    Req,
    blocks,
    new_req,
    store_fixture,  # noqa: F401
)
from tests.support.connector_harness import sched_output as so
from ucm_patch import connector
from ucm_patch.connector import UCMPatchConnector
from ucm_patch.hooks.stores.base import StoreError

TOKENS = list(range(100, 113))  # 13 tokens: 3 full blocks of 4 + 1
WAIT_S = 30.0  # generous: other test processes may load the 2 cores
Store = ControlledLocalStore


def compute_pages(h: Harness, block_ids: list[int], seed: int) -> dict[tuple[int, int], bytes]:
    """Write distinct content into the pages of ``block_ids`` in every layer."""
    return {
        (layer, b): h.fill(layer, b, seed * 1000 + layer * 100 + b)
        for layer in range(len(LAYERS))
        for b in block_ids
    }


def prefill(
    h: Harness,
    rid: str,
    ids: list[int],
    tokens: list[int] = TOKENS,
    seed: int = 1,
    wait: bool = True,
) -> tuple[Req, Any, dict[tuple[int, int], bytes]]:
    """Schedule a new request over all its tokens and run the step; return its pages."""
    req = Req(rid, tokens)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    h.sched.update_state_after_alloc(req, blocks(ids), 0)
    pages: dict[tuple[int, int], bytes] = {}

    def compute(layer: int) -> None:
        for b in ids:
            pages[(layer, b)] = h.fill(layer, b, seed * 1000 + layer * 100 + b)

    md = h.step(so([new_req(rid, [ids], 0)], scheduled={rid: len(tokens)}), compute)
    if wait:
        assert connector.wait_for_dumps(WAIT_S)
    return req, md, pages


def test_full_blocks_are_dumped_once_per_row(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    _req, md, pages = prefill(h, "a", [1, 2, 3, 4])
    assert [bid for _g, (bid,), _h in md.dumps["a"]] == [1, 2, 3]  # block 4 is partial
    assert md.pinned is False  # no block pool bound: pages copied before save returned
    assert len(store) == 3 * len(LAYERS)
    layout = h.worker.layout
    for i, (_g, (bid,), block_hash) in enumerate(md.dumps["a"]):
        for row in range(len(LAYERS)):
            assert store.payload(layout.key(block_hash, 0, row, 0)) == pages[(row, bid)], i
    # the next decode step fills no new block: nothing more is planned
    md2 = h.step(so(cached=[("a", 13, None)], scheduled={"a": 1}))
    assert md2.dumps == {}


def test_hit_loads_layerwise_into_the_new_blocks_and_is_not_dumped_again(
    store: Store,
) -> None:
    h = Harness(UCMPatchConnector)
    _a, _md, pages = prefill(h, "a", [1, 2, 3, 4])
    b = Req("b", [*TOKENS[:12], 7, 8, 9])  # shares 3 blocks, 15 tokens
    assert h.sched.get_num_new_matched_tokens(b, 0) == (12, False)
    h.sched.update_state_after_alloc(b, blocks([9, 10, 11, 12]), 12)
    # layers have been seen waiting (step of "a"), so the load is layerwise
    md = h.step(so([new_req("b", [[9, 10, 11, 12]], 12)], scheduled={"b": 3}))
    assert [e[1] for e in md.loads[0].entries] == [(9,), (10,), (11,)]
    assert md.dumps == {}  # loaded blocks are never dumped again
    for layer in range(len(LAYERS)):
        for src, dst in zip([1, 2, 3], [9, 10, 11], strict=True):
            assert h.page(layer, dst) == pages[(layer, src)]
    stats = connector.stats()
    assert stats["loads_layerwise"] == 1
    assert stats["rows_waited_in_layer"] == len(LAYERS)
    assert stats["hit_tokens"] == 12
    # where the hit's time went: the lookup, every row read and copied, each wait timed
    assert stats["lookup_s"] > 0
    assert stats["load_read_s"] > 0 and stats["load_stall_s"] > 0
    # a KV cache in host memory: the store wrote the pages into their blocks itself (no
    # host buffer, so no copy out of one)
    assert stats["load_copy_s"] == 0
    assert h.worker.get_block_ids_with_load_errors() == set()


def test_first_load_in_a_process_waits_in_start_load_kv(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    prefill(h, "a", [1, 2, 3, 4])
    fresh = Harness(UCMPatchConnector)  # new worker: no layer seen calling its hook yet
    b = Req("b", TOKENS)
    assert fresh.sched.get_num_new_matched_tokens(b, 0) == (12, False)
    fresh.sched.update_state_after_alloc(b, blocks([5, 6, 7, 8]), 12)
    md = fresh.sched.build_connector_meta(
        so([new_req("b", [[5, 6, 7, 8]], 12)], scheduled={"b": 1})
    )
    fresh.worker.bind_connector_metadata(md)
    fresh.worker.start_load_kv(None)
    # everything is loaded before any layer runs
    assert fresh.page(1, 7) == h.page(1, 3)
    assert connector.stats()["loads_sync_fallback"] == 1


def test_hit_leaves_one_token_to_compute(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    prefill(h, "a", [1, 2, 3, 4])
    exact = Req("b", TOKENS[:12])  # exactly 3 full blocks
    assert h.sched.get_num_new_matched_tokens(exact, 0) == (8, False)


def test_partial_block_is_a_miss_and_the_prefix_must_be_contiguous(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    _req, md, _pages = prefill(h, "a", [1, 2, 3, 4])
    layout = h.sched.layout
    hashes = [e[2] for e in md.dumps["a"]]
    store.remove(layout.key(hashes[1], 0, 1, 0))  # block 1, row 1 only
    assert h.sched.get_num_new_matched_tokens(Req("b", TOKENS), 0) == (4, False)
    store.remove(layout.key(hashes[0], 0, 0, 0))
    # block 2 is still complete, but not contiguous with the start
    assert h.sched.get_num_new_matched_tokens(Req("c", TOKENS), 0) == (0, False)
    # a local (block-aligned) hit of 4 tokens: the store continues from block 1 -> miss
    assert h.sched.get_num_new_matched_tokens(Req("d", TOKENS), 4) == (0, False)


def test_lookup_store_error_is_a_miss(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(UCMPatchConnector)
    prefill(h, "a", [1, 2, 3, 4])

    def broken(_keys: object) -> list[bool]:
        raise StoreError("master unreachable")

    monkeypatch.setattr(store, "exists_many", broken)
    assert h.sched.get_num_new_matched_tokens(Req("b", TOKENS), 0) == (0, False)
    assert connector.stats()["lookup_errors"] == 1


def test_missing_value_at_load_time_is_reported_as_load_error(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    _req, md, _pages = prefill(h, "a", [1, 2, 3, 4])
    b = Req("b", TOKENS)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (12, False)
    # evicted between lookup and load
    store.remove(h.sched.layout.key(md.dumps["a"][2][2], 0, 0, 0))
    h.sched.update_state_after_alloc(b, blocks([5, 6, 7, 8]), 12)
    h.step(so([new_req("b", [[5, 6, 7, 8]], 12)], scheduled={"b": 1}))
    # the whole load of "b" is reported: vLLM recomputes from its first loaded block
    assert h.worker.get_block_ids_with_load_errors() == {5, 6, 7}
    assert h.worker.get_block_ids_with_load_errors() == set()  # reported once
    stats = connector.stats()
    assert stats["load_failed_requests"] == 1
    assert stats["load_errors"] == 1


def test_recomputed_blocks_are_dumped_again_after_a_rollback(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    _req, md, _pages = prefill(h, "a", [1, 2, 3, 4])
    store.clear()  # e.g. the corrupt values were removed by the failed load
    b = Req("b", TOKENS)
    h.sched.update_state_after_alloc(b, blocks([5, 6, 7, 8]), 0)
    h.step(so([new_req("b", [[5, 6, 7, 8]], 0)], scheduled={"b": 13}))
    # vLLM rolled b back to token 4 (first invalid block) and recomputes from there
    md = h.step(so(cached=[("b", 4, None)], scheduled={"b": 9}))
    assert [bid for _g, (bid,), _h in md.dumps.get("b", [])] == [6, 7]


def test_spec_decode_draft_positions_never_complete_a_block(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    req = Req("a", list(range(6)))
    h.sched.update_state_after_alloc(req, blocks([1, 2]), 0)
    md = h.step(so([new_req("a", [[1, 2]], 0)], scheduled={"a": 6}))
    assert [bid for _g, (bid,), _h in md.dumps["a"]] == [1]
    # hashes already cover block 1 (e.g. tokens known ahead with async scheduling), but
    # this step computes 1 real token + 2 draft positions: block 1 is not complete
    req.block_hashes = Req("x", list(range(8))).block_hashes
    md = h.step(so(cached=[("a", 6, None)], scheduled={"a": 3}, spec_tokens={"a": [1, 2]}))
    assert md.dumps == {}
    md = h.step(so(cached=[("a", 7, None)], scheduled={"a": 1}))
    assert [bid for _g, (bid,), _h in md.dumps["a"]] == [2]


def test_delayed_free_exactly_for_requests_with_dumps(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    store.hold()  # dumps stay in flight
    a = Req("a", TOKENS)
    short = Req("s", TOKENS[:3])  # no full block: nothing to dump
    h.sched.update_state_after_alloc(a, blocks([1, 2, 3, 4]), 0)
    h.sched.update_state_after_alloc(short, blocks([5]), 0)
    h.step(
        so(
            [new_req("a", [[1, 2, 3, 4]], 0), new_req("s", [[5]], 0)],
            scheduled={"a": 13, "s": 3},
        )
    )
    assert h.sched.request_finished_all_groups(a, ([1, 2, 3, 4],)) == (True, None)
    assert h.sched.request_finished(short, [5]) == (False, None)
    h.step(so(), finished={"a", "s"})
    assert h.sent[-1] == set()  # dumps still running: not reported, blocks stay held
    store.release()
    assert connector.wait_for_dumps(WAIT_S)
    for _ in range(3):
        h.step(so())
    assert h.all_sent() == ["a"]  # exactly once, and never "s"
    assert set(h.sched._sched_side.internal_sizes().values()) == {0}
    sizes = h.worker._worker_side.sched.internal_sizes()
    assert sizes["requests"] == sizes["ready"] == sizes["batches"] == 0


def test_preempted_request_is_neither_delayed_nor_reported(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    store.hold()
    a = Req("a", TOKENS)
    h.sched.update_state_after_alloc(a, blocks([1, 2, 3, 4]), 0)
    h.step(so([new_req("a", [[1, 2, 3, 4]], 0)], scheduled={"a": 13}))
    released = threading.Timer(0.2, store.release)
    released.start()
    t0 = time.monotonic()
    # the next step preempts "a": handle_preemptions waits for its dumps first
    h.step(so(preempted={"a"}))
    assert time.monotonic() - t0 >= 0.15
    assert h.sched.request_finished(a, [1, 2, 3, 4]) == (False, None)
    h.step(so(), finished={"a"})
    h.step(so())
    assert h.all_sent() == []


def test_pins_hold_dumped_blocks_until_every_worker_is_done(store: Store) -> None:
    h = Harness(UCMPatchConnector)
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BS)
    h.sched.bind_gpu_block_pool(pool)
    owned = pool.get_new_blocks(4)  # the request's blocks (ref_cnt 1)
    ids = [blk.block_id for blk in owned]
    store.hold()
    a = Req("a", TOKENS)
    h.sched.update_state_after_alloc(a, blocks(ids), 0)
    md = h.step(so([new_req("a", [ids], 0)], scheduled={"a": 13}))
    assert md.pinned
    assert [blk.ref_cnt for blk in owned] == [2, 2, 2, 1]  # dumped blocks pinned
    assert h.sched.has_pending_push_work()
    pool.free_blocks(owned)  # vLLM frees them (e.g. a GDN state block mid-request)
    assert [blk.ref_cnt for blk in owned] == [1, 1, 1, 0]
    h.step(so())
    assert owned[0].ref_cnt == 1  # dump still running: still pinned
    store.release()
    assert connector.wait_for_dumps(WAIT_S)
    h.step(so())
    assert [blk.ref_cnt for blk in owned] == [0, 0, 0, 0]
    assert not h.sched.has_pending_push_work()
    assert connector.stats()["pinned_blocks"] == connector.stats()["unpinned_blocks"] == 3


def test_unpinned_dump_copies_before_save_returns(store: Store) -> None:
    h = Harness(UCMPatchConnector, {"dump_workers": 1})  # no pool: metadata.pinned False
    store.hold()
    other = list(range(500, 513))
    prefill(h, "z", [20, 21, 22, 23], other, seed=5, wait=False)  # holds the dump thread
    assert store.wait_busy(1)
    a = Req("a", TOKENS)
    h.sched.update_state_after_alloc(a, blocks([1, 2, 3, 4]), 0)
    original: dict[int, bytes] = {}

    def compute(layer: int) -> None:
        original[layer] = h.fill(layer, 1, 7 + layer)

    md = h.step(so([new_req("a", [[1, 2, 3, 4]], 0)], scheduled={"a": 13}), compute)
    assert not md.pinned
    for layer in range(len(LAYERS)):
        h.fill(layer, 1, 99)  # block reused while a's dumps are still queued
    store.release()
    assert connector.wait_for_dumps(WAIT_S)
    block_hash = md.dumps["a"][0][2]
    layout = h.sched.layout
    for layer in range(len(LAYERS)):
        assert store.payload(layout.key(block_hash, 0, layer, 0)) == original[layer]
    assert connector.stats()["dump_pages_eager"] == 2 * 3 * len(LAYERS)


def _async_load(h: Harness, rid: str, ids: list[int]) -> None:
    req = Req(rid, TOKENS)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (12, True)
    h.sched.update_state_after_alloc(req, blocks(ids), 12)
    h.step(so())  # not scheduled: the load runs between steps
    deadline = time.monotonic() + WAIT_S
    while rid not in {r for s in h.recved for r in s} and time.monotonic() < deadline:
        h.step(so())


def test_async_load_reports_finished_and_failed_recving(store: Store) -> None:
    h = Harness(UCMPatchConnector, {"load_mode": "async"})
    _a, md, pages = prefill(h, "a", [1, 2, 3, 4])
    _async_load(h, "b", [5, 6, 7, 8])
    assert {r for s in h.recved for r in s} == {"b"}
    assert not any(h.failed_recv)
    for layer in range(len(LAYERS)):
        for src, dst in zip([1, 2, 3], [5, 6, 7], strict=True):
            assert h.page(layer, dst) == pages[(layer, src)]
    # damaged: a valid frame around a value of the wrong size
    store.replace(h.sched.layout.key(md.dumps["a"][1][2], 0, 1, 0), b"short")
    _async_load(h, "c", [9, 10, 11, 12])
    assert {r for s in h.recved for r in s} == {"b", "c"}
    assert {r for s in h.failed_recv for r in s} == {"c"}  # vLLM recomputes "c"
    assert h.worker.get_block_ids_with_load_errors() == set()  # reported per request


def test_async_load_failure_on_old_api_becomes_block_errors(store: Store) -> None:
    h = Harness(UCMPatchConnector, {"load_mode": "async"})
    _a, md, _pages = prefill(h, "a", [1, 2, 3, 4])
    b = Req("b", TOKENS)
    store.replace(h.sched.layout.key(md.dumps["a"][0][2], 0, 0, 0), b"x")
    assert h.sched.get_num_new_matched_tokens(b, 0) == (12, True)
    h.sched.update_state_after_alloc(b, blocks([5, 6, 7, 8]), 12)
    md_b = h.sched.build_connector_meta(so())
    h.worker.bind_connector_metadata(md_b)
    h.worker.start_load_kv(None)
    h.worker.wait_for_save()
    deadline = time.monotonic() + WAIT_S
    got: tuple[set[str] | None, set[str] | None] = (None, None)
    while not got[1] and time.monotonic() < deadline:
        got = h.worker.get_finished(set())  # vLLM without get_transfer_results
    assert got[1] == {"b"}
    assert h.worker.get_block_ids_with_load_errors() == {5, 6, 7}


def test_kv_roles_limit_the_sides(store: Store) -> None:
    producer = Harness(UCMPatchConnector, kv_role="kv_producer")
    prefill(producer, "a", [1, 2, 3, 4])
    assert len(store) == 3 * len(LAYERS)
    assert producer.sched.get_num_new_matched_tokens(Req("b", TOKENS), 0) == (0, False)
    consumer = Harness(UCMPatchConnector, kv_role="kv_consumer")
    assert consumer.sched.get_num_new_matched_tokens(Req("c", TOKENS), 0) == (12, False)
    c = Req("d", [*TOKENS, 1, 2, 3, 4])
    consumer.sched.update_state_after_alloc(c, blocks([1, 2, 3, 4, 5]), 0)
    md = consumer.step(so([new_req("d", [[1, 2, 3, 4, 5]], 0)], scheduled={"d": 17}))
    assert md.dumps == {}


def test_blocks_served_by_vllms_prefix_cache_are_not_dumped_again(store: Store) -> None:
    """A request whose prefix vLLM's own prefix cache served (a chat's next turn) dumps
    only what the store lacks: the stored part of that prefix is not copied and put a
    second time; a block of it missing from the store, and everything after, still is."""
    h = Harness(UCMPatchConnector)
    prefill(h, "a", [1, 2, 3, 4])  # stores blocks 0-2 of TOKENS (ids 1-3)
    layout = h.worker.layout
    local = 3 * BS  # vLLM's prefix cache serves the first three blocks
    ids = [1, 2, 3, 6, 7, 8]

    def next_turn(rid: str, tail: int) -> list[int]:
        tokens = [*TOKENS[:12], *range(tail, tail + 9)]  # the 3 blocks, 2 new full ones
        req = Req(rid, tokens)
        assert h.sched.get_num_new_matched_tokens(req, local) == (0, False)
        h.sched.update_state_after_alloc(req, blocks(ids), 0)
        md = h.step(so([new_req(rid, [ids], local)], scheduled={rid: len(tokens) - local}))
        assert connector.wait_for_dumps(WAIT_S)
        return [bid for _g, (bid,), _h in md.dumps.get(rid, [])]

    before = connector.stats()["dump_blocks_already_stored"]
    assert next_turn("b", 500) == [6, 7]  # before: [1, 2, 3, 6, 7], the prefix stored again
    assert connector.stats()["dump_blocks_already_stored"] - before == 3
    # One row's value of block 1 lost from the store: blocks 1 on are dumped again.
    store.remove(layout.key(Req("x", TOKENS).block_hashes[1].hex(), 0, 0, 0))
    assert next_turn("c", 600) == [2, 3, 6, 7]


def _damage(store: Store, key: str) -> None:
    """One payload byte of ``key``'s stored value flipped in its segment file (the frame
    and size intact: only the checksum can tell)."""
    where = store.where(key)
    assert where is not None
    tier = store.memory if where.tier == "memory" else store.disk
    assert tier is not None
    with open(os.path.join(tier.path, where.file), "r+b") as f:
        f.seek(where.offset + 321)
        byte = f.read(1)
        f.seek(where.offset + 321)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_a_value_damaged_after_the_lookup_fails_the_load_before_the_step_ends(
    store: Store, mode: str
) -> None:
    """The hit was found (lookup), then one stored value was damaged before the worker
    loaded it: the load of that request fails within the step that loads it (layerwise:
    its blocks are load errors before the next step; async: reported in failed_recving),
    so vLLM recomputes them; nothing damaged is left as if loaded."""
    h = Harness(UCMPatchConnector, {"load_mode": mode})
    _a, md, _pages = prefill(h, "a", [1, 2, 3, 4])
    b = Req("b", TOKENS)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (12, mode == "async")
    _damage(store, h.sched.layout.key(md.dumps["a"][1][2], 0, 1, 0))  # after the lookup
    h.sched.update_state_after_alloc(b, blocks([5, 6, 7, 8]), 12)
    before = connector.stats()["load_errors"]
    if mode == "layerwise":
        h.step(so([new_req("b", [[5, 6, 7, 8]], 12)], scheduled={"b": 1}))
        assert h.worker.get_block_ids_with_load_errors() == {5, 6, 7}
    else:
        h.step(so())
        deadline = time.monotonic() + WAIT_S
        while "b" not in {r for s in h.recved for r in s} and time.monotonic() < deadline:
            h.step(so())
        assert {r for s in h.failed_recv for r in s} == {"b"}
    assert connector.stats()["load_errors"] - before >= 1
    assert store.stats["corrupt"] == 1


def test_a_layerwise_step_is_one_store_call_per_load_thread_with_a_mark_per_row(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache in host memory: the step's values looked up once on the forward's thread,
    its rows sent to the store in one call per load thread (the GIL taken once per step,
    not per row), each row marked done as it is written, the forward waiting for its row's
    mark alone; the pages are the stored ones."""
    calls: list[list[tuple[int, int]]] = []
    looked_up_on: list[str] = []
    real, real_lookup = store.get_many_scattered, store.lookup_for_load

    def counted(keys, targets, marks=(), flags=None, located=None):  # type: ignore[no-untyped-def]
        assert located is None or len(located) == len(keys)  # None: no memory tier here
        calls.append(list(marks))
        return real(keys, targets, marks, flags, located)

    def lookup(keys):  # type: ignore[no-untyped-def]
        looked_up_on.append(threading.current_thread().name)
        return real_lookup(keys)

    h = Harness(UCMPatchConnector, {"load_workers": 1})
    _a, _md, pages = prefill(h, "a", [1, 2, 3, 4])
    monkeypatch.setattr(store, "get_many_scattered", counted)
    monkeypatch.setattr(store, "lookup_for_load", lookup)
    b = Req("b", [*TOKENS[:12], 7, 8, 9])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (12, False)
    h.sched.update_state_after_alloc(b, blocks([9, 10, 11, 12]), 12)
    h.step(so([new_req("b", [[9, 10, 11, 12]], 12)], scheduled={"b": 3}))
    rows = len(h.worker.layout.rows)
    assert len(calls) == 1 and [flag for _end, flag in calls[0]] == list(range(rows))
    assert [end for end, _flag in calls[0]] == [3 * (r + 1) for r in range(rows)]
    for layer in range(len(LAYERS)):
        for src, dst in zip([1, 2, 3], [9, 10, 11], strict=True):
            assert h.page(layer, dst) == pages[(layer, src)]
    assert connector.stats()["rows_waited_in_layer"] == len(LAYERS)
    assert h.worker.get_block_ids_with_load_errors() == set()
    # the index read once per step, on the forward's thread (start_load_kv)
    assert looked_up_on == [threading.current_thread().name]
