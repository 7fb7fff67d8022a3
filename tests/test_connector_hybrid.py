"""Hybrid (GDN + attention) rules of UCMPatchConnector, both sides in one process.

A GDN/Mamba page is a *state*: the page of group block ``i`` holds the state after token
``(i + 1) * block``, and exists only where vLLM offered it (``kv_connector_block_state``
boundary offers, mamba "align" mode). So a hybrid hit must end where a state is stored,
the state is loaded into the block vLLM reads it from, and the layout's single storage
row (both layers alias) carries both kinds of page.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.support.connector_harness import (  # store_fixture: the ``store`` fixture
    ControlledLocalStore,
    Harness,
    Req,
    blocks,
    new_req,
    store_fixture,  # noqa: F401
    vllm_config,
)
from tests.support.connector_harness import sched_output as so
from tests.test_connector_config import hybrid_config
from ucm_patch import connector
from ucm_patch.connector import UCMPatchConnector

LAYERS = ("model.layers.0.linear_attn", "model.layers.1.self_attn.attn")
GDN, ATTN = 0, 1  # group indices
TOKENS = list(range(300, 317))  # 17 tokens: two units of 8 + 1
WAIT_S = 30.0
Store = ControlledLocalStore


def harness() -> Harness:
    kvcc, _page = hybrid_config()
    return Harness(UCMPatchConnector, config=vllm_config(block_size=8), kvcc=kvcc, layers=LAYERS)


def block_state(
    tables: dict[str, tuple[list[int], ...]], offers: dict[str, list], era: str = "0.30"
) -> SimpleNamespace:
    """``KVConnectorBlockState``: vLLM 0.29 holds the tables as a dict (``block_ids``),
    0.30+ resolves them through ``get_block_ids``."""
    if era == "0.29":
        return SimpleNamespace(block_ids=dict(tables), boundary_state_offloads=offers)
    return SimpleNamespace(
        get_block_ids=lambda rid: tables.get(rid), boundary_state_offloads=offers
    )


def prefill_a(h: Harness, era: str = "0.30") -> tuple[dict[int, bytes], list]:
    """Request "a": state offered at token 16 in GDN block id 3; attention blocks 5, 6, 7."""
    a = Req("a", TOKENS, block_size=8)
    tables = {"a": ([0, 3, 4], [5, 6, 7])}  # GDN block 0 is null: no state at token 8
    h.sched.update_state_after_alloc(a, blocks(*tables["a"]), 0)
    pages: dict[int, bytes] = {}

    def compute(layer: int) -> None:  # one row: each layer writes its own group's blocks
        for bid in [3, 4] if layer == 0 else [5, 6, 7]:
            pages[bid] = h.fill(0, bid, bid)

    md = h.step(
        so(
            [new_req("a", tables["a"], 0)],
            scheduled={"a": 17},
            block_state=block_state(tables, {"a": [(GDN, 3, 16)]}, era),
        ),
        compute,
    )
    assert connector.wait_for_dumps(WAIT_S)
    return pages, md.dumps["a"]


@pytest.mark.parametrize("era", ["0.29", "0.30"])
def test_attention_blocks_and_offered_state_are_dumped(store: Store, era: str) -> None:
    h = harness()
    pages, entries = prefill_a(h, era)
    hashes = Req("a", TOKENS, block_size=8).block_hashes
    assert [(g, bid) for g, (bid,), _h in entries] == [(ATTN, 5), (ATTN, 6), (GDN, 3)]
    assert entries[2][2] == hashes[1].hex()  # the state after token 16 <-> block hash 1
    layout = h.sched.layout
    assert store.payload(layout.key(hashes[1].hex(), GDN, 0, 0)) == pages[3]
    assert store.payload(layout.key(hashes[0].hex(), ATTN, 0, 0)) == pages[5]
    assert len(store) == 3  # one row: one page per entry


def test_hit_must_end_at_a_stored_state(store: Store) -> None:
    h = harness()
    _pages, entries = prefill_a(h)
    assert h.sched.get_num_new_matched_tokens(Req("b", TOKENS, block_size=8), 0) == (16, True)
    state_key = h.sched.layout.key(entries[2][2], GDN, 0, 0)
    state = store.remove(state_key)
    # attention blocks alone are not a hybrid hit: no state at 8 or 16
    assert h.sched.get_num_new_matched_tokens(Req("c", TOKENS, block_size=8), 0) == (0, False)
    store.replace(state_key, state)
    store.remove(h.sched.layout.key(entries[1][2], ATTN, 0, 0))
    assert h.sched.get_num_new_matched_tokens(Req("d", TOKENS, block_size=8), 0) == (0, False)


def test_async_load_puts_state_where_vllm_reads_it_and_never_redumps(store: Store) -> None:
    h = harness()
    pages, _entries = prefill_a(h)
    b = Req("b", TOKENS, block_size=8)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (16, True)
    tables = {"b": ([0, 9, 8], [10, 11, 12])}
    h.sched.update_state_after_alloc(b, blocks(*tables["b"]), 16)
    md = h.step(so())
    # state after token 16 -> GDN block index (16 - 1) // 8 = 1 -> block id 9
    h0, h1 = (x.hex() for x in b.block_hashes)
    assert md.loads[0].entries == [(ATTN, (10,), h0), (ATTN, (11,), h1), (GDN, (9,), h1)]
    deadline = time.monotonic() + WAIT_S
    while "b" not in {r for s in h.recved for r in s} and time.monotonic() < deadline:
        h.step(so())
    assert not any(h.failed_recv)
    assert (h.page(0, 9), h.page(0, 10), h.page(0, 11)) == (pages[3], pages[5], pages[6])
    # vLLM caches the loaded state and offers it again: it is not dumped again
    md = h.step(
        so(
            [new_req("b", tables["b"], 16)],
            scheduled={"b": 1},
            block_state=block_state(tables, {"b": [(GDN, 9, 16)]}),
        )
    )
    assert md.dumps == {}


def test_state_without_destination_fails_the_load(store: Store) -> None:
    h = harness()
    prefill_a(h)
    b = Req("b", TOKENS, block_size=8)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (16, True)
    h.sched.update_state_after_alloc(b, blocks([0, 0, 8], [10, 11, 12]), 16)  # null state
    h.step(so())
    deadline = time.monotonic() + WAIT_S
    while "b" not in {r for s in h.recved for r in s} and time.monotonic() < deadline:
        h.step(so())
    assert {r for s in h.failed_recv for r in s} == {"b"}  # recomputed, never garbage


def test_each_mamba_group_dumps_its_state_at_a_shared_boundary(store: Store) -> None:
    """A 3:1 checkpoint forms several mamba groups; vLLM offers the same boundary once per
    group. Each group's state must be planned (one stored-up-to mark per group), or a
    lookup, which needs every group's state, never hits."""
    from ucm_patch.connector.config import parse_connector_config
    from ucm_patch.connector.layout import ATTENTION, MAMBA, GroupInfo, KVLayout
    from ucm_patch.connector.rows import RowMap
    from ucm_patch.connector.scheduler_side import SchedulerSide

    names = [[f"g{g}.l{i}" for i in range(2)] for g in range(3)] + [["a.l0", "a.l1"]]
    groups = [
        GroupInfo(g, MAMBA if g < 3 else ATTENTION, 8, 64, tuple(names[g]), "Spec")
        for g in range(4)
    ]
    rows = RowMap([[n[i] for n in names] for i in range(2)])
    layout = KVLayout(groups, rows, 8, 1, {"model": "m"}, chunk_tokens=1)
    side = SchedulerSide(layout, parse_connector_config({}), store, can_load=True, can_dump=True)
    req = Req("r", TOKENS, block_size=8)
    tables = {"r": ([0, 3], [0, 4], [0, 5], [6, 7])}
    side.update_state_after_alloc(req, blocks(*tables["r"]), 0)
    offers = {"r": [(0, 3, 16), (1, 4, 16), (2, 5, 16)]}
    md = side.build_connector_meta(
        so(
            [new_req("r", tables["r"], 0)],
            scheduled={"r": 17},
            block_state=block_state(tables, offers),
        )
    )
    states = sorted((g, bid) for g, (bid,), _h in md.dumps["r"] if g < 3)
    assert states == [(0, 3), (1, 4), (2, 5)]
    assert {h for g, _b, h in md.dumps["r"] if g < 3} == {req.block_hashes[1].hex()}


