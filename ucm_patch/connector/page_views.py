"""Page views over vLLM's KV-cache tensors, derived from each tensor's shape and strides.

A *page* is what one storage row holds for one block id: the bytes the connector stores
under one key. The worker side never assumes which dimension holds the blocks; it reads
it off the tensor vLLM registered, because the layouts differ by backend and release:

====================================  ================================  ==================
backend (vLLM 0.11 - 0.33)            logical shape                     block dim
====================================  ================================  ==================
FlashAttention, CPU (``HND``)         ``(2, N, B, H, D)`` / (2,N,H,B,D)  1 (K outer)
FlashInfer, Triton                    ``(N, 2, B, H, D)``               0
any of these, ``HND`` stride order    same logical shape, permuted      same
hybrid (attention + mamba rows)       K-outer made block-major with     1, but each block
                                      ``as_strided`` (pages alias)      is contiguous
MLA                                   ``(N, B, D)``                     0
Mamba / GDN states                    ``[conv (N, ...), ssm (N, ...)]``  0, page-strided
====================================  ================================  ==================

``N`` may be a multiple of the KV-cache config's block count: vLLM splits a manager block
into ``block_size // kernel_block_size`` kernel blocks for backends with fixed kernel block
sizes (hybrid models, where the manager block is 640 or 1152 tokens). Those kernel blocks
are consecutive, so manager block ``b`` is kernel blocks ``b*r .. b*r + r - 1``.

Two kinds of view, both ``uint8`` with the block id on dim 0:

* **Attention rows** (a row without a mamba layer): the page is stored as **K then V, each
  in (token, head, dim) order**, whatever the physical layout. The view is a strided byte
  view of the tensor with its dims put in that order, so ``index_select`` on dim 0 yields
  the stored order and ``index_copy_`` writes it back through any layout: a value dumped
  under FlashAttention's K-outer layout reads back under FlashInfer's block-major HND one.
  Token and head dims are told apart by size (the spec's block size and KV-head count);
  when the two are equal the tensor's logical order is taken as given.
* **The flat backing buffer** (vLLM >= 0.32 hands it over for specs without per-layer
  views): the raw page where the layer's ``KVCacheTensor`` places it.
* **Rows with a mamba layer** (hybrid models): the layers of the row alias one block-major
  page per block (a block id belongs to one group at a time), so the page is the raw
  ``page_bytes`` at the block's start. The tensor must be block-major (every byte of a
  block inside its stride); a K-outer tensor here is refused.

Everything is checked when the caches are registered: the block dim's size against the
KV-cache config, the view against the tensor's storage. A layout that fits neither kind
raises :class:`UnknownKVLayout` naming the layer, its shape and strides: the connector
refuses to start rather than read the wrong bytes. Block ids are checked against
:attr:`PageView.num_blocks` on the host before any gather or copy is launched (on CUDA an
out-of-range index is a device-side assert that kills the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


class UnknownKVLayout(ValueError):
    """A KV-cache tensor whose layout the connector cannot map to pages."""


@dataclass(frozen=True)
class AttentionShape:
    """What a page of an attention layer holds (from its KV-cache spec)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    mla: bool = False


@dataclass
class PageView:
    """``uint8`` view over vLLM's KV memory: dim 0 is the block id, the rest one page."""

    view: torch.Tensor
    num_blocks: int
    page_bytes: int
    layout: str
    """How the page was derived (for logs and errors)."""

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Pages ``idx`` (already bounds-checked) as a contiguous ``[n, page_bytes]``."""
        return self.view.index_select(0, idx).reshape(idx.numel(), self.page_bytes)

    def gather_into(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Copy pages ``idx`` (already bounds-checked) into ``out``, a contiguous host
        ``[n, page_bytes]`` tensor: on CPU one copy, straight from the KV cache into
        ``out``; on a device, gathered there, then one copy to the host (in the caller's
        stream)."""
        shaped = out.view(idx.numel(), *self.view.shape[1:])
        if self.view.device.type == "cpu":
            torch.index_select(self.view, 0, idx, out=shaped)
        else:
            shaped.copy_(self.view.index_select(0, idx), non_blocking=True)

    def scatter(self, idx: torch.Tensor, pages: torch.Tensor) -> None:
        """Write ``pages`` (``[n, page_bytes]`` on the view's device) into blocks ``idx``."""
        self.view.index_copy_(0, idx, pages.reshape(idx.numel(), *self.view.shape[1:]))

    def out_of_range(self, block_ids: Sequence[int]) -> list[int]:
        """The ids that are not blocks of this view (checked on the host, before a launch)."""
        n = self.num_blocks
        return [b for b in block_ids if not 0 <= b < n]


