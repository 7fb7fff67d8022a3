"""Stand-in for vllm_ascend/attention/mla_v1.py 0.18 - 0.22 (here 0.18.0).

``_mla_preprocess`` creates the event only for a producer that is not ``kv_both`` (so a
``kv_both`` MLA layer has none); the hooks are by-name imports.
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
    def __init__(self, is_kv_producer: bool, is_kv_both: bool) -> None:
        self.is_kv_producer = is_kv_producer
        self.is_kv_both = is_kv_both

    def _mla_preprocess(self, layer_name, hidden_states, kv_cache, attn_metadata, need_gather_q_kv):
        has_prefill = attn_metadata.num_prefills > 0
        if has_prefill:
            wait_for_kv_layer_from_connector(layer_name)
        if self.is_kv_producer and not self.is_kv_both:
            attn_metadata.reshape_cache_event = torch.npu.Event()
        slots = torch.arange(hidden_states.shape[0]).view(-1, 1)
        torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, hidden_states)
        if self.is_kv_producer and not self.is_kv_both:
            attn_metadata.reshape_cache_event.record()

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
