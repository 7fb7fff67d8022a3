"""Stand-in for vllm_ascend/attention/mla_v1.py 0.13.0.

The event is created, for producers only, in ``mla_preprocess_prefill`` (prefill tokens),
which ``_mla_preprocess`` calls; the hooks are by-name imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch_npu

from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
    wait_for_kv_layer_from_connector,
)


@dataclass
class AscendMLAMetadata:
    num_prefills: int
    num_decodes: int
    reshape_cache_event: torch.npu.Event = None


class AscendMLAImpl:
    def __init__(self, is_kv_producer: bool) -> None:
        self.is_kv_producer = is_kv_producer

    def mla_preprocess_decode(self, q_c, kv_no_split, kv_cache, attn_metadata):
        slots = torch.arange(kv_no_split.shape[0]).view(-1, 1)
        torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, kv_no_split)

    def mla_preprocess_prefill(self, q_c, kv_no_split, kv_cache, attn_metadata):
        if self.is_kv_producer:
            attn_metadata.reshape_cache_event = torch.npu.Event()
        slots = torch.arange(kv_no_split.shape[0]).view(-1, 1)
        torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, kv_no_split)
        if self.is_kv_producer:
            attn_metadata.reshape_cache_event.record()

    def _mla_preprocess(self, layer_name, hidden_states, kv_cache, attn_metadata, need_gather_q_kv):
        has_prefill = attn_metadata.num_prefills > 0
        if has_prefill:
            wait_for_kv_layer_from_connector(layer_name)
        if attn_metadata.num_decodes > 0:
            self.mla_preprocess_decode(hidden_states, hidden_states, kv_cache, attn_metadata)
        if has_prefill:
            self.mla_preprocess_prefill(hidden_states, hidden_states, kv_cache, attn_metadata)

    def forward(
        self,
        layer_name,
        hidden_states,
        kv_cache,
        attn_metadata,
        need_gather_q_kv=False,
        output=None,
    ):
        self._mla_preprocess(layer_name, hidden_states, kv_cache, attn_metadata, need_gather_q_kv)
        maybe_save_kv_layer_to_connector(layer_name, list(kv_cache))
        return output
