"""Stand-in for vllm_ascend/attention/sfa_v1.py 0.19.1rc1+ (here 0.23.0): every branch waits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch_npu

from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
    notify_kv_cache_written,
    wait_for_kv_layer_from_connector,
)

MLAPO_MAX_SUPPORTED_TOKENS = 1024


@dataclass
class AscendSFAMetadata:
    num_input_tokens: int
    reshape_cache_event: torch.npu.Event = None


class AscendSFAImpl:
    def __init__(self, enable_mlapo: bool, is_kv_producer: bool = True) -> None:
        self.enable_mlapo = enable_mlapo
        self.is_kv_producer = is_kv_producer
        self.layer_name = None

    def forward(
        self,
        layer_name,
        hidden_states: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        attn_metadata,
        need_gather_q_kv: bool = False,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None, "Output tensor must be provided."
        if attn_metadata is None:
            return output.fill_(0)
        slots = torch.arange(hidden_states.shape[0]).view(-1, 1)
        if self.enable_mlapo and attn_metadata.num_input_tokens <= MLAPO_MAX_SUPPORTED_TOKENS:
            wait_for_kv_layer_from_connector(layer_name)
            torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, hidden_states)
        else:
            wait_for_kv_layer_from_connector(layer_name)
            torch_npu.npu_scatter_nd_update_(kv_cache[0], slots, hidden_states)
        if kv_cache is not None:
            if self.is_kv_producer:
                attn_metadata.reshape_cache_event = torch.npu.Event()
            torch_npu.npu_scatter_nd_update_(kv_cache[2], slots, hidden_states)
            if self.is_kv_producer:
                attn_metadata.reshape_cache_event.record()
                notify_kv_cache_written(self.layer_name or "")
        output[...] = hidden_states
        maybe_save_kv_layer_to_connector(layer_name, list(kv_cache))
        return output
