"""vLLM-Ascend 0.13 scenario (child process of tests/test_patches_ascend_eras.py).

sys.path: tests/standins/ascend_0_13, tests/standins/common; UCM_PATCH_VLLM_VERSION=0.13.0.
The registry is active *before* vLLM-Ascend's worker patch module is imported, as on an NPU
(general plugins run before ``NPUWorker.__init__``).
"""

from types import SimpleNamespace

import ascend_harness as h
import torch

from ucm_patch.hooks import layerwise

registry = h.activate()
connector = h.install_connector()

# NPUWorker.__init__: the worker patch copies the Ascend GDN core onto vLLM's class.
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (  # noqa: E402
    QwenGatedDeltaNetAttention as Qwen3NextGatedDeltaNet,
)
from vllm_ascend.attention import mla_v1, sfa_v1  # noqa: E402
from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl, AscendMetadata  # noqa: E402
from vllm_ascend.attention.context_parallel.attention_cp import AscendAttentionCPImpl  # noqa: E402
from vllm_ascend.patch.worker import patch_qwen3_next  # noqa: E402

GDN, A0, A1, MLA, SFA = (
    "model.layers.0.linear_attn",
    "model.layers.1.self_attn.attn",
    "model.layers.2.self_attn.attn",
    "model.layers.3.mla",
    "model.layers.4.sfa",
)
result = {"states": h.states(registry)}
core = Qwen3NextGatedDeltaNet.__dict__["_forward_core"]
result["core_markers"] = h.markers(core)
result["core_wraps_ascend"] = h.unwraps_to(
    core, patch_qwen3_next.AscendQwen3Next_GatedDeltaNet.__dict__["_forward_core"]
)

gdn = h.make_layer(Qwen3NextGatedDeltaNet, GDN, [h.gdn_cache("ve0"), h.gdn_cache("ve1")])
gdn_md = h.tag(SimpleNamespace(), "gdn_md")
md = h.tag({GDN: gdn_md}, "md_dict")
h.set_forward_context(md, {GDN: gdn}, virtual_engine=1)
x = torch.ones(2, 4)
out = torch.zeros(2, 4)
torch.ops.vllm.qwen_gdn_attention_core(x, x, x, out, GDN, False)  # the op -> _forward_core
result["gdn_op"] = h.take_log()
result["gdn_state_written"] = float(gdn.kv_cache[1][1].sum())  # the cache the core wrote
gdn.forward(x, out)  # the copied Ascend forward -> op -> core
result["gdn_forward"] = h.take_log()


def attention(impl, name, md_obj, kv_len=2):
    kv = tuple(h.tag(torch.zeros(8, 4), f"{name}.kv{i}") for i in range(kv_len))
    impl.reshape_and_cache(x, x, kv, md_obj)
    return md_obj.reshape_cache_event


# One metadata object shared by two layers (as vLLM-Ascend builds it per KV-cache group).
shared = h.tag(AscendMetadata(num_actual_tokens=2, slot_mapping=torch.arange(2)), "attn_md")
producer, consumer = AscendAttentionBackendImpl(True), AscendAttentionBackendImpl(False)
ev_p = attention(producer, A0, shared)
result["producer"] = {"log": h.take_log(), "event": h.eid(ev_p), "records": ev_p.records}
ev_c0 = attention(consumer, A0, shared)
result["consumer_a0"] = {"log": h.take_log(), "event": h.eid(ev_c0)}
consumer_b = AscendAttentionBackendImpl(False)
ev_c1 = attention(consumer_b, A1, shared)
result["consumer_a1"] = {"log": h.take_log(), "event": h.eid(ev_c1)}
ev_c0_again = attention(consumer, A0, AscendMetadata(2, torch.arange(2)))  # next step, layer A0
result["consumer_a0_next_step"] = {
    "log": h.take_log(),
    "event": h.eid(ev_c0_again),
    "records": getattr(ev_c0_again, "records", 0),
}
no_write = AscendMetadata(2, torch.arange(2))
attention(consumer, A0, no_write, kv_len=1)  # no (key_cache, value_cache): nothing written
result["no_write"] = {"log": h.take_log(), "event": h.eid(no_write.reshape_cache_event)}
cp_md = AscendMetadata(2, torch.arange(2))
ev_cp = attention(AscendAttentionCPImpl(True), A0, cp_md)
result["cp_producer"] = {"log": h.take_log(), "event": h.eid(ev_cp)}

# MLA: producer + prefill records natively (in mla_preprocess_prefill); decode-only does not.
mla_cache = (h.tag(torch.zeros(8, 4), "mla.kv"),)
for label, impl_md in (
    ("mla_prefill", mla_v1.AscendMLAMetadata(num_prefills=1, num_decodes=0)),
    ("mla_decode", mla_v1.AscendMLAMetadata(num_prefills=0, num_decodes=1)),
):
    h.tag(impl_md, "mla_md")
    h.set_forward_context(h.tag({MLA: impl_md}, "mla_dict"))
    mla_v1.AscendMLAImpl(is_kv_producer=True).forward(MLA, x, mla_cache, impl_md, output=out)
    result[label] = h.take_log()

# SFA: the mlapo branch (small batch) never waits upstream; the native branch waits once.
sfa_cache = tuple(torch.zeros(8, 4) for _ in range(3))
for label, mlapo, tokens in (("sfa_mlapo", True, 2), ("sfa_native", False, 2)):
    sfa_md = h.tag(sfa_v1.AscendSFAMetadata(num_input_tokens=tokens), "sfa_md")
    h.set_forward_context(h.tag({SFA: sfa_md}, "sfa_dict"))
    sfa_v1.AscendSFAImpl(enable_mlapo=mlapo).forward(SFA, x, sfa_cache, sfa_md, output=out)
    result[label] = h.take_log()

connector.clear_connector_metadata()
h.set_forward_context(md, {GDN: gdn}, virtual_engine=1)
torch.ops.vllm.qwen_gdn_attention_core(x, x, x, out, GDN, False)
h.set_forward_context({SFA: sfa_md})
sfa_v1.AscendSFAImpl(enable_mlapo=True).forward(SFA, x, sfa_cache, sfa_md, output=out)
result["no_metadata"] = h.take_log()
result["kv_ready_layers"] = sorted(layerwise.kv_ready_events)
h.finish(result, registry)
