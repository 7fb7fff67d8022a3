"""Stand-in for vllm_ascend/attention/sfa_v1.py 0.13.0 - 0.18.0: the mlapo branch never waits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch_npu

from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
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
        num_input_tokens = attn_metadata.num_input_tokens
        slots = torch.arange(hidden_states.shape[0]).view(-1, 1)
        if self.enable_mlapo and num_input_tokens <= MLAPO_MAX_SUPPORTED_TOKENS:
            torch_npu.LOG.append(("mlapo", layer_name))
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
        output[...] = hidden_states
        maybe_save_kv_layer_to_connector(layer_name, list(kv_cache))
        return output
