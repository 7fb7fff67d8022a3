"""Page views derived from KV-cache tensors built exactly as vLLM's backends build them.

``vllm_attention_cache`` follows ``GPUModelRunner._reshape_kv_cache_tensors`` and
``_update_hybrid_attention_mamba_layout`` of vLLM 0.22.1 (gpu_model_runner.py 6891-7050):
the backend's logical shape for ``num_blocks * block_size // kernel_block_size`` kernel
blocks, allocated in the backend's stride order and permuted back, then (hybrid models)
made block-major with ``as_strided_``. ``vllm_mamba_states`` follows the MambaSpec branch
(page-strided state views over the same bytes). Backend shapes and stride orders, from the
0.22.1 sources: FlashAttention ``(2, N, B, H, D)``, FlashInfer / Triton
``(N, 2, B, H, D)``, CPU ``(2, N, H, B, D)`` (HND logical), MLA ``(N, B, D)``; the ``HND``
stride order is ``(0, 1, 3, 2, 4)`` for the first three.

What must hold: the stored page of block ``b`` is K then V in (token, head, dim) order
whatever the layout, so a page written under one layout reads back under another; rows
aliased with mamba states round-trip their raw bytes; a layout nobody knows is refused
naming its shape and strides; block ids outside the view are found on the host.
"""

from __future__ import annotations

import pytest
import torch

from ucm_patch.connector.page_views import (
    AttentionShape,
    UnknownKVLayout,
    attention_view,
    raw_view,
)

HND = (0, 1, 3, 2, 4)
NHD = (0, 1, 2, 3, 4)
# backend -> (logical shape of (num_blocks, block, heads, head_size), block dim)
BACKENDS = {
    "flash_attn": (lambda n, b, h, d: (2, n, b, h, d), 1),
    "flashinfer": (lambda n, b, h, d: (n, 2, b, h, d), 0),
    "triton_attn": (lambda n, b, h, d: (n, 2, b, h, d), 0),
    "cpu_attn": (lambda n, b, h, d: (2, n, h, b, d), 1),
}


# vLLM >= 0.32 (kv_cache_layout.py, RFC #42082): one logical per-layer view
# ``[B, H, N, C]`` with K|V packed in ``C = 2 * head_size``, laid out by the group's
# KVCacheLayout; ``layer_view_order`` is the physical order of those four axes.
LAYER_VIEW_ORDER = {"v032-LBHNC": (0, 1, 2, 3), "v032-LBNHC": (0, 2, 1, 3)}


