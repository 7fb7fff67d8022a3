"""A stored attention value is a chunk of consecutive pages of one row (``chunk_tokens``).

GPU pages are small (64 KiB for Qwen3-8B's 16-token blocks) and the store pays a fixed
cost per value (an index entry, a frame), so the connector stores ``chunk_tokens`` of
whole blocks as one value (docs/CONNECTOR.md "Chunks"). Here, on the real local store
and vLLM's own config classes, with chunks of two blocks:

* only whole chunks are dumped, as the pages back to back, under the last block's hash;
* a hit is whole chunks, each page loaded into its own block, and a block vLLM's own
  prefix cache already holds is not written;
* an out-of-range block drops its whole chunk before any copy;
* the same on per-layer caches in the GPU backends' layouts;
* the chunk is derived from vLLM's config: 1 MiB values for Qwen3-8B's GPU pages, one
  block where blocks are larger than the chunk (CPU hybrid models), and a changed chunk
  is a changed fingerprint (old values are misses, never misread).
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from tests.support.connector_harness import (  # store_fixture: the ``store`` fixture
    BS,
    LAYERS,
    NUM_BLOCKS,
    ControlledLocalStore,
    Harness,
    Req,
    blocks,
    kv_cache_config,
    new_req,
    store_fixture,  # noqa: F401
    vllm_config,
)
from tests.support.connector_harness import sched_output as so
from tests.test_connector_gpu_layouts import BS as GPU_BS
from tests.test_connector_gpu_layouts import NHD, GpuHarness
from tests.test_page_views import HND, fill
from ucm_patch import connector
from ucm_patch.connector import UCMPatchConnector
from ucm_patch.connector.config import CHUNK_TOKENS, ConnectorConfigError, parse_connector_config
from ucm_patch.connector.layout import KVLayout

CHUNK = {"chunk_tokens": 2 * BS}  # two blocks per value
TOKENS = list(range(300, 317))  # 17 tokens: 4 full blocks of 4 + 1
WAIT_S = 30.0
Store = ControlledLocalStore


def run_prefill(h: Harness, rid: str, ids: list[int], tokens: list[int]) -> tuple[dict, object]:
    req = Req(rid, tokens)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    h.sched.update_state_after_alloc(req, blocks(ids), 0)
    pages: dict[tuple[int, int], bytes] = {}

    def compute(layer: int) -> None:
        for b in ids:
            pages[(layer, b)] = h.fill(layer, b, 1000 * layer + b)

    md = h.step(so([new_req(rid, [ids], 0)], scheduled={rid: len(tokens)}), compute)
    assert connector.wait_for_dumps(WAIT_S)
    return pages, md


def test_whole_chunks_are_stored_as_their_pages_back_to_back(store: Store) -> None:
    h = Harness(UCMPatchConnector, CHUNK)
    assert h.sched.layout.chunk_blocks == {0: 2} and h.sched.layout.unit == 2 * BS
    pages, md = run_prefill(h, "a", [1, 2, 3, 4, 5], TOKENS)
    hashes = Req("a", TOKENS).block_hashes
    assert md.dumps["a"] == [(0, (1, 2), hashes[1].hex()), (0, (3, 4), hashes[3].hex())]
    assert len(store) == 2 * len(LAYERS)
    layout = h.sched.layout
    for _g, ids, block_hash in md.dumps["a"]:
        for row in range(len(LAYERS)):
            value = store.payload(layout.key(block_hash, 0, row, 0))
            assert value == b"".join(pages[(row, b)] for b in ids)
    stats = connector.stats()
    assert stats["dump_blocks"] == 4 and stats["dump_pages"] == 4 * len(LAYERS)


def test_a_partial_chunk_waits_for_its_last_block(store: Store) -> None:
    h = Harness(UCMPatchConnector, CHUNK)
    req = Req("a", TOKENS)
    h.sched.get_num_new_matched_tokens(req, 0)
    h.sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    # chunked prefill: 13 tokens (3 full blocks), then the rest
    md = h.step(so([new_req("a", [[1, 2, 3, 4, 5]], 0)], scheduled={"a": 13}))
    assert [ids for _g, ids, _h in md.dumps["a"]] == [(1, 2)]
    md = h.step(so(cached=[("a", 13, None)], scheduled={"a": 4}))
    assert [ids for _g, ids, _h in md.dumps["a"]] == [(3, 4)]
    assert connector.wait_for_dumps(WAIT_S)
    assert len(store) == 2 * len(LAYERS)


def test_a_hit_is_whole_chunks_each_page_into_its_block(store: Store) -> None:
    h = Harness(UCMPatchConnector, CHUNK)
    pages, _md = run_prefill(h, "a", [1, 2, 3, 4, 5], TOKENS)
    three = Req("c", [*TOKENS[:12], 9, 9])  # 3 shared blocks: one whole chunk
    assert h.sched.get_num_new_matched_tokens(three, 0) == (8, False)
    b = Req("b", [*TOKENS[:16], 7, 8])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (16, False)
    h.sched.update_state_after_alloc(b, blocks([9, 10, 11, 12, 13]), 16)
    md = h.step(so([new_req("b", [[9, 10, 11, 12, 13]], 16)], scheduled={"b": 2}))
    assert [e[1] for e in md.loads[0].entries] == [(9, 10), (11, 12)]
    for layer in range(len(LAYERS)):
        for src, dst in zip([1, 2, 3, 4], [9, 10, 11, 12], strict=True):
            assert h.page(layer, dst) == pages[(layer, src)], (layer, src, dst)
    assert connector.stats()["loaded_pages"] == 4 * len(LAYERS)
    assert h.worker.get_block_ids_with_load_errors() == set()


def test_a_block_of_vllms_own_hit_inside_a_chunk_is_not_written(store: Store) -> None:
    h = Harness(UCMPatchConnector, CHUNK)
    pages, _md = run_prefill(h, "a", [1, 2, 3, 4, 5], TOKENS)
    b = Req("b", [*TOKENS[:16], 7, 8])
    # vLLM's own prefix cache holds the first block (4 tokens, inside the first chunk)
    assert h.sched.get_num_new_matched_tokens(b, BS) == (16 - BS, False)
    h.sched.update_state_after_alloc(b, blocks([9, 10, 11, 12, 13]), 16 - BS)
    own = [h.fill(layer, 9, 77) for layer in range(len(LAYERS))]
    null = [h.fill(layer, 0, 78) for layer in range(len(LAYERS))]  # vLLM's null block
    md = h.step(so([new_req("b", [[9, 10, 11, 12, 13]], BS)], scheduled={"b": 14}))
    assert [e[1] for e in md.loads[0].entries] == [(0, 10), (11, 12)]
    for layer in range(len(LAYERS)):
        assert h.page(layer, 9) == own[layer]  # vLLM's block: untouched
        assert h.page(layer, 0) == null[layer]  # nor is the null block written
        for src, dst in zip([2, 3, 4], [10, 11, 12], strict=True):
            assert h.page(layer, dst) == pages[(layer, src)]
    assert connector.stats()["loaded_pages"] == 3 * len(LAYERS)


def test_an_out_of_range_block_drops_its_whole_chunk_before_any_copy(store: Store) -> None:
    h = Harness(UCMPatchConnector, CHUNK)
    before = connector.stats()["dump_pages_out_of_range"]
    ids = [1, 2, 3, NUM_BLOCKS + 3, 5]  # a block id the worker's cache does not have
    req = Req("a", TOKENS)
    h.sched.get_num_new_matched_tokens(req, 0)
    h.sched.update_state_after_alloc(req, blocks(ids), 0)
    md = h.step(so([new_req("a", [ids], 0)], scheduled={"a": len(TOKENS)}))
    assert connector.wait_for_dumps(WAIT_S)
    assert [ids for _g, ids, _h in md.dumps["a"]] == [(1, 2), (3, NUM_BLOCKS + 3)]
    assert connector.stats()["dump_pages_out_of_range"] - before == 2 * len(LAYERS)
    assert len(store) == len(LAYERS)  # the first chunk, every row


@pytest.mark.parametrize(("writer", "reader"), [("flash_attn", "flashinfer")])
def test_chunks_move_between_gpu_backend_layouts(store: Store, writer: str, reader: str) -> None:
    extra = {"chunk_tokens": 2 * GPU_BS}
    a = GpuHarness(writer, NHD, extra)
    for layer in LAYERS:
        fill(a.caches[layer], hash(layer) % 1000)
    tokens = list(range(900, 900 + 4 * GPU_BS + 3))
    req = Req("a", tokens, block_size=GPU_BS)
    a.sched.get_num_new_matched_tokens(req, 0)
    a.sched.update_state_after_alloc(req, blocks([3, 7, 11, 2, 5]), 0)
    md = a.step(so([new_req("a", [[3, 7, 11, 2, 5]], 0)], scheduled={"a": len(tokens)}))
    assert [ids for _g, ids, _h in md.dumps["a"]] == [(3, 7), (11, 2)]
    assert connector.wait_for_dumps(WAIT_S)
    b = GpuHarness(reader, HND, extra)
    req_b = Req("b", [*tokens[: 4 * GPU_BS], 1], block_size=GPU_BS)
    assert b.sched.get_num_new_matched_tokens(req_b, 0) == (4 * GPU_BS, False)
    b.sched.update_state_after_alloc(req_b, blocks([20, 6, 9, 1, 4]), 4 * GPU_BS)
    b.step(so([new_req("b", [[20, 6, 9, 1, 4]], 4 * GPU_BS)], scheduled={"b": 1}))
    for layer in LAYERS:
        for src, dst in ((3, 20), (7, 6), (11, 9), (2, 1)):
            assert torch.equal(b.block(layer, dst), a.block(layer, src)), (layer, src, dst)
        assert not b.block(layer, 4).any()
    assert b.worker.get_block_ids_with_load_errors() == set()


# ---------------------------------------------------------------------------------------
# The chunk, from vLLM's config
# ---------------------------------------------------------------------------------------
def attention_config(spec: FullAttentionSpec) -> KVCacheConfig:
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=8 * page, layers=["l0"], layer_stride=8 * page, block_stride=page)
    return KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )


def test_default_chunk_makes_1_mib_values_of_qwen3_8b_gpu_pages() -> None:
    # Qwen3-8B: 8 KV heads of 128, bf16; vLLM's CUDA block is 16 tokens
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert parse_connector_config({}).chunk_tokens == CHUNK_TOKENS
    layout = KVLayout.from_vllm(
        vllm_config(block_size=16), attention_config(spec), None, CHUNK_TOKENS
    )
    assert layout.chunk_blocks[0] * 16 == CHUNK_TOKENS == layout.unit
    assert layout.chunk_blocks[0] * spec.page_size_bytes == 1 << 20


def test_blocks_larger_than_the_chunk_are_one_block_each() -> None:
    spec = FullAttentionSpec(block_size=640, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layout = KVLayout.from_vllm(
        vllm_config(block_size=640), attention_config(spec), None, CHUNK_TOKENS
    )
    assert layout.chunk_blocks == {0: 1} and layout.unit == 640


def test_another_chunk_is_another_fingerprint() -> None:
    kvcc = kv_cache_config()
    one = KVLayout.from_vllm(vllm_config(), kvcc, None, chunk_tokens=BS)
    two = KVLayout.from_vllm(vllm_config(), kvcc, None, chunk_tokens=2 * BS)
    assert one.fingerprint != two.fingerprint
    assert one.key("ab", 0, 0, 0) != two.key("ab", 0, 0, 0)


@pytest.mark.parametrize("bad", [0, -4, "256", 2.5, True])
def test_a_bad_chunk_tokens_is_refused_naming_the_key(bad: object) -> None:
    with pytest.raises(ConnectorConfigError, match="chunk_tokens"):
        parse_connector_config({"chunk_tokens": bad})
