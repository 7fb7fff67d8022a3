"""Stand-in for vllm_ascend/attention/utils.py: the connector hook functions, as upstream.

Like upstream they pass the *whole* ``forward_context.attn_metadata`` dict to
``save_kv_layer`` and do not check ``connector.has_connector_metadata()``.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer import (
    get_kv_transfer_group,
    has_kv_transfer_group,
    is_v1_kv_transfer_group,
)
from vllm.forward_context import get_forward_context


def wait_for_kv_layer_from_connector(layer_name: str):
    if not has_kv_transfer_group() or not is_v1_kv_transfer_group():
        return
    connector = get_kv_transfer_group()
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None:
        return
    connector.wait_for_layer_load(layer_name)


def maybe_save_kv_layer_to_connector(
    layer_name: str,
    kv_cache_layer: list[torch.Tensor],
):
    if not has_kv_transfer_group() or not is_v1_kv_transfer_group():
        return
    connector = get_kv_transfer_group()
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None:
        return
    connector.save_kv_layer(layer_name, kv_cache_layer, attn_metadata)
