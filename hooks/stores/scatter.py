"""Where a value's pages go when a store reads it straight into another memory (a KV cache).

A value the connector stores is a chunk of pages, each page the bytes one row of layers
holds for one block, back to back. In the KV cache those bytes are not always one span:
FlashAttention keeps a block's K and V apart (two runs per page), the CPU backend's HND
order interleaves heads (a run per token and head), a hybrid row's page is one span. So a
read into the cache is a **plan**: what every page's runs are (the same for every page of
a row), and where each page of each value starts in the cache.

* :class:`PagePlan`: the runs of one page, ``(offset in the page, offset from the page's
  start in the cache, length)``. Built by the connector from the cache tensor's shape and
  strides (``ucm_patch.connector.copy_plan``), checked here to stay inside the page.
* :class:`Scatter`: one value's destination, the plan and the start address of each of
  its pages in the cache (0: a page not written, because the cache already holds it).

The store executes it: the local store from its mapped segment, checksum fused, in one
native call per row (:mod:`.rowcopy`); any other store through a buffer
(:func:`scatter_from`). The caller has checked every page address against the cache
(block ids against its blocks, on the host): nothing here could tell a wrong one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ucm_patch.hooks.stores.memcopy import address, move


@dataclass(frozen=True)
class PagePlan:
    """The runs of one page: ``(offset in the page, offset in the cache from the page's
    start, length)``, covering the page once."""

    page_bytes: int
    runs: tuple[tuple[int, int, int], ...]

    def __post_init__(self) -> None:
        covered = 0
        for src, dst, n in self.runs:
            if n <= 0 or src < 0 or dst < 0 or src + n > self.page_bytes:
                raise ValueError(
                    f"PagePlan: run (src={src}, dst={dst}, len={n}) outside a page of "
                    f"{self.page_bytes} bytes"
                )
            covered += n
        if covered != self.page_bytes:
            raise ValueError(
                f"PagePlan: runs cover {covered} bytes of a {self.page_bytes}-byte page"
            )

    @property
    def span(self) -> int:
        """Bytes from a page's start in the cache to the end of its last run."""
        return max(dst + n for _src, dst, n in self.runs)


@dataclass(frozen=True)
class Scatter:
    """One value's destination: its pages (``len(pages) * plan.page_bytes`` bytes, the
    value's size) go to the cache addresses ``pages`` (0: that page is not written)."""

    plan: PagePlan
    pages: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.plan.page_bytes


def check_targets(keys: Sequence[str], targets: Sequence[Scatter]) -> None:
    """ValueError naming both counts when ``keys`` and ``targets`` differ in length."""
    if len(keys) != len(targets):
        raise ValueError(f"get_many_scattered: {len(keys)} keys for {len(targets)} targets")


def set_marks(marks: Sequence[tuple[int, int]], flags: Any) -> None:
    """Set every mark's flag (a call's way out: whatever it did, no reader waits on)."""
    for _end, flag in marks:
        flags[flag] = 1


def scatter_from(value: memoryview, target: Scatter) -> None:
    """Copy ``value`` (``target.nbytes`` bytes) to where ``target`` says, run by run: the
    executor of any store without one of its own (the local store has a native one)."""
    page = target.plan.page_bytes
    if len(value) != target.nbytes:
        raise ValueError(f"scatter_from: value has {len(value)} bytes, target {target.nbytes}")
    if not len(value):
        return
    base = address(value)
    if base is None:  # read-only or not contiguous: from a copy
        value = memoryview(bytearray(value))
        base = address(value)
        assert base is not None
    for j, start in enumerate(target.pages):
        if not start:
            continue
        for src, dst, n in target.plan.runs:
            move(start + dst, base + j * page + src, n)


__all__ = ["PagePlan", "Scatter", "check_targets", "scatter_from", "set_marks"]
