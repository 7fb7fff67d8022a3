"""vLLM-Ascend 0.23 scenario (child process of tests/test_patches_ascend_eras.py).

sys.path: tests/standins/ascend_0_23, tests/standins/common. The installed vLLM 0.32 pairs
with vLLM-Ascend 0.22+ layouts (``QwenGatedDeltaNetAttention``, op
``qwen_gdn_attention_core``), so vLLM's own gdn_layerwise records are in range too;
UCM_PATCH_VLLM_ASCEND_VERSION=0.23.0 keeps the vLLM-Ascend records from being aligned to 0.32.

UCM_SCENARIO_ORDER: ``plugin-first`` (ucm_patch active before vLLM / vLLM-Ascend import, as
with the general plugin) or ``late`` (everything imported, then activated: wrappers nest).
UCM_STANDIN_SOC=310p makes the worker patches pick the 310P GDN core.
"""

import os
from types import SimpleNamespace

import ascend_harness as h
import torch

from ucm_patch.hooks import layerwise

late = os.environ["UCM_SCENARIO_ORDER"] == "late"
registry = None if late else h.activate(include_vllm_gdn=True)
connector = h.install_connector()

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (  # noqa: E402
    QwenGatedDeltaNetAttention,
)

result = {"markers_vllm_import": h.markers(QwenGatedDeltaNetAttention.__dict__["_forward_core"])}

from vllm_ascend.attention import (  # noqa: E402
    dsa_v1,
    mla_v1,
    sfa_v1,
)
from vllm_ascend.attention.attention_v1 import (  # noqa: E402
    AscendAttentionBackendImpl,
    AscendC8AttentionBackendImpl,
    AscendMetadata,
)
from vllm_ascend.attention.context_parallel import dsa_cp  # noqa: E402
from vllm_ascend.attention.context_parallel.attention_cp import AscendAttentionCPImpl  # noqa: E402
from vllm_ascend.ops.gdn import AscendGatedDeltaNetAttention  # noqa: E402

# NPUWorker.__init__: the worker patch copies the Ascend GDN methods onto vLLM's class.
from vllm_ascend.patch.worker import patch_qwen3_5  # noqa: E402, F401

if os.environ.get("UCM_STANDIN_SOC") == "310p":
    from vllm_ascend.patch.worker import patch_idex_310  # noqa: F401

if late:
    registry = h.activate(include_vllm_gdn=True)
result["states"] = h.states(registry)
result["markers_target"] = h.markers(QwenGatedDeltaNetAttention.__dict__["_forward_core"])
result["markers_ascend_class"] = h.markers(AscendGatedDeltaNetAttention.__dict__["_forward_core"])

GDN, OOT, ATTN, MLA, DSA, DSACP, SFA = (
    "model.layers.0.linear_attn",
    "model.layers.1.linear_attn",
    "model.layers.2.self_attn.attn",
    "model.layers.3.mla",
    "model.layers.4.dsa",
    "model.layers.5.dsa",
    "model.layers.6.sfa",
)
gdn = h.make_layer(QwenGatedDeltaNetAttention, GDN, h.gdn_cache("gdn.kv"))
oot = h.make_layer(AscendGatedDeltaNetAttention, OOT, h.gdn_cache("oot.kv"))  # register_oot
md = h.tag({GDN: h.tag(SimpleNamespace(), "gdn_md"), OOT: h.tag(SimpleNamespace(), "oot_md")}, "md")
h.set_forward_context(md, {GDN: gdn, OOT: oot})
x = torch.ones(2, 4)
out = torch.zeros(2, 4)
if os.environ.get("UCM_STANDIN_SOC") != "310p":
    gdn.forward(x, out)  # copied Ascend forward: op -> core, then the anonymous save
else:
    torch.ops.vllm.qwen_gdn_attention_core(x, x, x, out, GDN, False)  # 310P core: "" inside
result["gdn_step"] = h.take_log()
oot.forward(x, out)
result["oot_step"] = h.take_log()
result["calls"] = dict(layerwise.calls)

# Attention family: 0.23 creates no reshape_cache_event at all.
for label, impl, method in (
    ("attn", AscendAttentionBackendImpl(True), "reshape_and_cache"),
    ("attn_c8", AscendC8AttentionBackendImpl(True), "_reshape_and_cache"),
    ("attn_cp", AscendAttentionCPImpl(True), "reshape_and_cache"),
):
    amd = h.tag(AscendMetadata(num_actual_tokens=2, slot_mapping=torch.arange(2)), "attn_md")
    h.set_forward_context(h.tag({ATTN: amd}, "attn_dict"))
    getattr(impl, method)(x, x, x, (torch.zeros(8, 4), torch.zeros(8, 4)), amd, out)
    result[label] = {"log": h.take_log(), "event": h.eid(amd.reshape_cache_event)}

mmd = h.tag(mla_v1.AscendMLAMetadata(num_prefills=1, num_decodes=0), "mla_md")
h.set_forward_context(h.tag({MLA: mmd}, "mla_dict"))
mla_v1.AscendMLAImpl(True, True).forward(
    MLA, x, (h.tag(torch.zeros(8, 4), "mla.kv"),), mmd, output=out
)
result["mla"] = h.take_log()

for label, impl, name in (
    ("dsa", dsa_v1.AscendDSAImpl(), DSA),
    ("dsa_cp", dsa_cp.AscendDSACPImpl(), DSACP),
):
    dmd = h.tag(dsa_v1.AscendDSAMetadata(num_prefills=1), "dsa_md")
    h.set_forward_context(h.tag({name: dmd}, "dsa_dict"))
    impl.forward(name, x, (h.tag(torch.zeros(8, 4), "dsa.kv"),), dmd, output=out)
    result[label] = h.take_log()

smd = h.tag(sfa_v1.AscendSFAMetadata(num_input_tokens=2), "sfa_md")
h.set_forward_context(h.tag({SFA: smd}, "sfa_dict"))
sfa_v1.AscendSFAImpl(enable_mlapo=True).forward(
    SFA, x, tuple(torch.zeros(8, 4) for _ in range(3)), smd, output=out
)
result["sfa_mlapo"] = h.take_log()

connector.clear_connector_metadata()
h.set_forward_context({DSA: dmd})
dsa_v1.AscendDSAImpl().forward(DSA, x, (torch.zeros(8, 4),), dmd, output=out)
h.set_forward_context(md, {GDN: gdn, OOT: oot})
oot.forward(x, out)
result["no_metadata"] = h.take_log()
h.finish(result, registry)
