"""The whole connector path on KV caches built as vLLM's GPU backends build them.

The H100 run of vLLM 0.22.1 crashed (``vectorized gather kernel index out of bounds``):
before 0.32 ``KVCacheTensor`` has no placements, and the connector took dim 0 of
FlashAttention's ``(2, num_blocks, ...)`` cache as the block dim. Here both connector
sides run on a vLLM-0.22-style ``KVCacheConfig`` (``shared_by``, no placements) with the
caches of tests/test_page_views.py (the steps of 0.22.1's ``_reshape_kv_cache_tensors``):
process A's worker dumps a request's full blocks; a worker with *another* layout loads
them for a request sharing the prefix, and every loaded block equals the dumped one as
K / V by (token, head, dim). Block ids past the cache never reach a gather or a copy.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

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
from tests.test_page_views import HND, NHD, fill, semantic, vllm_attention_cache
from ucm_patch import connector
from ucm_patch.connector import UCMPatchConnector
from ucm_patch.connector.page_views import AttentionShape, UnknownKVLayout

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BS, HEADS, HEAD_SIZE, NUM_BLOCKS = 16, 2, 64, 24
SPEC = FullAttentionSpec(
    block_size=BS, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
)
SHAPE = AttentionShape(BS, HEADS, HEAD_SIZE)
TOKENS = list(range(500, 500 + 3 * BS + 5))  # 3 full blocks and a partial one
# (backend, stride order) of the writer and of the reader
LAYOUTS = [
    (("flash_attn", NHD), ("flash_attn", NHD)),
    (("flash_attn", NHD), ("flashinfer", HND)),
    (("flashinfer", HND), ("cpu_attn", NHD)),
    (("triton_attn", NHD), ("flash_attn", HND)),
]


def kv_cache_config_022() -> SimpleNamespace:
    """vLLM 0.12-0.31's shape: one ``KVCacheTensor(size, shared_by)`` per layer."""
    size = NUM_BLOCKS * SPEC.page_size_bytes
    return SimpleNamespace(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[SimpleNamespace(size=size, shared_by=[layer]) for layer in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), SPEC)],
    )


class GpuHarness(Harness):
    """Harness steps over per-layer caches in a backend's layout (not one flat buffer)."""

    def __init__(
        self, backend: str, order: tuple[int, ...], extra: dict[str, Any] | None = None
    ) -> None:
        self.cfg = vllm_config(extra, block_size=BS)
        self.kvcc = kv_cache_config_022()
        self.layers = LAYERS
        self.backend = backend
        self.sched = UCMPatchConnector(self.cfg, KVConnectorRole.SCHEDULER, self.kvcc)
        self.worker = UCMPatchConnector(self.cfg, KVConnectorRole.WORKER, self.kvcc)
        self.caches = {
            layer: vllm_attention_cache(backend, NUM_BLOCKS, SHAPE, stride_order=order)
            for layer in LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        self.sent, self.recved, self.failed_recv = [], [], []

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        """Block ``block_id`` as [K/V, token, head, dim]."""
        return semantic(self.caches[layer], self.backend, SHAPE, BS)[block_id]


LAYOUT_IDS = [
    f"{w[0]}-{'HND' if w[1] == HND else 'NHD'}-to-{r[0]}-{'HND' if r[1] == HND else 'NHD'}"
    for w, r in LAYOUTS
]


@pytest.mark.parametrize(("writer", "reader"), LAYOUTS, ids=LAYOUT_IDS)
def test_dump_and_load_across_gpu_layouts(store: ControlledLocalStore, writer, reader) -> None:
    a = GpuHarness(*writer)
    for layer in LAYERS:
        fill(a.caches[layer], hash(layer) % 1000)
    req = Req("a", TOKENS, block_size=BS)
    a.sched.get_num_new_matched_tokens(req, 0)
    a.sched.update_state_after_alloc(req, blocks([3, 7, 11, 2]), 0)
    md = a.step(so([new_req("a", [[3, 7, 11, 2]], 0)], scheduled={"a": len(TOKENS)}))
    assert [bid for _g, (bid,), _h in md.dumps["a"]] == [3, 7, 11]
    assert connector.wait_for_dumps(30.0)

    b = GpuHarness(*reader)
    req_b = Req("b", [*TOKENS[: 3 * BS], 1, 2, 3], block_size=BS)
    assert b.sched.get_num_new_matched_tokens(req_b, 0) == (3 * BS, False)
    b.sched.update_state_after_alloc(req_b, blocks([20, 5, 9, 1]), 3 * BS)
    b.step(so([new_req("b", [[20, 5, 9, 1]], 3 * BS)], scheduled={"b": 3}))
    for layer in LAYERS:
        for src, dst in ((3, 20), (7, 5), (11, 9)):
            assert torch.equal(b.block(layer, dst), a.block(layer, src)), (layer, src, dst)
        assert not b.block(layer, 1).any()  # the partial block is not loaded
    assert b.worker.get_block_ids_with_load_errors() == set()


def test_k_outer_cache_is_not_read_as_block_major(store: ControlledLocalStore) -> None:
    """The pre-fix view took dim 0 (size 2) as the block dim: with block ids >= 2 that is
    the out-of-range gather that killed the engine on CUDA. Now the view has the config's
    block count, and the ids are checked before any gather."""
    h = GpuHarness("flash_attn", NHD)
    views = h.worker._worker_side.views
    assert [v.num_blocks for v in views] == [NUM_BLOCKS] * len(LAYERS)
    assert views[0].out_of_range([0, 2, NUM_BLOCKS - 1, NUM_BLOCKS]) == [NUM_BLOCKS]


def test_out_of_range_dump_is_skipped_and_counted(store: ControlledLocalStore) -> None:
    h = GpuHarness("flash_attn", NHD)
    req = Req("a", TOKENS, block_size=BS)
    h.sched.get_num_new_matched_tokens(req, 0)
    h.sched.update_state_after_alloc(req, blocks([3, NUM_BLOCKS + 5, 11, 2]), 0)
    before = connector.stats()["dump_pages_out_of_range"]
    h.step(so([new_req("a", [[3, NUM_BLOCKS + 5, 11, 2]], 0)], scheduled={"a": len(TOKENS)}))
    assert connector.wait_for_dumps(30.0)
    assert connector.stats()["dump_pages_out_of_range"] - before == len(LAYERS)
    assert len(store) == 2 * len(LAYERS)  # blocks 3 and 11, every row


def test_cache_with_another_block_count_is_refused_at_register() -> None:
    cfg = vllm_config(block_size=BS)
    worker = UCMPatchConnector(cfg, KVConnectorRole.WORKER, kv_cache_config_022())
    caches = {layer: vllm_attention_cache("flash_attn", NUM_BLOCKS + 1, SHAPE) for layer in LAYERS}
    with pytest.raises(UnknownKVLayout, match=rf"{NUM_BLOCKS} blocks.*shape=\(2, 25, 16, 2, 64\)"):
        worker.register_kv_caches(caches)
