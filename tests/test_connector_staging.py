"""Dumps and loads copy through reused host buffers (issue #27, item 3).

A dump used to gather into a new tensor and ``.cpu()`` it per batch, a load to read into
a new host tensor per row: an allocation per batch, and on a GPU a pageable copy. Now the
worker lends each dump and load a buffer of :class:`StagingBuffers` and takes it back once
the store has copied it: after the first step nothing is allocated, however many steps
run; on CPU the gather writes straight into the buffer; on an accelerator the buffers are
pinned and the copies run on the connector's own stream.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.connector_harness import (  # store_fixture: the ``store`` fixture
    ControlledLocalStore,
    Req,
    blocks,
    new_req,
    store_fixture,  # noqa: F401
)
from tests.support.connector_harness import sched_output as so
from tests.test_connector_gpu_layouts import BS, LAYERS, NUM_BLOCKS, SHAPE, TOKENS, GpuHarness
from tests.test_page_views import NHD, fill, vllm_attention_cache
from ucm_patch import connector
from ucm_patch.connector import staging as staging_mod
from ucm_patch.connector.page_views import AttentionShape, attention_view
from ucm_patch.connector.staging import StagingBuffers
from ucm_patch.connector.worker_side import copy_pages

STEPS = 6


@pytest.mark.parametrize("host_plan", [True, False], ids=["host-cache", "device-path"])
def test_steps_reuse_the_staging_buffers_and_give_every_one_back(
    store: ControlledLocalStore, host_plan: bool
) -> None:
    """Six requests dumped in six steps, then loaded by another worker: a handful of
    buffers in all (one per size class and thread), none lent between steps, and every
    page still arrives intact. The loads of a KV cache in host memory take no buffer at
    all (the store writes the blocks); those of a device's cache (taken here by dropping
    the rows' host copy plans) reuse theirs."""
    a = GpuHarness("flash_attn", NHD)
    for layer in LAYERS:
        fill(a.caches[layer], hash(layer) % 1000)
    ws = a.worker._worker_side
    for step in range(STEPS):
        tokens = [t + 7919 * step for t in TOKENS]
        req = Req(f"r{step}", tokens, block_size=BS)
        a.sched.get_num_new_matched_tokens(req, 0)
        ids = [3 + step, 7 + step, 11 + step, 2]
        a.sched.update_state_after_alloc(req, blocks(ids), 0)
        md = a.step(so([new_req(f"r{step}", [ids], 0)], scheduled={f"r{step}": len(tokens)}))
        assert [bid for _g, (bid,), _h in md.dumps[f"r{step}"]] == ids[:3]
        assert connector.wait_for_dumps(30.0)
        assert ws.internal_sizes()["staging_lent"] == 0
    assert len(store) == STEPS * 3 * len(LAYERS)
    dumped = ws.staging.allocated
    assert 1 <= dumped <= 2, dumped  # not one per step and row (that was 12 allocations)

    b = GpuHarness("flashinfer", NHD)
    rb = b.worker._worker_side
    if not host_plan:
        rb.loads.plans = [None] * len(rb.views)
    for step in range(STEPS):
        tokens = [t + 7919 * step for t in TOKENS]
        req = Req(f"b{step}", [*tokens[: 3 * BS], 1, 2, 3], block_size=BS)
        assert b.sched.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
        dst = [20 - step, 5 + step, 9 + step, 1]
        b.sched.update_state_after_alloc(req, blocks(dst), 3 * BS)
        b.step(so([new_req(f"b{step}", [dst], 3 * BS)], scheduled={f"b{step}": 3}))
        for layer in LAYERS:
            for src, d in zip([3 + step, 7 + step, 11 + step], dst, strict=False):
                assert torch.equal(b.block(layer, d), a.block(layer, src)), (step, layer, src)
        assert rb.internal_sizes()["staging_lent"] == 0
    if host_plan:
        assert rb.staging.allocated == 0, rb.staging.allocated
    else:
        assert 1 <= rb.staging.allocated <= 2, rb.staging.allocated
    assert b.worker.get_block_ids_with_load_errors() == set()


def test_cpu_gather_writes_straight_into_the_lent_buffer() -> None:
    """FlashAttention's K-outer cache (pages are strided across the K and V halves): the
    gather fills the buffer it is given, in the stored order, and allocates no result."""
    cache = vllm_attention_cache("flash_attn", NUM_BLOCKS, SHAPE, stride_order=NHD)
    fill(cache, 5)
    view = attention_view(cache, NUM_BLOCKS, SHAPE, LAYERS[0])
    idx = torch.tensor([4, 0, 17], dtype=torch.long)
    pool = StagingBuffers(torch.device("cpu"))
    buf = pool.take(3 * view.page_bytes)
    out = buf[: 3 * view.page_bytes].view(3, view.page_bytes)
    before = out.data_ptr()
    view.gather_into(idx, out)
    assert out.data_ptr() == before
    assert torch.equal(out, view.gather(idx))
    pool.give(buf)
    assert pool.take(view.page_bytes).data_ptr() == buf.data_ptr()  # the same one again
    assert pool.allocated == 1 and not pool.pinned and pool.stream is None


