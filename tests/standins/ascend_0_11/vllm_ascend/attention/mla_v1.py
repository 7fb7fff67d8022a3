"""Stand-in for vllm_ascend/attention/mla_v1.py 0.11.0: MLA calls the by-name hooks itself."""

from __future__ import annotations

import torch
import torch_npu

from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
    wait_for_kv_layer_from_connector,
)


class AscendMLAImpl:
    def __init__(self, is_kv_producer: bool = True) -> None:
        self.is_kv_producer = is_kv_producer

    def _mla_preprocess(self, layer_name, hidden_states, kv_cache, attn_metadata, need_gather_q_kv):
        wait_for_kv_layer_from_connector(layer_name)
        slots = torch.arange(hidden_states.shape[0]).view(-1, 1)
        torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, hidden_states)

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