def vllm032_attention_cache(
    layout: str, num_blocks: int, spec: AttentionShape, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    logical = (num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
    order = LAYER_VIEW_ORDER[layout]
    physical = torch.zeros(tuple(logical[i] for i in order), dtype=dtype)
    return physical.permute(*[order.index(i) for i in range(4)])


def vllm_attention_cache(
    backend: str,
    num_blocks: int,
    spec: AttentionShape,
    dtype: torch.dtype = torch.bfloat16,
    stride_order: tuple[int, ...] = NHD,
    kernel_block: int | None = None,
    hybrid: bool = False,
    raw: torch.Tensor | None = None,
) -> torch.Tensor:
    """An attention layer's cache as vLLM 0.22.1's model runner makes it."""
    if backend in LAYER_VIEW_ORDER:
        return vllm032_attention_cache(backend, num_blocks, spec, dtype)
    kernel = kernel_block or spec.block_size
    shape_of, block_dim = BACKENDS[backend]
    kernel_blocks = num_blocks * (spec.block_size // kernel)
    shape = shape_of(kernel_blocks, kernel, spec.num_kv_heads, spec.head_size)
    if raw is None:
        page = 2 * spec.block_size * spec.num_kv_heads * spec.head_size * dtype.itemsize
        raw = torch.zeros(num_blocks * page, dtype=torch.uint8)
    physical = tuple(shape[i] for i in stride_order)
    inverse = [stride_order.index(i) for i in range(len(stride_order))]
    kv = raw.view(dtype)[: torch.Size(physical).numel()].view(physical).permute(*inverse)
    if hybrid and block_dim == 1:
        hidden = kv.shape[2:].numel()
        kv.as_strided_(size=kv.shape, stride=(hidden, 2 * hidden, *kv.stride()[2:]))
    return kv


def vllm_mla_cache(num_blocks: int, spec: AttentionShape) -> torch.Tensor:
    return torch.zeros((num_blocks, spec.block_size, spec.head_size), dtype=torch.bfloat16)


def vllm_mamba_states(
    raw: torch.Tensor, num_blocks: int, page_bytes: int, shapes: list[tuple[int, ...]]
) -> list[torch.Tensor]:
    """The MambaSpec branch: one page-strided view per state over the same bytes."""
    out, offset = [], 0
    for shape in shapes:
        dtype = torch.float32
        target = (num_blocks, *shape)
        stride = torch.empty(target).stride()
        out.append(
            torch.as_strided(
                raw.view(dtype),
                size=target,
                stride=(page_bytes // dtype.itemsize, *stride[1:]),
                storage_offset=offset // dtype.itemsize,
            )
        )
        offset += stride[0] * dtype.itemsize
    return out


def semantic(kv: torch.Tensor, backend: str, spec: AttentionShape, kernel: int) -> torch.Tensor:
    """The cache as ``[block, K/V, token, head, dim]`` (the stored order), by indexing."""
    if backend in LAYER_VIEW_ORDER:  # [B, H, N, 2D]
        n, h, b, _ = kv.shape
        return kv.reshape(n, h, b, 2, spec.head_size).permute(0, 3, 2, 1, 4)
    _, block_dim = BACKENDS[backend]
    t = kv if block_dim == 1 else kv.transpose(0, 1)  # (2, kernel blocks, ...)
    if backend == "cpu_attn":
        t = t.transpose(2, 3)  # (2, Nk, H, B, D) -> (2, Nk, B, H, D)
    r = spec.block_size // kernel
    t = t.reshape(2, -1, r, kernel, spec.num_kv_heads, spec.head_size)
    return t.reshape(2, t.shape[1], spec.block_size, spec.num_kv_heads, spec.head_size).transpose(
        0, 1
    )


def fill(kv: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    kv.copy_(torch.randn(kv.shape, generator=g).to(kv.dtype))


SPEC = AttentionShape(block_size=32, num_kv_heads=4, head_size=64)
LAYOUTS = [
    ("flash_attn", NHD, None, False),
    ("flash_attn", HND, None, False),
    ("flashinfer", NHD, None, False),
    ("flashinfer", HND, None, False),
    ("triton_attn", NHD, None, False),
    ("cpu_attn", NHD, None, False),
    ("flash_attn", NHD, 16, False),  # kernel blocks: two per manager block
    ("flash_attn", NHD, None, True),  # hybrid: K-outer made block-major
    ("flash_attn", NHD, 16, True),
    ("flashinfer", NHD, 16, True),
    ("v032-LBHNC", NHD, None, False),  # vLLM 0.32's CPU backend
    ("v032-LBNHC", NHD, None, False),
]
IDS = [
    f"{b}-{'HND' if o == HND else 'NHD'}-k{k or 'full'}{'-hybrid' if h else ''}"
    for b, o, k, h in LAYOUTS
]


@pytest.mark.parametrize(("backend", "order", "kernel", "hybrid"), LAYOUTS, ids=IDS)
def test_attention_page_is_k_then_v_in_token_head_dim_order(backend, order, kernel, hybrid):
    n = 7
    kv = vllm_attention_cache(
        backend, n, SPEC, stride_order=order, kernel_block=kernel, hybrid=hybrid
    )
    fill(kv, 1)
    view = attention_view(kv, n, SPEC, "layer.0")
    assert view.num_blocks == n
    assert view.page_bytes == 2 * SPEC.block_size * SPEC.num_kv_heads * SPEC.head_size * 2
    idx = torch.tensor([5, 0, 3])
    pages = view.gather(idx)
    expected = semantic(kv, backend, SPEC, kernel or SPEC.block_size)[idx]
    assert torch.equal(pages, expected.contiguous().view(torch.uint8).reshape(3, -1))


@pytest.mark.parametrize(
    ("src", "dst"), [(0, 3), (3, 0), (5, 8), (8, 5), (1, 7), (6, 2), (10, 0), (11, 5), (4, 11)]
)
def test_a_page_written_under_one_layout_reads_back_under_another(src, dst):
    a_backend, a_order, a_kernel, a_hybrid = LAYOUTS[src]
    b_backend, b_order, b_kernel, b_hybrid = LAYOUTS[dst]
    n = 6
    a = vllm_attention_cache(
        a_backend, n, SPEC, stride_order=a_order, kernel_block=a_kernel, hybrid=a_hybrid
    )
    b = vllm_attention_cache(
        b_backend, n, SPEC, stride_order=b_order, kernel_block=b_kernel, hybrid=b_hybrid
    )
    fill(a, 2)
    pages = attention_view(a, n, SPEC, "a").gather(torch.tensor([1, 4]))
    attention_view(b, n, SPEC, "b").scatter(torch.tensor([2, 5]), pages)
    sa = semantic(a, a_backend, SPEC, a_kernel or SPEC.block_size)
    sb = semantic(b, b_backend, SPEC, b_kernel or SPEC.block_size)
    assert torch.equal(sb[2], sa[1]) and torch.equal(sb[5], sa[4])
    untouched = [i for i in range(n) if i not in (2, 5)]
    assert not sb[untouched].any()  # nothing written outside the two blocks


def test_mla_page_is_token_then_latent():
    spec = AttentionShape(block_size=16, num_kv_heads=1, head_size=96, mla=True)
    kv = vllm_mla_cache(5, spec)
    fill(kv, 3)
    view = attention_view(kv, 5, spec, "mla")
    assert torch.equal(
        view.gather(torch.tensor([4]))[0], kv[4].contiguous().view(torch.uint8).flatten()
    )


def test_mla_page_of_vllm_032_layer_view_is_token_then_latent():
    """0.32's per-layer view ``[B, H=1, N, C]`` for MLA: the same page as ``(N, B, D)``."""
    spec = AttentionShape(block_size=16, num_kv_heads=1, head_size=96, mla=True)
    kv = vllm_mla_cache(5, spec).unsqueeze(1)  # (5, 1, 16, 96)
    fill(kv, 7)
    view = attention_view(kv, 5, spec, "mla")
    assert torch.equal(
        view.gather(torch.tensor([2]))[0], kv[2].contiguous().view(torch.uint8).flatten()
    )


def test_hybrid_row_round_trips_attention_and_mamba_pages_through_either_tensor():
    """A row shared by an attention layer and a GDN layer: one raw page per block, the
    same view whichever layer's tensor it is derived from."""
    n, spec = 6, SPEC
    page = 2 * spec.block_size * spec.num_kv_heads * spec.head_size * 2
    raw = torch.zeros(n * page, dtype=torch.uint8)
    attn = vllm_attention_cache("flash_attn", n, spec, kernel_block=16, hybrid=True, raw=raw)
    states = vllm_mamba_states(raw, n, page, [(3, 16), (4, 8, 8)])
    from_attn = raw_view(attn, n, page, "attn", spec)
    from_mamba = raw_view(states, n, page, "gdn", None)
    assert from_attn.view.stride() == from_mamba.view.stride() == (page, 1)
    assert from_attn.view.data_ptr() == from_mamba.view.data_ptr()
    fill(states[0][2], 4)
    fill(states[1][2], 5)
    fill(attn[:, 4], 6)
    before = [states[0][2].clone(), states[1][2].clone(), attn[:, 4].clone()]
    pages = from_mamba.gather(torch.tensor([2, 4]))
    raw.zero_()
    from_attn.scatter(torch.tensor([2, 4]), pages)
    assert torch.equal(states[0][2], before[0]) and torch.equal(states[1][2], before[1])
    assert torch.equal(attn[:, 4], before[2])


def test_k_outer_cache_in_a_row_shared_with_mamba_is_refused():
    n = 4
    kv = vllm_attention_cache("flash_attn", n, SPEC)  # not made block-major
    page = kv[:, 0].numel() * 2
    with pytest.raises(UnknownKVLayout, match=r"block-major.*shape=\(2, 4, 32, 4, 64\)"):
        raw_view(kv, n, page, "model.layers.3.self_attn.attn", SPEC)


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        ((3, 8, 32, 4, 64), "no block dimension"),  # neither (2, N, ...) nor (N, 2, ...)
        ((2, 8, 32, 5, 64), "expected 32-token blocks of 4 KV heads"),
        ((2, 9, 32, 4, 64), "no block dimension of 8 blocks"),  # config says 8 blocks
    ],
)
def test_unknown_layout_is_refused_naming_shape_and_strides(shape, why):
    kv = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(UnknownKVLayout) as err:
        attention_view(kv, 8, SPEC, "model.layers.0.self_attn.attn")
    text = str(err.value)
    assert why in text and f"shape={shape}" in text and "stride=" in text
    assert "model.layers.0.self_attn.attn" in text


def test_non_contiguous_head_dim_is_refused():
    kv = torch.zeros((2, 8, 32, 64, 4), dtype=torch.bfloat16).transpose(3, 4)
    with pytest.raises(UnknownKVLayout, match="innermost"):
        attention_view(kv, 8, SPEC, "x")


def test_block_ids_are_checked_on_the_host():
    kv = vllm_attention_cache("flash_attn", 5, SPEC)
    view = attention_view(kv, 5, SPEC, "x")
    assert view.out_of_range([0, 4, 5, -1, 2]) == [5, -1]
    assert view.out_of_range([0, 1, 2, 3, 4]) == []


def test_mamba_state_view_with_another_block_count_is_refused():
    n, page = 4, 1024
    raw = torch.zeros(2 * n * page, dtype=torch.uint8)
    states = vllm_mamba_states(raw, 2 * n, page, [(4, 8)])
    with pytest.raises(UnknownKVLayout, match=r"must have 4 blocks.*shape=\(8, 4, 8\)"):
        raw_view(states, n, page, "model.layers.0.linear_attn", None)