def test_accelerator_buffers_are_pinned_and_copies_wait_on_their_own_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a device (here a stand-in for ``torch.cuda``: no GPU in CI) the buffers are
    requested page-locked, the copies run under the connector's stream once it has waited
    for the caller's current stream (the KV an eager dump reads was written there), and
    the thread then waits for the copy stream only."""
    calls: list[tuple[str, Any]] = []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            calls.append(("stream", device))

        def synchronize(self) -> None:
            calls.append(("synchronize", None))

        def wait_stream(self, other: str) -> None:
            calls.append(("wait", other))

    class StreamContext:
        def __init__(self, stream: Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            calls.append(("enter", self.stream))

        def __exit__(self, *exc: object) -> None:
            calls.append(("exit", self.stream))

    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        calls.append(("pin_memory", pin_memory))
        return real_empty(*args, **kwargs)

    def current_stream(device: torch.device) -> str:
        return f"current stream of {device}"

    fake = SimpleNamespace(Stream=Stream, stream=StreamContext, current_stream=current_stream)
    monkeypatch.setattr(torch, "cuda", fake)
    monkeypatch.setattr(staging_mod.torch, "empty", empty)
    pool = StagingBuffers(torch.device("cuda", 0))
    calls.clear()  # the probe for stream support
    assert pool.pinned and isinstance(pool.stream, Stream)
    pool.give(pool.take(4096))
    with pool.on_stream():
        calls.append(("copy", None))
    assert calls == [
        ("stream", torch.device("cuda", 0)),
        ("pin_memory", True),
        ("wait", "current stream of cuda:0"),  # after what the caller's stream queued
        ("enter", pool.stream),
        ("copy", None),
        ("exit", pool.stream),
        ("synchronize", None),
    ]
    # a dump thread past its layer's KV-ready event: nothing else to wait for (the
    # forward queued on the current stream is the rest of the prefill)
    calls.clear()
    with pool.on_stream(after_current=False):
        calls.append(("copy", None))
    assert calls == [
        ("enter", pool.stream),
        ("copy", None),
        ("exit", pool.stream),
        ("synchronize", None),
    ]
    # every thread its own stream: a thread waits for its own copies, not another's
    mine = pool.stream
    theirs: list[Any] = []
    thread = threading.Thread(target=lambda: theirs.append(pool.stream))
    thread.start()
    thread.join()
    assert pool.stream is mine and isinstance(theirs[0], Stream) and theirs[0] is not mine


def test_a_dump_thread_copies_without_waiting_for_the_forward_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """copy_pages as a dump scheduler payload (a task: its KV-ready event was waited
    for) copies on its stream at once; called by the forward thread (an eager dump, no
    task) it first waits for the current stream, where the layer's KV was written."""
    seen: list[bool] = []

    class Recorder(StagingBuffers):
        @contextlib.contextmanager
        def on_stream(self, after_current: bool = True) -> Iterator[None]:
            seen.append(after_current)
            yield

    cache = torch.arange(4 * 2 * 16 * 2 * 8, dtype=torch.float32).view(4, 2, 16, 2, 8)
    view = attention_view(cache, 4, AttentionShape(16, 2, 8), "layer.0")
    pool = Recorder(torch.device("cpu"))
    idx = torch.tensor([2, 0])
    pages = copy_pages(view, idx, (1, 1), pool, _task=object())
    assert bytes(pages[0]) == view.gather(idx[:1]).numpy().tobytes()
    pages.release()
    copy_pages(view, idx, (2,), pool).release()
    assert seen == [False, True] and pool.lent == 0


def test_reserved_buffers_serve_the_first_loads_without_an_allocation() -> None:
    """Buffers reserved when the caches are registered (a device's: pinned) are what the
    first loads take: no allocation on the first hit of a new process."""
    pool = StagingBuffers(torch.device("cpu"))
    pool.reserve(3 << 20, 2)
    assert pool.allocated == 2
    first, second = pool.take(3 << 20), pool.take((3 << 20) - 5)
    assert pool.allocated == 2 and first.data_ptr() != second.data_ptr()
    pool.give(first)
    pool.give(second)
    pool.reserve(3 << 20, 2)  # already there: nothing more made
    assert pool.allocated == 2


def test_a_row_reserves_for_a_hit_of_the_whole_context(store: ControlledLocalStore) -> None:
    """The reservation covers one row's pages of a hit as long as vLLM's max_model_len:
    whole blocks of the row's group, times its page."""
    h = GpuHarness("flash_attn", NHD)
    ws = h.worker._worker_side
    page = ws.views[0].page_bytes
    assert ws._row_bytes(10 * BS) == 10 * page
    assert ws._row_bytes(10 * BS + 1) == 11 * page
