"""Stand-in for vllm_ascend/attention/dsa_v1.py 0.23.0.

DSA writes in ``_forward_prefill`` / ``_forward_decode`` and announces each write with
``notify_kv_cache_written(layer_name)``; it creates no event. Hooks are by-name imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch_npu

from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
    notify_kv_cache_written,
    wait_for_kv_layer_from_connector,
)


@dataclass
class AscendDSAMetadata:
    num_prefills: int
    reshape_cache_event: torch.npu.Event = None


class AscendDSAImpl:
    def forward(  # type: ignore[override]
        self,
        layer_name,
        hidden_states: torch.Tensor,
        kv_cache: tuple[torch.Tensor, ...],
        attn_metadata,
        need_gather_q_kv: bool = False,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        wait_for_kv_layer_from_connector(layer_name)
        if attn_metadata.num_prefills > 0:
            self._forward_prefill(layer_name, hidden_states, kv_cache)
        else:
            self._forward_decode(layer_name, hidden_states, kv_cache)
        maybe_save_kv_layer_to_connector(layer_name, list(kv_cache))
        return output

    def _forward_prefill(self, layer_name, hidden_states, kv_cache):
        slots = torch.arange(hidden_states.shape[0]).view(-1, 1)
        torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, hidden_states)
        notify_kv_cache_written(layer_name)

    def _forward_decode(self, layer_name, hidden_states, kv_cache):
        slots = torch.arange(hidden_states.shape[0]).view(-1, 1)
        torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, hidden_states)
        notify_kv_cache_written(layer_name)
