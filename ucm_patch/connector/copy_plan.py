"""A row's copy plan: where each stored page's bytes are in vLLM's KV cache.

A stored page is a row's bytes for one block in one order (``page_views``: K|V, each in
(token, head, dim) order, or the raw page). In the cache those bytes are runs: one for a
raw or block-major page, one per K and V per kernel block for FlashAttention's K-outer
layout, one per token and head for an HND cache. The runs are the same for every block,
so a plan is computed once per row, when the caches are registered:

* :func:`page_plan`: the runs of one page, from the page view's own shape and strides
  (each run: offset in the stored page, offset from the block's start in the cache,
  length), the innermost dimensions merged while they are contiguous in the cache;
* :func:`targets`: per value (a chunk of pages), the start of each of its pages' blocks
  in the cache, 0 for a page the cache already holds (vLLM's own hit).

Executors run the plan: the local store's native one on a CPU cache
(:meth:`~ucm_patch.hooks.stores.base.KVStore.get_many_scattered`: from the segment
straight into the blocks, checksum fused), one copy per run on a device. Both take the
addresses as they are: block ids are checked against the view's blocks here, on the host,
before any address is formed (an out-of-range copy on CUDA kills the process).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product

from ucm_patch.connector.meta import NULL_BLOCK
from ucm_patch.connector.page_views import PageView
from ucm_patch.hooks.stores.scatter import PagePlan, Scatter


class BlockOutOfRange(ValueError):
    """A block id that is not a block of the row's view (checked before any copy)."""


def page_plan(view: PageView) -> PagePlan:
    """The runs of one page of ``view`` (dims after the block dim, in stored order)."""
    sizes = list(view.view.shape[1:])
    strides = list(view.view.stride()[1:])
    # merge from the innermost: a dim whose stride is the whole of the dims inside it
    run = 1
    while sizes and strides[-1] == run:
        run *= sizes.pop()
        strides.pop()
    runs: list[tuple[int, int, int]] = []
    at = 0
    for idx in product(*(range(n) for n in sizes)):
        runs.append((at, sum(i * s for i, s in zip(idx, strides, strict=True)), run))
        at += run
    return PagePlan(view.page_bytes, tuple(runs))


def block_starts(view: PageView) -> tuple[int, int]:
    """(address of block 0's page in the cache, bytes between two blocks' pages)."""
    return view.view.data_ptr(), view.view.stride(0)


def targets(view: PageView, plan: PagePlan, dsts: Sequence[Sequence[int]]) -> list[Scatter]:
    """Per value, its pages' starts in the cache: ``dsts[i]`` are value ``i``'s block ids
    in page order (``NULL_BLOCK``: a page not written). BlockOutOfRange names the first
    id that is not a block of the view."""
    base, stride = block_starts(view)
    n = view.num_blocks
    out: list[Scatter] = []
    for blocks in dsts:
        pages = []
        for b in blocks:
            if b == NULL_BLOCK:
                pages.append(0)
                continue
            if not 0 <= b < n:
                raise BlockOutOfRange(f"block id {b} outside the {n} blocks of the view")
            pages.append(base + b * stride)
        out.append(Scatter(plan, tuple(pages)))
    return out


__all__ = ["BlockOutOfRange", "block_starts", "page_plan", "targets"]