def _describe(tensor: torch.Tensor) -> str:
    return (
        f"shape={tuple(tensor.shape)} stride={tuple(tensor.stride())} dtype={tensor.dtype} "
        f"storage_offset={tensor.storage_offset()}"
    )


def _byte_view(
    tensor: torch.Tensor, dims: list[tuple[int, int]], start: int, layer: str
) -> torch.Tensor:
    """A ``uint8`` view with ``dims`` as (size, byte stride), over ``tensor``'s storage."""
    storage = tensor.untyped_storage()
    last = start + sum((size - 1) * stride for size, stride in dims)
    if start < 0 or any(size <= 0 or stride < 0 for size, stride in dims):
        raise UnknownKVLayout(f"layer {layer!r}: empty or negative view ({_describe(tensor)})")
    if last >= storage.nbytes():
        raise UnknownKVLayout(
            f"layer {layer!r}: page view ends at byte {last} past the storage's "
            f"{storage.nbytes()} bytes ({_describe(tensor)})"
        )
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    view.set_(storage, start, tuple(s for s, _ in dims), tuple(st for _, st in dims))
    return view


def _block_dims(
    tensor: torch.Tensor, num_blocks: int, layer: str, attention: AttentionShape | None
) -> tuple[int, int | None, int]:
    """(block dim, K/V dim or None, kernel blocks per block) of a tensor."""
    shape = tuple(tensor.shape)

    def ratio(dim: int) -> int:
        size = shape[dim]
        if num_blocks <= 0 or size % num_blocks:
            return 0
        return size // num_blocks

    if attention is None or attention.mla or tensor.dim() == 4:
        # Mamba states (N, ...), MLA (N, B, D), vLLM >= 0.32's (N, H, B, 2D) / (N, B, H, 2D).
        r = ratio(0) if shape else 0
        if r:
            return 0, None, r
    elif tensor.dim() == 5:
        # (2, N, ...) K outer (FlashAttention, CPU) or (N, 2, ...) (FlashInfer, Triton).
        for kv, blk in ((0, 1), (1, 0)):
            r = ratio(blk)
            if shape[kv] == 2 and r:
                return blk, kv, r
    raise UnknownKVLayout(
        f"layer {layer!r}: no block dimension of {num_blocks} blocks (or a multiple, for "
        f"kernel blocks) in {_describe(tensor)}; known layouts: (2, N, ...), (N, 2, ...), "
        "MLA (N, B, D), mamba states (N, ...)"
    )


