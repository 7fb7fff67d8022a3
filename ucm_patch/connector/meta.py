"""What the scheduler side tells the workers each step, and what the workers report back.

Plain data, built once per step by :class:`ucm_patch.connector.scheduler_side.SchedulerSide`
and pickled to every worker (vLLM sends ``SchedulerOutput`` to worker processes). Entries
are tuples, not objects, to keep that pickle small.

* dump entry ``(group, block_ids, block_hash_hex)``: after this step's forward, store the
  pages of ``block_ids`` (one chunk: ``KVLayout.chunk_blocks`` consecutive blocks of an
  attention group, one block of a Mamba/GDN group), back to back, as one value under the
  hash of its last block, in every row of the group.
* load entry ``(group, dst_block_ids, block_hash_hex)``: the value stored under that hash
  holds ``len(dst_block_ids)`` pages; page ``j`` goes into block ``dst_block_ids[j]``,
  none where that is the null block 0 (a block vLLM's own prefix cache already holds).
  An entry with no destination at all is a load failure (a GDN state vLLM gave no block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:  # vLLM >= 0.17.1
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: no worker -> scheduler channel
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]

NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as the null block
DumpEntry = tuple[int, tuple[int, ...], str]
LoadEntry = tuple[int, tuple[int, ...], str]


@dataclass
class RequestLoad:
    """One request's load: which stored blocks go into which of its blocks."""

    req_id: str
    entries: list[LoadEntry]
    num_tokens: int
    """Tokens this load restores (for stats and logs)."""
    is_async: bool
    """True: load between steps, report in ``finished_recving``; False: during the forward."""


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's plan for the workers."""

    step: int
    dumps: dict[str, list[DumpEntry]] = field(default_factory=dict)
    """request id -> pages to store after this step's forward."""
    loads: list[RequestLoad] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    pinned: bool = False
    """True: the scheduler holds an extra reference on every dumped block until the
    workers report this step done (``bind_gpu_block_pool``), so dumps may read the blocks
    asynchronously. False: workers copy the pages before ``save_kv_layer`` returns."""

    def dump_block_count(self) -> int:
        return sum(len(ids) for entries in self.dumps.values() for _g, ids, _h in entries)


@dataclass
class UCMWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Steps whose dumps finished on the reporting workers: ``{step: workers}``.

    vLLM aggregates one object per worker per engine step with :meth:`aggregate`; the
    scheduler side unpins a step's blocks once every worker reported it.
    """

    done_steps: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, UCMWorkerMetadata):
            raise TypeError(f"UCMWorkerMetadata.aggregate: cannot merge {type(other).__name__}")
        merged = dict(self.done_steps)
        for step, count in other.done_steps.items():
            merged[step] = merged.get(step, 0) + count
        return UCMWorkerMetadata(merged)
