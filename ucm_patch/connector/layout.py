"""What both connector sides derive, identically, from vLLM's configs: groups, rows, keys.

The scheduler side asks the store whether a prefix exists; the worker side writes and reads
it. Both must compute the *same* keys without talking to each other, so everything a key
depends on is derived here from ``vllm_config`` and ``kv_cache_config``, which both sides
get from vLLM.

Storage layout (docs/CONNECTOR.md "Keys and rows"):

* **KV-cache groups.** vLLM gives each group its own block table. Attention groups
  (full attention, MLA, sliding window) store one page per block. Mamba/GDN groups hold a
  recurrent *state*: the page of block ``i`` is the state after token ``(i + 1) * block``,
  which exists only where a scheduler step ended on that boundary (vLLM's "align" mode).
* **Storage rows** (:mod:`ucm_patch.connector.rows`): layers whose pages alias the same bytes.
  One row holds at most one layer per group, so "row ``r``, block id ``b``" names exactly
  one layer's page; a dump reads it once, at the row's last layer.
* **Chunks** (attention groups): a stored value is ``chunk_blocks`` consecutive blocks of
  one row, their pages back to back (``chunk_tokens`` of the connector config, by default
  :data:`~ucm_patch.connector.config.CHUNK_TOKENS` like LMCache's chunks, rounded down
  to whole blocks, at least one). A GPU page is 64 KiB (Qwen3-8B, 16-token blocks):
  stored one per value, every page would pay the store's per-value cost (an index
  entry, a frame); 16 of them make a 1 MiB value (docs/CONNECTOR.md "Chunks"). A
  Mamba/GDN state is one block per value.
* **Keys**: ``ucm3/<fingerprint>/<block hash>/g<group>r<row>t<tp rank>``. The block hash is
  vLLM's content hash of the whole prefix up to the chunk's last block
  (``request.block_hashes``), so a key names content, not a request. The fingerprint
  covers what makes bytes incompatible (the weights and every setting that changes KV
  bytes, :mod:`ucm_patch.connector.identity`; groups, page sizes, rows, chunks): two
  models, or one model before and after its weights were rewritten, never share keys, and
  a changed layout is a miss, never a wrong read.

A chunk is a hit only when every key of every row (and every TP rank) exists; a partially
stored chunk is simply a miss, so no commit record is needed.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ucm_patch.connector.identity import model_identity
from ucm_patch.connector.rows import RowMap

# ucm3: an attention value is a chunk of pages; ucm2 stored one page per value, each K|V in
# (token, head, dim) order (connector/page_views.py), as ucm3 pages are; ucm1 stored the
# raw bytes of the registered view. An older value is a miss, never misread.
KEY_VERSION = "ucm3"
ATTENTION = "attention"
MAMBA = "mamba"


@dataclass(frozen=True)
class GroupInfo:
    """One KV-cache group as the connector sees it."""

    index: int
    """Position in ``kv_cache_config.kv_cache_groups`` (the index vLLM's block tables use)."""
    kind: str
    """:data:`ATTENTION` (one page per block) or :data:`MAMBA` (state at block ends)."""
    block_size: int
    page_bytes: int
    layers: tuple[str, ...]
    spec: str
    """The spec's class name, for logs and the fingerprint."""


def attention_chunk_blocks(block_size: int, chunk_tokens: int) -> int:
    """Blocks of one stored attention value: ``chunk_tokens`` in whole blocks, at least one."""
    return max(1, chunk_tokens // block_size)


def _is_mamba(spec: Any) -> bool:
    return any(cls.__name__ == "MambaSpec" for cls in type(spec).__mro__)


class LayoutError(ValueError):
    """The vLLM configuration is one the connector cannot serve (message says why)."""


class KVLayout:
    """Groups, rows, sizes and the key scheme of one vLLM instance (module docstring)."""

    def __init__(
        self,
        groups: Sequence[GroupInfo],
        rows: RowMap,
        hash_block_size: int,
        tp_size: int,
        identity: dict[str, Any],
        chunk_tokens: int,
    ) -> None:
        # chunk_tokens: checked with the other connector keys (connector.config)
        if not groups:
            raise LayoutError("KVLayout: the model has no KV-cache group to transfer")
        if hash_block_size <= 0:
            raise LayoutError(f"KVLayout: hash_block_size must be > 0, got {hash_block_size}")
        for g in groups:
            if g.block_size % hash_block_size:
                raise LayoutError(
                    f"KVLayout: group {g.index} block_size {g.block_size} is not a multiple "
                    f"of the block-hash size {hash_block_size}"
                )
        self.groups = tuple(groups)
        self.rows = rows
        self.hash_block_size = hash_block_size
        self.tp_size = tp_size
        #: group index -> blocks per stored value: attention groups ``chunk_tokens`` of
        #: whole blocks (at least one), Mamba/GDN groups one state.
        self.chunk_blocks: dict[int, int] = {
            g.index: (
                attention_chunk_blocks(g.block_size, chunk_tokens) if g.kind == ATTENTION else 1
            )
            for g in groups
        }
        #: Hits are whole multiples of this many tokens (LCM of the groups' value spans).
        self.unit = math.lcm(*(self.chunk_blocks[g.index] * g.block_size for g in groups))
        self.attention_groups = tuple(g for g in groups if g.kind == ATTENTION)
        self.mamba_groups = tuple(g for g in groups if g.kind == MAMBA)
        self.group_by_index = {g.index: g for g in groups}
        layer_group = {layer: g.index for g in groups for layer in g.layers}
        #: group index -> rows holding one of its layers (in row order).
        self.rows_of_group: dict[int, tuple[int, ...]] = {
            g.index: tuple(
                sorted({rows.row_of[layer] for layer in g.layers if layer in rows.row_of})
            )
            for g in groups
        }
        #: row -> group indices with a layer in that row.
        self.groups_of_row: tuple[tuple[int, ...], ...] = tuple(
            tuple(sorted({layer_group[layer] for layer in row.layers if layer in layer_group}))
            for row in rows.rows
        )
        #: row -> bytes of one page (the largest page of the row's groups).
        self.row_page_bytes: tuple[int, ...] = tuple(
            max(self.group_by_index[gi].page_bytes for gi in gis) if gis else 0
            for gis in self.groups_of_row
        )
        #: Bytes of the largest value the connector stores: a chunk of a row's pages, or a
        #: state (a row's page bounds its view's). The store is sized for it at start.
        self.max_value_bytes: int = max(
            (
                self.chunk_blocks[gi] * self.row_page_bytes[r]
                for gi, rows_of in self.rows_of_group.items()
                for r in rows_of
            ),
            default=0,
        )
        ident = dict(identity)
        ident["groups"] = [
            [g.index, g.kind, g.spec, g.block_size, g.page_bytes, list(g.layers)] for g in groups
        ]
        ident["rows"] = [list(r.layers) for r in rows.rows]
        ident["tp"] = tp_size
        ident["hash_block_size"] = hash_block_size
        ident["chunk_blocks"] = [self.chunk_blocks[g.index] for g in groups]
        blob = json.dumps(ident, sort_keys=True, default=str).encode()
        self.identity = ident
        #: Short hash of everything that makes stored bytes incompatible.
        self.fingerprint = hashlib.blake2b(blob, digest_size=8).hexdigest()
        self._prefix = f"{KEY_VERSION}/{self.fingerprint}/"

    # -- keys -----------------------------------------------------------------------------
    def key(self, block_hash: str, group: int, row: int, rank: int) -> str:
        """Store key of one page: one block (by content hash) of one group, row and rank."""
        return f"{self._prefix}{block_hash}/g{group}r{row}t{rank}"

    def keys_for_rank(self, block_hash: str, group: int, rank: int) -> list[str]:
        """Keys of every row of ``group`` for one TP rank (what one worker writes)."""
        return [self.key(block_hash, group, r, rank) for r in self.rows_of_group[group]]

    def keys_all_ranks(self, block_hash: str, group: int) -> list[str]:
        """Keys of every row and TP rank of ``group`` (what a lookup must find)."""
        return [
            self.key(block_hash, group, r, t)
            for t in range(self.tp_size)
            for r in self.rows_of_group[group]
        ]

    def hash_index(self, group: GroupInfo, block_index: int) -> int:
        """Index into ``request.block_hashes`` naming the prefix up to group block ``i``."""
        return (block_index + 1) * (group.block_size // self.hash_block_size) - 1

    def chunk_hash_index(self, group: GroupInfo, chunk: int) -> int:
        """Index into ``request.block_hashes`` naming chunk ``chunk`` of ``group`` (the
        prefix up to its last block)."""
        return self.hash_index(group, (chunk + 1) * self.chunk_blocks[group.index] - 1)

    def layerwise_capable(self) -> bool:
        """True when load errors can be reported per block (one attention group).

        vLLM 0.32's scheduler raises for block-level load errors (``invalid_block_ids``)
        with more than one KV-cache group, so synchronous layerwise loads are offered only
        for single-group attention layouts.
        """
        return len(self.groups) == 1 and not self.mamba_groups

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_vllm(
        cls,
        vllm_config: Any,
        kv_cache_config: Any,
        namespace: str | None,
        chunk_tokens: int,
    ) -> KVLayout:
        """Derive the layout from vLLM's configs (both connector sides call this)."""
        if kv_cache_config is None:
            raise LayoutError(
                "UCMPatchConnector needs vLLM's kv_cache_config (vLLM >= 0.12): the storage "
                "rows and KV-cache groups come from it"
            )
        parallel = vllm_config.parallel_config
        if getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise LayoutError(
                "UCMPatchConnector does not support pipeline parallelism yet "
                f"(pipeline_parallel_size={parallel.pipeline_parallel_size}): the scheduler "
                "would look up keys of layers it does not know"
            )
        groups: list[GroupInfo] = []
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            if not getattr(group, "enable_kv_transfer", True):
                continue
            spec = group.kv_cache_spec
            groups.append(
                GroupInfo(
                    index=index,
                    kind=MAMBA if _is_mamba(spec) else ATTENTION,
                    block_size=int(spec.block_size),
                    page_bytes=int(spec.page_size_bytes),
                    layers=tuple(group.layer_names),
                    spec=type(spec).__name__,
                )
            )
        rows = RowMap.from_kv_cache_config(kv_cache_config)
        hash_bs = (
            getattr(kv_cache_config, "hash_block_size", None)
            or getattr(vllm_config.cache_config, "hash_block_size", None)
            or vllm_config.cache_config.block_size
        )
        identity = model_identity(vllm_config, namespace)
        tp = int(parallel.tensor_parallel_size)
        return cls(groups, rows, int(hash_bs), tp, identity, chunk_tokens)


def hash_hex(block_hash: Any) -> str:
    """Hex text of one entry of ``request.block_hashes`` (bytes in vLLM >= 0.10)."""
    if isinstance(block_hash, bytes | bytearray):
        return bytes(block_hash).hex()
    value = getattr(block_hash, "hash_value", None)  # vLLM <= 0.9 BlockHash NamedTuple
    if value is not None:
        block_hash = value
    if isinstance(block_hash, int):
        return format(block_hash & ((1 << 256) - 1), "x")
    raise TypeError(f"unsupported block hash type {type(block_hash).__name__}")
