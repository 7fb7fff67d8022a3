"""vLLM-Ascend 0.11 scenario (child process of tests/test_patches_ascend_eras.py).

sys.path: tests/standins/ascend_0_11, tests/standins/common. UCM_PATCH_VLLM_VERSION=0.11.0
pairs the installed vLLM with the stand-in's 0.11.0 metadata.
"""

from types import SimpleNamespace

import ascend_harness as h
import torch

registry = h.activate()
connector = h.install_connector()

from vllm_ascend.attention import attention_v1, mla_v1  # noqa: E402
from vllm_ascend.models.qwen3_next import CustomQwen3NextGatedDeltaNet  # noqa: E402

GDN, ATTN, MLA = "model.layers.0.linear_attn", "model.layers.1.self_attn.attn", "model.layers.2.mla"
result = {"states": h.states(registry), "reasons": h.reasons(registry)}

# GDN: two pipeline stages; with virtual_engine = 1 the core uses kv_cache[1] ("ve1").
gdn = h.make_layer(CustomQwen3NextGatedDeltaNet, GDN, [h.gdn_cache("ve0"), h.gdn_cache("ve1")])
attn = SimpleNamespace(
    kv_cache=[
        [torch.zeros(8, 4), torch.zeros(8, 4)],
        [h.tag(torch.zeros(8, 4), "k"), h.tag(torch.zeros(8, 4), "v")],
    ]
)
md = h.tag(
    {GDN: h.tag(SimpleNamespace(), "gdn_md"), ATTN: h.tag(SimpleNamespace(), "attn_md")}, "md_dict"
)
h.set_forward_context(md, {GDN: gdn, ATTN: attn}, virtual_engine=1)
x = torch.ones(2, 4)
gdn._forward(hidden_states=x, output=torch.zeros(2, 4))  # as vLLM 0.11's gdn_attention op
result["gdn_step"] = h.take_log()

attention_v1.unified_ascend_attention_with_output(x, x, x, torch.zeros(2, 4), ATTN)
result["attn_step"] = h.take_log()

mla = mla_v1.AscendMLAImpl()
mla.forward(MLA, x, (h.tag(torch.zeros(8, 4), "mla_cache"),), md, output=torch.zeros(2, 4))
result["mla_step"] = h.take_log()

connector.clear_connector_metadata()  # a step without connector metadata: every hook gated
gdn._forward(hidden_states=x, output=torch.zeros(2, 4))
attention_v1.unified_ascend_attention_with_output(x, x, x, torch.zeros(2, 4), ATTN)
mla.forward(MLA, x, (torch.zeros(8, 4),), md, output=torch.zeros(2, 4))
result["no_metadata"] = h.take_log()
h.finish(result, registry)