def test_without_state_offers_a_state_is_found_by_position_and_its_hash(store: Store) -> None:
    """vLLM 0.26 - 0.28 offer no states (no ``kv_connector_block_state``): a step ending
    on a block boundary E wrote each mamba group's state into its block E // size - 1,
    which is dumped when that block's hash is the one vLLM's own prefix cache gives the
    prefix's state; a block whose hash is not (reused meanwhile, or no state there) is
    counted and never dumped, and a step ending inside a block offers none."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from ucm_patch.connector.config import parse_connector_config
    from ucm_patch.connector.layout import ATTENTION, MAMBA, GroupInfo, KVLayout
    from ucm_patch.connector.rows import RowMap
    from ucm_patch.connector.scheduler_side import SchedulerSide

    names = [["g.l0", "g.l1"], ["a.l0", "a.l1"]]
    groups = [GroupInfo(0, MAMBA, 8, 64, tuple(names[0]), "Spec"),
              GroupInfo(1, ATTENTION, 8, 64, tuple(names[1]), "Spec")]  # fmt: skip
    layout = KVLayout(groups, RowMap([[n[i] for n in names] for i in range(2)]), 8, 1, {}, 1)
    side = SchedulerSide(layout, parse_connector_config({}), store, can_load=True, can_dump=True)
    pool = BlockPool(32, enable_caching=True, hash_block_size=8)
    side.bind_gpu_block_pool(pool)
    before = connector.stats()["state_offer_mismatches"]

    def step(rid: str, tables: tuple[list[int], ...], n: int) -> list:  # type: ignore[type-arg]
        req = Req(rid, TOKENS, block_size=8)
        side.update_state_after_alloc(req, blocks(*tables), 0)
        md = side.build_connector_meta(so([new_req(rid, tables, 0)], scheduled={rid: n}))
        return md.dumps.get(rid, [])

    def cache(bid: int, block_hash: bytes) -> None:  # as the scheduler's cache_blocks does
        pool.blocks[bid].set_block_hash(make_block_hash_with_group_id(block_hash, 0))

    hashes = Req("x", TOKENS, block_size=8).block_hashes
    cache(3, hashes[1])
    # "a" ends at 16: the state after token 16 is in GDN block index 1, id 3, hash checked
    entries = step("a", ([0, 3], [5, 6]), 16)
    assert sorted((g, bids) for g, bids, _h in entries) == [(0, (3,)), (1, (5,)), (1, (6,))]
    assert [h for g, _b, h in entries if g == 0] == [hashes[1].hex()]
    # "b": its GDN block carries another prefix's hash (reused): counted, not dumped
    cache(4, hashes[0])
    assert [g for g, _b, _h in step("b", ([0, 4], [7, 8]), 16)] == [1, 1]
    assert connector.stats()["state_offer_mismatches"] - before == 1
    # "c" ends inside a block (17 tokens, one step): no state offered for token 17
    cache(9, hashes[1])
    assert [g for g, _b, _h in step("c", ([0, 9, 10], [11, 12, 13]), 17)] == [1, 1]
    assert connector.stats()["state_offer_mismatches"] - before == 1