def attention_view(
    tensor: torch.Tensor, num_blocks: int, spec: AttentionShape, layer: str
) -> PageView:
    """Page view of an attention layer's cache, stored as K|V in (token, head, dim) order."""
    es = tensor.element_size()
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    if not shape or stride[-1] != 1:
        raise UnknownKVLayout(
            f"layer {layer!r}: the innermost (head) dimension is not contiguous "
            f"({_describe(tensor)})"
        )
    blk, kv, r = _block_dims(tensor, num_blocks, layer, spec)
    if spec.block_size % r:
        raise UnknownKVLayout(
            f"layer {layer!r}: {r} kernel blocks per block do not divide block_size "
            f"{spec.block_size} ({_describe(tensor)})"
        )
    kernel = spec.block_size // r
    rest = [d for d in range(tensor.dim() - 1) if d not in (blk, kv)]
    # vLLM >= 0.32 packs K|V in the last dim (``[B, H, N, 2 * head_size]``, RFC #42082).
    packed = kv is None and not spec.mla and shape[-1] == 2 * spec.head_size
    head_bytes = (shape[-1] // 2 if packed else shape[-1]) * es
    if spec.mla and len(rest) == 2:  # vLLM >= 0.32's (N, 1, B, C): one latent "head"
        rest = [d for d in rest if shape[d] != 1] or rest[-1:]
    if spec.mla:
        if len(rest) != 1 or shape[rest[0]] != kernel:
            raise UnknownKVLayout(
                f"layer {layer!r}: an MLA cache must be (N, {kernel}, D), got {_describe(tensor)}"
            )
        tok = rest[0]
        order = "latent (token, dim)"
    elif kv is None and not packed:
        raise UnknownKVLayout(
            f"layer {layer!r}: a 4-dim attention cache must pack K|V in its last dim "
            f"(2 * head_size = {2 * spec.head_size}), got {_describe(tensor)}"
        )
    else:
        a, b = rest
        if shape[a] == spec.num_kv_heads and shape[b] == kernel and kernel != spec.num_kv_heads:
            tok, head = b, a  # HND logical order (vLLM's CPU backend)
        elif shape[a] == kernel and shape[b] == spec.num_kv_heads:
            tok, head = a, b
        else:
            raise UnknownKVLayout(
                f"layer {layer!r}: expected {kernel}-token blocks of {spec.num_kv_heads} KV "
                f"heads, got {_describe(tensor)}"
            )
        order = "K|V (token, head, dim)"
    # Page dims in stored order: [K/V,] kernel block (a token chunk), token[, head], dim.
    chunk = (r, stride[blk] * es)
    if spec.mla:
        inner = [chunk, (shape[tok], stride[tok] * es)]
    else:
        kv_stride = head_bytes if packed else stride[kv] * es  # type: ignore[index]
        inner = [(2, kv_stride), chunk, (shape[tok], stride[tok] * es)]
        inner.append((shape[head], stride[head] * es))
    dims = [(num_blocks, stride[blk] * r * es), *inner, (head_bytes, 1)]
    view = _byte_view(tensor, dims, tensor.storage_offset() * es, layer)
    page = view[0].numel()
    layout = f"{order}, block dim {blk}, {r} kernel block(s) per block"
    return PageView(view, num_blocks, page, layout)


def raw_view(
    tensor: torch.Tensor | Sequence[torch.Tensor],
    num_blocks: int,
    page_bytes: int,
    layer: str,
    attention: AttentionShape | None,
) -> PageView:
    """Page view of a row whose layers alias one block-major page per block (hybrid rows).

    ``tensor``: an attention layer's cache, or a mamba layer's list of state views.
    """
    parts = list(tensor) if isinstance(tensor, list | tuple) else [tensor]
    if not parts:
        raise UnknownKVLayout(f"layer {layer!r}: no KV-cache tensor")
    spans = []
    for part in parts:
        blk, _kv, r = _block_dims(part, num_blocks, layer, attention)
        if attention is None and r != 1:  # a state per block: no kernel blocks
            raise UnknownKVLayout(
                f"layer {layer!r}: a mamba state view must have {num_blocks} blocks, got "
                f"{_describe(part)}"
            )
        es = part.element_size()
        block_stride = part.stride(blk) * r * es
        extent = (
            es
            + sum(
                (size - 1) * st * es
                for d, (size, st) in enumerate(zip(part.shape, part.stride(), strict=True))
                if d != blk
            )
            + (r - 1) * part.stride(blk) * es
        )
        if extent > block_stride:
            raise UnknownKVLayout(
                f"layer {layer!r}: a row shared with mamba states needs a block-major cache "
                f"(each block's {extent} bytes within its {block_stride}-byte stride), got "
                f"{_describe(part)}"
            )
        spans.append((part.storage_offset() * es, block_stride, part))
    start, block_stride, first = min(spans, key=lambda s: s[0])
    if any(s[1] != block_stride for s in spans):
        raise UnknownKVLayout(
            f"layer {layer!r}: state views with different block strides {[s[1] for s in spans]}"
        )
    page = min(page_bytes, block_stride)
    view = _byte_view(first, [(num_blocks, block_stride), (page, 1)], start, layer)
    return PageView(view, num_blocks, page, f"raw {page}-byte page, block stride {block_stride}")


def placement_view(
    buffer: torch.Tensor, placement: Any, layer_index: int, num_blocks: int, layer: str
) -> PageView:
    """Raw page view of a layer that vLLM >= 0.32 hands over as the flat backing buffer
    (specs without per-layer views): its pages are where its ``KVCacheTensor`` places them,
    ``offset + layer_index * layer_stride + b * block_stride``."""
    start = buffer.storage_offset() * buffer.element_size() + placement.offset
    start += layer_index * placement.layer_stride
    block_stride = placement.block_stride
    page = min(placement.layer_stride, block_stride)
    view = _byte_view(buffer, [(num_blocks, block_stride), (page, 1)], start, layer)
    return PageView(view, num_blocks, page, f"placed {page}-byte page, block stride {block_stride}")
