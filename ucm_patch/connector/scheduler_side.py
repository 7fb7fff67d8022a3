"""Scheduler side of the KV connector: lookups, load and dump plans, delayed free, pins.

Runs in vLLM's engine-core process, on the scheduler thread. Per request it remembers how
far its blocks are already in the store (dumped or loaded), so each block is planned for
a dump once and a loaded block is never dumped again.

**Lookup** (:meth:`SchedulerSide.get_num_new_matched_tokens`): the longest prefix, beyond
vLLM's own (block-aligned) local hit, whose blocks are all in the store, checked with one
``exists_many`` per 32 hit units. A block counts only if every key of every row and TP
rank exists (a partly stored block is a miss) and the prefix is contiguous. For hybrid
models the hit must also end where a GDN/Mamba state was stored: a state exists only at
block boundaries where a scheduler step ended (vLLM's mamba "align" mode). The hit always
leaves at least one prompt token to compute. Store errors count as a miss.

**Loads**: ``layerwise`` (synchronous, row by row during the forward; load errors become
``get_block_ids_with_load_errors`` so vLLM recomputes) when the model has a single attention
KV-cache group; ``async`` (between steps; failures come back as ``failed_recving``, as
invalid blocks on vLLM <= 0.29) otherwise, because vLLM cannot take block-level load errors
with several groups (0.31+ raise; 0.29 and older unpack one group, see the
``hybrid_load_failure`` patch; only 0.30 recomputes the whole request). A request whose
load failed is never offered a hit again: vLLM puts a failed async load back
in the waiting queue and asks for a hit once more, and a store that fails the same way every
time (a broken value that is not removed, a store raising on every read) would otherwise
turn that into lookup, load, fail, forever.

**Dumps** (:meth:`SchedulerSide.build_connector_meta`): every attention chunk
(``KVLayout.chunk_blocks`` blocks, one stored value) whose last block becomes full in this
step (spec-decode draft positions excluded) and has a content hash; for
Mamba/GDN groups the exact boundary-state blocks vLLM offers in
``scheduler_output.kv_connector_block_state`` (vLLM >= 0.29), or, on 0.26 - 0.28, which
offer none, the block a step ending on a boundary wrote, confirmed by its hash
(:meth:`SchedulerSide._boundary_offers`; ``vllm_support`` refuses the releases and
settings where a position cannot find it). Blocks vLLM's own prefix cache served are
skipped as far as the store already holds them.

**Delayed free**: ``request_finished`` / ``request_finished_all_groups`` return
True exactly for requests that had dump entries in some step's metadata and were not
preempted since; every worker opens a dump batch for exactly those ids and reports them in
``finished_sending`` once their dumps are done. The same id set on both sides keeps
``MultiConnector``'s per-child async-save count exact.

**Pins** (vLLM >= 0.22.1, ``bind_gpu_block_pool``): every block a step's dumps read gets
an extra reference until every worker reported that step done (worker metadata). This
covers blocks vLLM frees *while the request runs* — Mamba "align" boundary states and
sliding-window blocks — which delayed free cannot hold. Without a block pool the workers
copy pages before ``save_kv_layer`` returns (``metadata.pinned = False``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from time import monotonic
from typing import Any

from ucm_patch.connector import counters as stats
from ucm_patch.connector.config import ConnectorConfig, ConnectorConfigError
from ucm_patch.connector.layout import KVLayout, hash_hex
from ucm_patch.connector.meta import (
    NULL_BLOCK,
    DumpEntry,
    LoadEntry,
    RequestLoad,
    UCMConnectorMetadata,
    UCMWorkerMetadata,
)
from ucm_patch.hooks.stores.base import KVStore, StoreError

# Under vLLM's logger: its handler, level and format (``INFO mm-dd hh:mm:ss [file:line]``).
logger = logging.getLogger(f"vllm.{__name__}")

LOOKUP_CHUNK_UNITS = 32


class _Req:
    """What the scheduler side remembers about one live request."""

    __slots__ = ("next_block", "request", "state_done")

    def __init__(self, request: Any, layout: KVLayout) -> None:
        self.request = request
        #: attention group -> first block index not yet stored or planned
        self.next_block = {g.index: 0 for g in layout.attention_groups}
        #: mamba group -> boundaries (tokens) up to this one are stored, planned or loaded.
        #: One mark per group: vLLM offers the same boundary once per mamba group (a
        #: checkpoint's GDN layers form several groups), and a lookup needs every group's
        #: state at a boundary, so one shared mark would keep all but the first group's
        #: state from ever being dumped.
        self.state_done = {g.index: 0 for g in layout.mamba_groups}


def choose_load_async(layout: KVLayout, load_mode: str) -> bool:
    """Whether loads run between steps (True) or layerwise in the forward (False)."""
    if load_mode == "async":
        return True
    if load_mode == "layerwise":
        if not layout.layerwise_capable():
            raise ConnectorConfigError(
                "load_mode: 'layerwise' needs a single attention KV-cache group, but this "
                f"model has {len(layout.groups)} group(s) "
                f"({', '.join(g.spec for g in layout.groups)}); vLLM cannot recompute "
                "blocks after a synchronous load error there. Use 'auto' or 'async'."
            )
        return False
    return not layout.layerwise_capable()


class SchedulerSide:
    """The scheduler-side half of :class:`ucm_patch.connector.UCMPatchConnector`."""

    def __init__(
        self,
        layout: KVLayout,
        config: ConnectorConfig,
        store: KVStore,
        *,
        can_load: bool,
        can_dump: bool,
        expected_reports: int = 1,
    ) -> None:
        self.layout = layout
        self.config = config
        self.store = store
        self.can_load = can_load
        self.can_dump = can_dump
        self.load_async = choose_load_async(layout, config.load_mode)
        #: workers that must report a step done before its pins are dropped
        self.expected_reports = max(1, expected_reports)
        self._reqs: dict[str, _Req] = {}
        self._lookups: dict[str, tuple[int, int]] = {}
        self._loads: list[RequestLoad] = []
        self._delayed: set[str] = set()
        self._tables: dict[str, list[list[int]]] = {}
        self._step = 0
        self._pool: Any = None
        self._group_hash: Any = None  # vLLM's make_block_hash_with_group_id, with the pool
        self._pins: dict[int, list[Any]] = {}
        self._reports: dict[int, int] = {}
        #: request -> block ids its load from the store writes (until it finishes)
        self._load_blocks: dict[str, set[int]] = {}
        #: requests whose load failed: never offered a hit again (vLLM recomputes them;
        #: offering the same broken prefix again would loop lookup -> load -> fail forever)
        self._load_failed: set[str] = set()

    # ---------------------------------------------------------------------------------
    # Lookup
    # ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the store can provide, and async-ness."""
        if not self.can_load or request.request_id in self._load_failed:
            return 0, False
        stats.bump("lookups")
        started = monotonic()
        try:
            end = self.longest_hit(request, num_computed_tokens)
        except StoreError as exc:
            stats.bump("lookup_errors")
            logger.warning("ucm connector: lookup of %s failed (miss): %s", request.request_id, exc)
            end = num_computed_tokens
        stats.bump("lookup_s", monotonic() - started)
        hit = max(0, end - num_computed_tokens)
        self._lookups[request.request_id] = (num_computed_tokens, hit)
        return hit, self.load_async and hit > 0

    def longest_hit(self, request: Any, start: int) -> int:
        """End (tokens) of the longest stored prefix continuing ``start`` (module docstring)."""
        layout = self.layout
        unit = layout.unit
        hashes = request.block_hashes
        limit = min(len(hashes) * layout.hash_block_size, request.num_tokens - 1)
        limit -= limit % unit
        best = start
        # from the unit holding ``start`` (vLLM's own hit ends on a block, maybe inside a
        # chunk: that chunk's blocks before ``start`` are read but not written)
        first, last = start // unit, limit // unit
        for chunk in range(first, last, LOOKUP_CHUNK_UNITS):
            units = range(chunk, min(chunk + LOOKUP_CHUNK_UNITS, last))
            keys: list[str] = []
            spans: list[tuple[int, int, int]] = []
            for j in units:
                a0 = len(keys)
                for g in layout.attention_groups:
                    per = unit // (layout.chunk_blocks[g.index] * g.block_size)
                    for c in range(j * per, (j + 1) * per):
                        h = hash_hex(hashes[layout.chunk_hash_index(g, c)])
                        keys.extend(layout.keys_all_ranks(h, g.index))
                a1 = len(keys)
                for g in layout.mamba_groups:
                    i = (j + 1) * unit // g.block_size - 1
                    h = hash_hex(hashes[layout.hash_index(g, i)])
                    keys.extend(layout.keys_all_ranks(h, g.index))
                spans.append((a0, a1, len(keys)))
            present = self.store.exists_many(keys)
            for j, (a0, a1, m1) in zip(units, spans, strict=True):
                if not all(present[a0:a1]):
                    return best
                if all(present[a1:m1]):
                    best = max(best, (j + 1) * unit)
        return best

    # ---------------------------------------------------------------------------------
    # Allocation -> load plan
    # ---------------------------------------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Register the request; plan its load when vLLM accepted external tokens from us."""
        rid = request.request_id
        st = self._reqs.get(rid)
        looked = self._lookups.get(rid)
        if st is None:
            st = self._reqs[rid] = _Req(request, self.layout)
            if looked is not None and looked[0] > 0 and self.can_dump:
                self._skip_stored_prefix(st, looked[0])
        if num_external_tokens <= 0 or not self.can_load:
            return
        if looked is None or num_external_tokens > looked[1]:
            raise RuntimeError(
                f"ucm connector: vLLM allocated {num_external_tokens} external tokens for "
                f"request {rid} but the last lookup offered {looked and looked[1]}"
            )
        start = looked[0]
        end = start + num_external_tokens
        if end % self.layout.unit:
            raise RuntimeError(
                f"ucm connector: external tokens of {rid} end at {end}, not a multiple of "
                f"the hit unit {self.layout.unit}"
            )
        block_ids = blocks.get_block_ids()
        self._load_blocks[rid] = {b for ids in block_ids for b in ids}
        self._loads.append(
            RequestLoad(
                rid,
                self._load_entries(st, block_ids, start, end),
                num_external_tokens,
                self.load_async,
            )
        )
        stats.bump("hit_requests")
        stats.bump("hit_tokens", num_external_tokens)

    def _skip_stored_prefix(self, st: _Req, tokens: int) -> None:
        """vLLM's own prefix cache served this new request's first ``tokens``: start its
        dumps after the longest prefix of those blocks the store already holds.

        Without this, every prefix-cache hit (each turn of a chat) copied and stored the
        whole shared prefix again: the store keeps the first value, but the page copies,
        the puts and ``vllm:ucm_dump_bytes`` all counted it once more. A block the store
        lacks (its dump failed, was skipped or evicted) and everything after it is still
        dumped. A store error here only means nothing is skipped."""
        layout = self.layout
        hashes = st.request.block_hashes
        for g in layout.attention_groups:
            ratio = g.block_size // layout.hash_block_size
            cb = layout.chunk_blocks[g.index]
            n = min(tokens // g.block_size, len(hashes) // ratio) // cb  # whole chunks
            keys: list[str] = []
            owner: list[int] = []
            for c in range(n):
                h = hash_hex(hashes[layout.chunk_hash_index(g, c)])
                found = layout.keys_all_ranks(h, g.index)
                keys.extend(found)
                owner.extend([c] * len(found))
            try:
                present = self.store.exists_many(keys) if keys else []
            except StoreError:
                return
            stored = next((c for c, ok in zip(owner, present, strict=True) if not ok), n) * cb
            if stored:
                st.next_block[g.index] = max(st.next_block[g.index], stored)
                stats.bump("dump_blocks_already_stored", stored)

    def _load_entries(
        self, st: _Req, block_ids: tuple[list[int], ...], start: int, end: int
    ) -> list[LoadEntry]:
        layout = self.layout
        hashes = st.request.block_hashes
        entries: list[LoadEntry] = []
        for g in layout.attention_groups:
            ids = block_ids[g.index]
            cb = layout.chunk_blocks[g.index]
            first = start // g.block_size  # blocks before it are vLLM's own hit: not written
            for c in range(first // cb, end // g.block_size // cb):
                span = range(c * cb, (c + 1) * cb)
                dsts = tuple(ids[i] if i >= first else NULL_BLOCK for i in span)
                if any(d != NULL_BLOCK for d in dsts):
                    h = hash_hex(hashes[layout.chunk_hash_index(g, c)])
                    entries.append((g.index, dsts, h))
            st.next_block[g.index] = max(st.next_block[g.index], end // g.block_size)
        for g in layout.mamba_groups:
            # The state after token `end` lives in block (end - 1) // block_size: vLLM's
            # preprocess copies it from there into the running block before the next
            # forward (async loads finish before the request is scheduled again).
            i = end // g.block_size - 1
            ids = block_ids[g.index]
            dst = ids[i] if i < len(ids) else NULL_BLOCK
            h = hash_hex(hashes[layout.hash_index(g, i)])
            # An entry with no destination is a load failure on the worker (never a
            # silently skipped state).
            entries.append((g.index, (dst,) if dst != NULL_BLOCK else (), h))
            st.state_done[g.index] = max(st.state_done[g.index], end)
        return entries

    # ---------------------------------------------------------------------------------
    # Per-step metadata
    # ---------------------------------------------------------------------------------
    def build_connector_meta(self, so: Any) -> UCMConnectorMetadata:
        """This step's loads, dumps and preemptions (see the module docstring)."""
        self._step += 1
        md = UCMConnectorMetadata(
            step=self._step,
            loads=self._loads,
            preempted_req_ids=set(getattr(so, "preempted_req_ids", None) or ()),
        )
        self._loads = []
        for rid in md.preempted_req_ids:
            # The worker waits for, then forgets, the dumps of preempted requests
            # (handle_preemptions): neither side delays their free any more.
            self._delayed.discard(rid)
        block_state = getattr(so, "kv_connector_block_state", None)
        if block_state is None:
            self._track_tables(so)
        if self.can_dump:
            self._plan_dumps(so, md, block_state)
        if md.dumps:
            stats.bump("dump_steps")
            stats.bump("dump_blocks", md.dump_block_count())
            self._delayed.update(md.dumps)
            if self._pool is not None:
                self._pin(md)
        return md

    def _plan_dumps(self, so: Any, md: UCMConnectorMetadata, block_state: Any) -> None:
        computed: dict[str, int] = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = cached.num_computed_tokens[i]
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        # no offers from vLLM (< 0.29): the states this step writes, found by position
        positional = block_state is None and bool(self.layout.mamba_groups)
        for rid, n in so.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            ids = self._block_ids(rid, block_state)
            if ids is None:
                continue
            start = computed.get(rid, 0)
            self._rewind(st, start)
            end = start + n - len(spec.get(rid, ()))
            entries = self._attention_dumps(st, ids, end)
            if positional:
                entries += self._state_dumps(st, self._boundary_offers(st, ids, end))
            if entries:
                md.dumps[rid] = entries
        if block_state is not None and self.layout.mamba_groups:
            offers = getattr(block_state, "boundary_state_offloads", None) or {}
            for rid, items in offers.items():
                st = self._reqs.get(rid)
                if st is not None:
                    entries = self._state_dumps(st, items)
                    if entries:
                        md.dumps.setdefault(rid, []).extend(entries)

    def _rewind(self, st: _Req, computed: int) -> None:
        """Forget "stored" marks at or beyond ``computed`` (the request recomputes them).

        vLLM rolls ``num_computed_tokens`` back after a load error (recompute policy) or a
        preemption without local cache; those blocks are computed again and must be dumped
        again (a failed load removed the corrupt values). In normal steps this is a no-op.
        """
        layout = self.layout
        for g in layout.attention_groups:
            cb = layout.chunk_blocks[g.index]
            limit = computed // g.block_size // cb * cb  # the chunk holding it is redone
            if st.next_block[g.index] > limit:
                st.next_block[g.index] = limit
        done = st.state_done
        for gid, boundary in done.items():
            if boundary > computed:
                done[gid] = computed

    def _attention_dumps(self, st: _Req, ids: tuple[list[int], ...], end: int) -> list[DumpEntry]:
        layout = self.layout
        hashes = st.request.block_hashes
        out: list[DumpEntry] = []
        for g in layout.attention_groups:
            ratio = g.block_size // layout.hash_block_size
            cb = layout.chunk_blocks[g.index]
            gids = ids[g.index]
            last = min(end // g.block_size, len(hashes) // ratio, len(gids))
            last -= last % cb  # whole chunks only: a partial one waits for its last block
            for c in range(st.next_block[g.index] // cb, last // cb):
                blocks = tuple(gids[c * cb : (c + 1) * cb])
                # a freed block (sliding window) leaves the chunk incomplete: not stored
                if NULL_BLOCK not in blocks:
                    h = hash_hex(hashes[layout.chunk_hash_index(g, c)])
                    out.append((g.index, blocks, h))
            st.next_block[g.index] = max(st.next_block[g.index], last)
        return out

    def _state_dumps(self, st: _Req, items: Iterable[tuple[int, int, int]]) -> list[DumpEntry]:
        layout = self.layout
        hashes = st.request.block_hashes
        done = st.state_done
        out: list[DumpEntry] = []
        for gid, bid, boundary in items:
            if gid not in done or bid == NULL_BLOCK:
                continue  # not a mamba group we transfer, or a skipped state
            # Only unit-aligned states can complete a lookup; sub-block states are skipped.
            if boundary <= done[gid] or boundary % layout.unit:
                continue
            hidx = boundary // layout.hash_block_size - 1
            if hidx >= len(hashes):
                continue
            out.append((gid, (bid,), hash_hex(hashes[hidx])))
            done[gid] = boundary
        return out

    def _boundary_offers(
        self, st: _Req, ids: tuple[list[int], ...], end: int
    ) -> list[tuple[int, int, int]]:
        """The boundary states a step ending at ``end`` writes, as vLLM 0.29 offers them
        (``boundary_state_offloads``: group, block, boundary), for a vLLM without the
        offer (0.26 to 0.28; :func:`~.vllm_support.hybrid_unsupported_reason` refuses
        the rest). In mamba "align" mode a step ending on a block boundary E writes the
        state into the group's block ``E // block_size - 1``, which the scheduler hashed
        in the same pass (``cache_blocks``) and the next step copies into a new running
        block. The block is taken only when its hash is exactly the one vLLM's own prefix
        cache gives that prefix's state, ``make_block_hash_with_group_id(block hash at
        E, group)``: a block reused meanwhile, or a state that is not there, is counted
        (``state_offer_mismatches``) and never dumped. Needs the block pool
        (``bind_gpu_block_pool``); without it, nothing is offered."""
        pool = self._pool
        if pool is None:
            return []
        layout = self.layout
        hashes = st.request.block_hashes
        out: list[tuple[int, int, int]] = []
        for g in layout.mamba_groups:
            size = g.block_size
            if end <= 0 or end % size:
                continue  # a step ending inside a block leaves no state to cache
            i = end // size - 1
            gids = ids[g.index]
            hidx = layout.hash_index(g, i)
            if i >= len(gids) or hidx >= len(hashes) or gids[i] == NULL_BLOCK:
                continue
            if pool.blocks[gids[i]].block_hash != self._group_hash(hashes[hidx], g.index):
                stats.bump("state_offer_mismatches")
                continue
            out.append((g.index, gids[i], end))
        return out

    def _block_ids(self, rid: str, block_state: Any) -> tuple[list[int], ...] | None:
        if block_state is not None:
            get = getattr(block_state, "get_block_ids", None)  # vLLM >= 0.30
            if get is not None:
                return get(rid)
            return block_state.block_ids.get(rid)  # vLLM 0.29: the snapshots as a dict
        table = self._tables.get(rid)
        return tuple(table) if table is not None else None

    def _track_tables(self, so: Any) -> None:
        """Block tables from the scheduler output (vLLM without ``kv_connector_block_state``)."""
        for r in so.scheduled_new_reqs:
            self._tables[r.req_id] = [list(ids) for ids in r.block_ids]
        cached = so.scheduled_cached_reqs
        resumed: set[str] = set(getattr(cached, "resumed_req_ids", None) or ())
        flags = getattr(cached, "resumed_from_preemption", None)
        if flags:
            resumed.update(rid for rid, flag in zip(cached.req_ids, flags, strict=False) if flag)
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if new is None:
                continue
            table = self._tables.get(rid)
            if rid in resumed or table is None:
                self._tables[rid] = [list(ids) for ids in new]
            else:
                for ids, more in zip(table, new, strict=True):
                    ids.extend(more)

    # ---------------------------------------------------------------------------------
    # Pins (vLLM >= 0.22.1)
    # ---------------------------------------------------------------------------------
    def bind_gpu_block_pool(self, pool: Any) -> None:
        """Keep vLLM's block pool: dumped blocks are pinned until the workers are done;
        and vLLM's own key of a cached block, to check a state found by position
        (:meth:`_boundary_offers`)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        self._group_hash = make_block_hash_with_group_id
        self._pool = pool

    def _pin(self, md: UCMConnectorMetadata) -> None:
        pool = self._pool
        blocks = [
            pool.blocks[bid]
            for entries in md.dumps.values()
            for _g, bids, _h in entries
            for bid in bids
        ]
        pool.touch(blocks)
        self._pins[md.step] = blocks
        md.pinned = True
        stats.bump("pinned_blocks", len(blocks))

    def update_connector_output(self, connector_output: Any) -> None:
        """Remember failed loads; unpin the blocks of steps every worker reported done."""
        self._note_failed_loads(connector_output)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, UCMWorkerMetadata):
            return
        for step, count in meta.done_steps.items():
            got = self._reports.get(step, 0) + count
            if got < self.expected_reports:
                self._reports[step] = got
                continue
            self._reports.pop(step, None)
            blocks = self._pins.pop(step, None)
            if blocks:
                self._pool.free_blocks(blocks)
                stats.bump("unpinned_blocks", len(blocks))

    def _note_failed_loads(self, connector_output: Any) -> None:
        """Requests whose load the workers reported failed (``failed_recving``, or invalid
        blocks on vLLM without it) get no hit from this connector again."""
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            failed.update(
                rid for rid, ids in self._load_blocks.items() if not ids.isdisjoint(invalid)
            )
        for rid in failed:
            if rid in self._reqs:
                self._load_failed.add(rid)

    def has_pending_work(self) -> bool:
        """True while pinned blocks wait for the workers (keeps the engine stepping)."""
        return bool(self._pins)

    # ---------------------------------------------------------------------------------
    # Finish
    # ---------------------------------------------------------------------------------
    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free iff the workers will report this request in finished_sending."""
        rid = request.request_id
        delay = rid in self._delayed
        self._delayed.discard(rid)
        self._reqs.pop(rid, None)
        self._lookups.pop(rid, None)
        self._tables.pop(rid, None)
        self._load_blocks.pop(rid, None)
        self._load_failed.discard(rid)
        if delay:
            stats.bump("delayed_frees")
        return delay, None

    def internal_sizes(self) -> dict[str, int]:
        """Sizes of every per-request map (all 0 once every request finished)."""
        return {
            "requests": len(self._reqs),
            "lookups": len(self._lookups),
            "pending_loads": len(self._loads),
            "delayed": len(self._delayed),
            "tables": len(self._tables),
            "pinned_steps": len(self._pins),
            "load_blocks": len(self._load_blocks),
            "load_failed": len(self._load_failed),
        }
