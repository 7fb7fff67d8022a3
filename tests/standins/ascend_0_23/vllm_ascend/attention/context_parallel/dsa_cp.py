"""Stand-in for vllm_ascend/attention/context_parallel/dsa_cp.py 0.23.0."""

from __future__ import annotations

import torch
import torch_npu

from vllm_ascend.attention.dsa_v1 import AscendDSAImpl
from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
    notify_kv_cache_written,
    wait_for_kv_layer_from_connector,
)


class AscendDSACPImpl(AscendDSAImpl):
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
        self._forward(layer_name, hidden_states, kv_cache)
        maybe_save_kv_layer_to_connector(layer_name, list(kv_cache))
        return output

    def _forward(self, layer_name, hidden_states, kv_cache):
        slots = torch.arange(hidden_states.shape[0]).view(-1, 1)
        torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, hidden_states)
        notify_kv_cache_written(layer_name)
