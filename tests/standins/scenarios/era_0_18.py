"""vLLM-Ascend 0.18 scenario (child process of tests/test_patches_ascend_eras.py).

sys.path: tests/standins/ascend_0_18, tests/standins/common. The installed vLLM (0.32) is
not gated down: UCM_PATCH_VLLM_ASCEND_VERSION=0.18.0 forces the vLLM-Ascend records, so
vLLM's own gdn_layerwise record applies to the installed GDN class first, exactly as on an
NPU: vLLM's wrapper is in place when vLLM-Ascend's worker patch overwrites the method.
VLLM_VERSION (read by the stand-in's vllm_version_is) picks the 0.18 KV-cache index.
"""

from types import SimpleNamespace

import ascend_harness as h
import torch

from ucm_patch.hooks import layerwise

registry = h.activate(include_vllm_gdn=True)
connector = h.install_connector()

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (  # noqa: E402
    QwenGatedDeltaNetAttention as Qwen3NextGatedDeltaNet,
)

result = {
    "markers_before_worker_patch": h.markers(Qwen3NextGatedDeltaNet.__dict__["_forward_core"])
}

# NPUWorker.__init__ imports the worker patches: plain re-assignment of the GDN methods.
from vllm_ascend.attention import mla_v1  # noqa: E402
from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl, AscendMetadata  # noqa: E402
from vllm_ascend.patch.worker import patch_qwen3_5, patch_qwen3_next  # noqa: E402

result["states"] = h.states(registry)
result["markers_after_worker_patch"] = h.markers(Qwen3NextGatedDeltaNet.__dict__["_forward_core"])
result["qwen3_5_markers"] = h.markers(patch_qwen3_5.Qwen3_5GatedDeltaNet.__dict__["_forward_core"])

GDN, GDN35, ATTN, MLA = (
    "model.layers.0.linear_attn",
    "model.layers.1.linear_attn",
    "model.layers.2.self_attn.attn",
    "model.layers.3.mla",
)
gdn = h.make_layer(Qwen3NextGatedDeltaNet, GDN, [h.gdn_cache("ve0"), h.gdn_cache("ve1")])
gdn35 = h.make_layer(
    patch_qwen3_5.Qwen3_5GatedDeltaNet, GDN35, [h.gdn_cache("q35.ve0"), h.gdn_cache("q35.ve1")]
)
md = h.tag(
    {GDN: h.tag(SimpleNamespace(), "gdn_md"), GDN35: h.tag(SimpleNamespace(), "gdn35_md")}, "md"
)
h.set_forward_context(md, {GDN: gdn, GDN35: gdn35}, virtual_engine=1)
x = torch.ones(2, 4)
out = torch.zeros(2, 4)

gdn.forward(x, out)  # Ascend forward: GDN op, then maybe_save_kv_layer_to_connector("", [])
result["gdn_forward"] = h.take_log()
torch.ops.vllm.qwen_gdn_attention_core(x, x, x, out, GDN35, False)  # Qwen3.5: "" call in core
result["gdn35_op"] = h.take_log()
patch_qwen3_next.maybe_save_kv_layer_to_connector("", [])  # the filter drops only ""...
patch_qwen3_next.maybe_save_kv_layer_to_connector("a.real.layer", [])  # ...not real names
result["binding_direct"] = h.take_log()
result["calls"] = dict(layerwise.calls)

# reshape_and_cache (0.16+ signature): producer records natively, consumer gets ours.
for label, producer in (("attn_producer", True), ("attn_consumer", False)):
    amd = h.tag(AscendMetadata(num_actual_tokens=2, slot_mapping=torch.arange(2)), "attn_md")
    h.set_forward_context(h.tag({ATTN: amd}, "attn_dict"))
    kv = (torch.zeros(8, 4), torch.zeros(8, 4))
    AscendAttentionBackendImpl(producer).reshape_and_cache(x, x, x, kv, amd, out)
    result[label] = {"log": h.take_log(), "event": h.eid(amd.reshape_cache_event)}

# MLA 0.18: a kv_both producer gets no upstream event (is_kv_producer and not is_kv_both).
for label, both in (("mla_kv_producer", False), ("mla_kv_both", True)):
    mmd = h.tag(mla_v1.AscendMLAMetadata(num_prefills=1, num_decodes=0), "mla_md")
    h.set_forward_context(h.tag({MLA: mmd}, "mla_dict"))
    impl = mla_v1.AscendMLAImpl(is_kv_producer=True, is_kv_both=both)
    impl.forward(MLA, x, (h.tag(torch.zeros(8, 4), "mla.kv"),), mmd, output=out)
    result[label] = h.take_log()
h.finish(result, registry)
