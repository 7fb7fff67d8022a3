"""vLLM-Ascend main scenario (child process of tests/test_patches_ascend_eras.py).

sys.path: tests/standins/ascend_main (main's ops/gdn.py over the 0.23 stand-in),
tests/standins/common. UCM_PATCH_VLLM_ASCEND_VERSION=0.26.0.dev0: main is newer than every
ceiling, so the GDN records are ``untested-version`` unless ``UCM_PATCH_ALLOW_UNTESTED``
allows them. UCM_STANDIN_NATIVE_WAIT=1 adds the wait main gains in vllm-ascend PR #12711
(``_forward_core`` calls ``wait_for_kv_layer_from_connector(self.prefix)`` first), before
activation, the way upstream code is in place when the registry reads it.

Two GDN layers (``AscendGatedDeltaNetAttention``, as register_oot creates them) run two steps
through the installed vLLM's ``qwen_gdn_attention_core`` op.
"""

import os
from types import SimpleNamespace

import ascend_harness as h
import torch
import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn  # noqa: F401 (registers the op)
from vllm_ascend.attention.utils import wait_for_kv_layer_from_connector
from vllm_ascend.ops import gdn as ops_gdn

connector = h.install_connector()

if os.environ.get("UCM_STANDIN_NATIVE_WAIT") == "1":
    pinned_core = ops_gdn.AscendGatedDeltaNetAttention._forward_core

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        """Main after #12711: the layer wait at the start of the GDN core."""
        wait_for_kv_layer_from_connector(self.prefix)
        return pinned_core(self, mixed_qkv, b, a, core_attn_out)

    ops_gdn.AscendGatedDeltaNetAttention._forward_core = _forward_core

registry = h.activate()
result = {"states": h.states(registry), "reasons": h.reasons(registry)}

NAMES = ("model.layers.0.linear_attn", "model.layers.4.linear_attn")
layers = {
    name: h.make_layer(ops_gdn.AscendGatedDeltaNetAttention, name, h.gdn_cache(f"gdn{i}.kv"))
    for i, name in enumerate(NAMES)
}
md = h.tag({name: h.tag(SimpleNamespace(), f"gdn{i}_md") for i, name in enumerate(NAMES)}, "md")
h.set_forward_context(md, layers)
x = torch.ones(2, 4)
for step in range(2):
    for layer in layers.values():
        layer.forward(x)
    result[f"step{step}"] = h.take_log()
h.finish(result, registry)
