"""One copy plan, executed from the store straight into KV caches laid out as vLLM's
backends lay them out (the caches of tests/test_page_views.py: FlashAttention's K-outer
``(2, N, B, H, D)``, FlashInfer / Triton's block-major ``(N, 2, B, H, D)``, HND and NHD
stride orders, kernel blocks, hybrid rows made block-major, MLA, mamba states, vLLM
0.32's packed per-layer views).

The oracle is the page view's own ``index_copy_`` (``PageView.scatter``), the path the
loads took before: the plan's executor must leave every byte of the cache exactly as it
does, for pages stored from another layout, with pages vLLM already holds left alone, a
damaged value answered False (and its request's blocks only), and a block id outside the
cache refused before any address is formed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_page_views import (
    IDS,
    LAYOUTS,
    SPEC,
    fill,
    vllm_attention_cache,
    vllm_mamba_states,
    vllm_mla_cache,
)
from ucm_patch.connector.copy_plan import BlockOutOfRange, page_plan, targets
from ucm_patch.connector.meta import NULL_BLOCK
from ucm_patch.connector.page_views import AttentionShape, PageView, attention_view, raw_view
from ucm_patch.hooks.stores import rowcopy
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.scatter import PagePlan, Scatter, scatter_from

N = 7  # blocks per cache


def _store(root: Path, memory: bool = True) -> LocalStore:
    if memory:
        return LocalStore(root / "kv", 64 << 20, memory_bytes=32 << 20, memory_path=root / "shm")
    return LocalStore(root / "kv", 64 << 20, memory_bytes=0)


def _attention(layout: tuple) -> tuple[torch.Tensor, PageView]:
    backend, order, kernel, hybrid = layout
    kv = vllm_attention_cache(backend, N, SPEC, stride_order=order, kernel_block=kernel,
                              hybrid=hybrid)  # fmt: skip
    return kv, attention_view(kv, N, SPEC, "layer.0")


def _values(view: PageView, chunks: list[list[int]], seed: int) -> list[bytes]:
    """One value per chunk: its pages gathered from another cache of the same layout."""
    other = torch.empty_like(view.view)
    g = torch.Generator().manual_seed(seed)
    other.copy_(torch.randint(0, 256, other.shape, generator=g, dtype=torch.uint8))
    out = []
    for chunk in chunks:
        pages = torch.zeros(len(chunk), view.page_bytes, dtype=torch.uint8)
        for j, _b in enumerate(chunk):
            pages[j] = other[(seed + j) % N].reshape(-1)
        out.append(pages.numpy().tobytes())
    return out


def _oracle(view: PageView, chunks: list[list[int]], values: list[bytes]) -> torch.Tensor:
    """The cache's bytes after the old path's index_copy_ of every page (NULL_BLOCK skipped)."""
    before = view.view.clone()
    for chunk, value in zip(chunks, values, strict=True):
        pages = torch.frombuffer(bytearray(value), dtype=torch.uint8).view(len(chunk), -1)
        keep = [j for j, b in enumerate(chunk) if b != NULL_BLOCK]
        idx = torch.tensor([chunk[j] for j in keep], dtype=torch.long)
        view.scatter(idx, pages[keep])
    after = view.view.clone()
    view.view.copy_(before)
    return after


def _load(store: LocalStore, view: PageView, chunks: list[list[int]], values: list[bytes]
          ) -> list[bool]:  # fmt: skip
    keys = [f"v/{i}" for i in range(len(values))]
    assert all(store.put_many(list(zip(keys, values, strict=True))))
    return store.get_many_scattered(keys, targets(view, page_plan(view), chunks))


CHUNKS = [[3, 0], [NULL_BLOCK, 6], [5, 1]]  # a page vLLM holds is not written


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_the_plan_writes_what_index_copy_writes(layout: tuple, tmp_path: Path) -> None:
    kv, view = _attention(layout)
    fill(kv, 11)
    values = _values(view, CHUNKS, 5)
    want = _oracle(view, CHUNKS, values)
    s = _store(tmp_path)
    assert _load(s, view, CHUNKS, values) == [True] * len(CHUNKS)
    assert torch.equal(view.view, want)
    s.close()


def test_runs_merge_while_contiguous_in_the_cache() -> None:
    """K-outer FlashAttention: K and V of a block, two runs (its kernel blocks are
    consecutive); block-major FlashInfer with two kernel blocks: four; the CPU backend's
    HND cache: one run per (K/V, token, head); a hybrid cache made block-major (its
    attention view: K and V of each kernel block apart), four."""
    k_bytes = SPEC.block_size * SPEC.num_kv_heads * SPEC.head_size * 2
    cases = {
        ("flash_attn", (0, 1, 2, 3, 4), None, False): [k_bytes] * 2,
        ("flash_attn", (0, 1, 2, 3, 4), 16, False): [k_bytes] * 2,
        ("flashinfer", (0, 1, 2, 3, 4), 16, False): [k_bytes // 2] * 4,
        ("cpu_attn", (0, 1, 2, 3, 4), None, False): [SPEC.head_size * 2]
        * (2 * SPEC.block_size * SPEC.num_kv_heads),
        ("flash_attn", (0, 1, 2, 3, 4), 16, True): [k_bytes // 2] * 4,
    }
    for layout, lengths in cases.items():
        plan = page_plan(_attention(layout)[1])
        assert [n for _s, _d, n in plan.runs] == lengths, layout
        assert [s for s, _d, _n in plan.runs] == [sum(lengths[:i]) for i in range(len(lengths))]


def test_mla_and_mamba_rows(tmp_path: Path) -> None:
    mla = AttentionShape(block_size=16, num_kv_heads=1, head_size=96, mla=True)
    kv = vllm_mla_cache(N, mla)
    views = [attention_view(kv, N, mla, "mla")]
    page = 2 * SPEC.block_size * SPEC.num_kv_heads * SPEC.head_size * 2
    raw = torch.zeros(N * page, dtype=torch.uint8)
    views.append(raw_view(vllm_mamba_states(raw, N, page, [(3, 16), (4, 8, 8)]), N, page,
                          "gdn", None))  # fmt: skip
    s = _store(tmp_path)
    for i, view in enumerate(views):
        values = _values(view, CHUNKS, 7 + i)
        want = _oracle(view, CHUNKS, values)
        keys = [f"m{i}/{j}" for j in range(len(values))]
        assert all(s.put_many(list(zip(keys, values, strict=True))))
        ok = s.get_many_scattered(keys, targets(view, page_plan(view), CHUNKS))
        assert ok == [True] * 3 and torch.equal(view.view, want), view.layout
    s.close()


@pytest.mark.parametrize("memory", [True, False], ids=["memory-tier", "disk-tier"])
def test_a_damaged_value_fails_alone(tmp_path: Path, memory: bool) -> None:
    """One byte of one stored value changed: that value answers False (counted corrupt,
    dropped), the others are written exactly; the damaged value's pages are the only
    ones that may differ from the oracle, and they are its own blocks."""
    _kv, view = _attention(LAYOUTS[0])
    values = _values(view, CHUNKS, 3)
    want = _oracle(view, CHUNKS, values)
    s = _store(tmp_path, memory)
    keys = [f"v/{i}" for i in range(3)]
    assert all(s.put_many(list(zip(keys, values, strict=True))))
    loc = s.where("v/2")
    assert loc is not None and loc.tier == ("memory" if memory else "disk")
    tier = s.memory if memory else s.disk
    with open(os.path.join(tier.path, loc.file), "r+b") as f:
        f.seek(loc.offset + 100)
        byte = f.read(1)
        f.seek(loc.offset + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    ok = s.get_many_scattered(keys, targets(view, page_plan(view), CHUNKS))
    assert ok == [True, True, False]
    assert s.stats["corrupt"] == 1
    others = [b for b in range(N) if b not in CHUNKS[2]]
    assert torch.equal(view.view[others], want[others])
    assert s.get_many(["v/2"]) == [None]  # dropped
    s.close()


def test_without_the_helper_the_bytes_are_the_same(tmp_path: Path, monkeypatch) -> None:
    _kv, view = _attention(LAYOUTS[5])  # the CPU backend: many small runs
    values = _values(view, CHUNKS, 9)
    want = _oracle(view, CHUNKS, values)
    monkeypatch.setattr(rowcopy, "_helper", None)
    monkeypatch.setattr(rowcopy, "_tried", True)
    s = _store(tmp_path)
    assert _load(s, view, CHUNKS, values) == [True] * 3
    assert torch.equal(view.view, want)
    s.close()


def test_the_helper_does_a_row_in_one_call(tmp_path: Path, monkeypatch) -> None:
    assert rowcopy.available(), "the helper did not build here (cc and xxhash are present)"
    calls: list[int] = []
    real = rowcopy._scatter
    monkeypatch.setattr(rowcopy, "_scatter", lambda h, items, *a: calls.append(len(items))
                        or real(h, items, *a))  # fmt: skip
    _kv, view = _attention(LAYOUTS[1])
    values = _values(view, CHUNKS, 4)
    s = _store(tmp_path)
    assert _load(s, view, CHUNKS, values) == [True] * 3
    assert calls == [3]
    s.close()


def test_a_block_outside_the_cache_is_refused_before_any_copy() -> None:
    _kv, view = _attention(LAYOUTS[0])
    before = view.view.clone()
    plan = page_plan(view)
    for bad in (N, -2, N + 100):
        with pytest.raises(BlockOutOfRange, match=f"block id {bad} outside the {N} blocks"):
            targets(view, plan, [[0, bad]])
    assert torch.equal(view.view, before)


def test_a_plan_that_leaves_its_page_is_refused() -> None:
    with pytest.raises(ValueError, match="outside a page of 64 bytes"):
        PagePlan(64, ((0, 0, 32), (40, 32, 32)))
    with pytest.raises(ValueError, match="cover 48 bytes of a 64-byte page"):
        PagePlan(64, ((0, 0, 32), (32, 32, 16)))


def test_the_fallback_executor_writes_runs() -> None:
    plan = PagePlan(8, ((0, 4, 4), (4, 0, 4)))
    out = bytearray(16)
    base = memoryview(out)
    from ucm_patch.hooks.stores.memcopy import address

    at = address(base)
    assert at is not None
    scatter_from(memoryview(b"abcdefghABCDEFGH"), Scatter(plan, (at + 8, at)))
    assert bytes(out) == b"EFGHABCDefghabcd"
    with pytest.raises(ValueError, match="value has 3 bytes, target 16"):
        scatter_from(memoryview(b"abc"), Scatter(plan, (at + 8, at)))


@pytest.mark.parametrize("memory", [True, False], ids=["memory-tier", "disk-tier"])
def test_marks_are_all_set_and_each_row_is_written(tmp_path: Path, memory: bool) -> None:
    """Rows marked as they are written (``marks``): each row's values are in place, a
    value missing from the store answers False, and every flag is set by the return."""
    import ctypes

    _kv, view = _attention(LAYOUTS[0])
    chunks = [[3, 0], [6], [5, 1], [2]]
    values = _values(view, chunks, 13)
    want = _oracle(view, chunks[:3], values[:3])
    s = _store(tmp_path, memory)
    keys = [f"v/{i}" for i in range(4)]
    assert all(s.put_many(list(zip(keys[:3], values[:3], strict=True))))  # v/3: missing
    flags = (ctypes.c_uint8 * 3)()
    to = targets(view, page_plan(view), chunks)
    ok = s.get_many_scattered(keys, to, [(2, 0), (3, 1), (4, 2)], flags)
    assert ok == [True, True, True, False] and list(flags) == [1, 1, 1]
    written = [b for c in chunks[:3] for b in c]
    assert torch.equal(view.view[written], want[written])
    s.close()
