"""Survey of vLLM 0.22 to 0.33: KV-owning ops and layers that bypass the connector.

Run through ``python scripts/verify_targets.py --survey`` (sources from
``.cache/vllm-src``, fetched by ``--download``); the result is the ``bypass-survey``
section of docs/PATCHES.md. Two inventories, both found mechanically with ``ast`` and
then judged by hand (``OP_DECISIONS`` / ``FAMILY_DECISIONS``):

1. custom ops (``direct_register_custom_op``) whose kernel reads a layer's KV cache
   (``kv_cache`` / ``no_compile_layers``) and is not decorated with
   ``maybe_transfer_kv_layer``;
2. model families of the ``vllm/models/<family>/`` tree (0.27+) that register their own
   layers in ``static_forward_context`` (so own a KV cache) instead of using vLLM's
   hooked ``Attention`` / ``MLAAttention``.

An op or family with no decision is listed as **not reviewed**, so a new vLLM release
shows up here instead of being silently ignored.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed
from tools.verify.source import registered_ops

FIRST, LAST = Version("0.22"), Version("0.34")

COVERED = "covered"
HOOKED = "hooked upstream"
NOT_ATTN = "not an attention path"
LEFT_OUT = "left out"

_STATE = (
    "State-space / linear-attention layer: the same gap as GDN (no connector call in any "
    "vLLM), but outside this patch set's scope (Qwen3-Next / Qwen3.5 GDN and attention ops). "
    "`_layer_hooks.make_op_wrapper(<index of layer_name>)` covers it with one record once a "
    "connector for that model's state exists."
)
_KV_WRITE = (
    "The KV *write* of a layer whose decorated attention op saves it; `kv_ready_event` "
    "overrides this kernel to publish the KV-ready event."
)
_AUX = (
    "Reads an auxiliary cache or no KV at all (indexer keys, sinks, scales, MoE, LoRA, ViT); "
    "the layer's attention op is the hooked one."
)

OP_DECISIONS: dict[str, tuple[str, str]] = {
    "qwen_gdn_attention_core": (
        COVERED,
        "`gdn_layerwise` wraps `_forward_core` / `_forward_core_rocm`.",
    ),
    "qwen_gdn_attention_core_fused_norm_packed": (
        COVERED,
        "`gdn_layerwise@vllm-0.28-fused` wraps `_forward_core_fused_norm_packed`.",
    ),
    "cpu_gdn_attention_core": (COVERED, "`gdn_layerwise@vllm-0.21-cpu` overrides the op kernel."),
    "gdn_attention_core_xpu": (
        LEFT_OUT,
        "XPU Qwen3-Next GDN. The kernel is registered as "
        "`eager_break_during_capture(_gdn_attention_core_xpu_impl)` while `vllm._xpu_ops` is "
        "imported, so a module-attribute wrap never reaches the op and an op-kernel override "
        "would drop the eager break; no XPU here to prove a patch. XPU users get no GDN hooks.",
    ),
    "unified_kv_cache_update": (COVERED, _KV_WRITE),
    "unified_mla_kv_cache_update": (COVERED, _KV_WRITE),
    "fused_rope_and_unified_kv_cache_update": (COVERED, _KV_WRITE),
    "fused_qk_norm_rope_and_unified_kv_cache_update": (COVERED, _KV_WRITE),
    "fused_qk_norm_mrope_and_unified_kv_cache_update": (COVERED, _KV_WRITE),
    "fused_rope_unified_mla_kv_cache_update": (COVERED, _KV_WRITE),
    "kda_attention": (LEFT_OUT, "Kimi-Linear KDA. " + _STATE),
    "bailing_v3_kda_attention": (LEFT_OUT, "Bailing V3 KDA. " + _STATE),
    "olmo_hybrid_gdn_full_forward": (
        LEFT_OUT,
        "OLMo hybrid GDN: the op runs the whole layer (projections included), not a core; "
        + _STATE,
    ),
    "linear_attention": (LEFT_OUT, "MiniMax linear attention. " + _STATE),
    "mamba_mixer": (LEFT_OUT, "Mamba (Jamba, Falcon-Mamba). " + _STATE),
    "mamba_mixer2": (LEFT_OUT, "Mamba2 (Nemotron-H, Granite 4, Zamba2, Bamba). " + _STATE),
    "short_conv": (LEFT_OUT, "LFM2 short convolution. " + _STATE),
    "plamo2_mamba_mixer": (LEFT_OUT, "PLaMo2 Mamba. " + _STATE),
    "qwen4_exp_ple_short_conv": (LEFT_OUT, "Qwen4-Exp short convolution. " + _STATE),
    "deepseek_v4_attention": (
        LEFT_OUT,
        "DeepSeek V4 sparse MLA (0.22 only as an op; a method from 0.23). Each decoder layer "
        "owns several caches registered as separate layers (latent cache, compressor state, "
        "indexer keys); a layerwise save needs a contract per cache that no connector has, "
        "and the kernels are CUDA/ROCm only.",
    ),
    "deepseek_v4_cpu_prepare_and_attn": (
        LEFT_OUT,
        "DeepSeek V4 on CPU: the same multi-cache layer as on GPU (see deepseek_v4_attention).",
    ),
    "qwen4_exp_qsa_with_output": (
        LEFT_OUT,
        "Qwen4-Exp QSA attention (NVIDIA and ROCm builds), experimental family with "
        "GPU-only kernels: not verifiable here; the generic op wrapper applies if a user "
        "needs it.",
    ),
    "qwen4_exp_qsa_prepare_with_output": (
        LEFT_OUT,
        "Qwen4-Exp QSA (fused prepare variant); see qwen4_exp_qsa_with_output.",
    ),
    "sparse_attn_indexer": (
        LEFT_OUT,
        "DeepSeek V3.2-style indexer: its key cache is a second cache of a hooked MLA layer; "
        "vLLM's own decorator does not transfer it either.",
    ),
    "rocm_aiter_gather_kv_b_proj": (NOT_ATTN, _AUX),
    "xpu_fp8_paged_mqa_logits": (NOT_ATTN, _AUX),
    "maybe_populate_sink": (NOT_ATTN, _AUX),
    "maybe_calc_kv_scales": (NOT_ATTN, _AUX),
    "hpc_rope_norm_forward": (NOT_ATTN, _AUX),
    "lora_linear_async": (NOT_ATTN, _AUX),
    "transformers_moe_forward": (NOT_ATTN, _AUX),
    "flashinfer_wrapper": (NOT_ATTN, _AUX),
    "deepseek_v4_mega_moe_experts": (NOT_ATTN, _AUX),
    "qwen4_exp_amd_ple_ngram_embedding": (NOT_ATTN, _AUX),
    "qwen4_exp_amd_ple_ngram_embedding_pinned": (NOT_ATTN, _AUX),
    "qwen4_exp_amd_ple_ngram_ids": (NOT_ATTN, _AUX),
    "qwen4_exp_compute_ple_ngram_ids": (NOT_ATTN, _AUX),
}

_EXPERIMENTAL = (
    "Own attention / cache layers with no connector call. New families of the `vllm/models/` "
    "tree with CUDA/ROCm-only kernels (nothing here can run or prove a wrapper), several "
    "with more than one cache per decoder layer; left out until a user needs one: the "
    "generic wrappers make it one row of a record table."
)
FAMILY_DECISIONS: dict[str, tuple[str, str]] = {
    "kimi_k3": (
        COVERED,
        "MLA: `mla_bypass` (NVIDIA `MultiHeadLatentAttention._attention`, ROCm "
        "`_fused_decode`). Its KDA linear-attention layers are state layers, left out like "
        "the other state-space ops above.",
    ),
    "step5": (HOOKED, "Decorates its own attention ops with `maybe_transfer_kv_layer`."),
    "deepseek_v4": (LEFT_OUT, OP_DECISIONS["deepseek_v4_attention"][1]),
    "deepseek_v41": (LEFT_OUT, "Successor of deepseek_v4, same multi-cache structure."),
    "minimax_m3": (LEFT_OUT, _EXPERIMENTAL),
    "inkling": (LEFT_OUT, _EXPERIMENTAL),
    "glm5next": (LEFT_OUT, "GLM-5-Next KDA layers. " + _STATE),
    "qwen4_exp": (LEFT_OUT, _EXPERIMENTAL),
    "muse_spark": (NOT_ATTN, "Registers a MoE expert layer, not a KV cache."),
}


def _version_dirs(src: Path) -> list[tuple[Version, Path]]:
    out = []
    for d in sorted(src.iterdir()):
        m = re.fullmatch(r"vllm-(\d+\.\d+\.\d+)", d.name)
        if m and FIRST <= Version(m.group(1)) < LAST:
            out.append((Version(m.group(1)), d / "vllm"))
    return sorted(out)


def _bypassing_ops(root: Path) -> dict[str, str]:
    """op name -> file, for KV-reading custom ops without the connector decorator."""
    found: dict[str, str] = {}
    for path in root.rglob("*.py"):
        src = path.read_text(errors="replace")
        if "direct_register_custom_op" not in src:
            continue
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for name, func in registered_ops(tree):
            base = ast.unparse(func).split("(")[-1].rstrip(")").split(".")[-1]
            fn = defs.get(base)
            if fn is None:
                continue
            body = ast.get_source_segment(src, fn) or ""
            decorated = any("maybe_transfer_kv_layer" in ast.unparse(d) for d in fn.decorator_list)
            if not decorated and ("kv_cache" in body or "no_compile_layers" in body):
                found[name] = str(path.relative_to(root.parent))
    return found


def _families(root: Path) -> dict[str, list[str]]:
    """family -> files that register their own layer in static_forward_context."""
    models = root / "models"
    out: dict[str, list[str]] = {}
    if not models.exists():
        return out
    for path in sorted(models.rglob("*.py")):
        if "static_forward_context[" in path.read_text():
            family = path.relative_to(models).parts[0]
            out.setdefault(family, []).append(str(path.relative_to(root.parent)))
    return out


def _span(versions: list[Version]) -> str:
    return f"{versions[0]}" if len(versions) == 1 else f"{versions[0]} to {versions[-1]}"


def survey_markdown(src: Path) -> str:
    ops: dict[str, tuple[list[Version], str]] = {}
    fams: dict[str, tuple[list[Version], set[str]]] = {}
    dirs = _version_dirs(src)
    if not dirs:
        raise FileNotFoundError(f"no vLLM 0.22+ sources under {src}: run --download first")
    for ver, root in dirs:
        for op, where in _bypassing_ops(root).items():
            ops.setdefault(op, ([], where))[0].append(ver)
        for fam, files in _families(root).items():
            entry = fams.setdefault(fam, ([], set()))
            entry[0].append(ver)
            entry[1].update(files)
    lines = [
        "## Attention ops that bypass the connector (survey of vLLM 0.22 to 0.33)",
        "",
        "Generated by `python scripts/verify_targets.py --survey` (scripts/survey_bypass.py) "
        "from the wheels of " + ", ".join(str(v) for v, _ in dirs) + ". Found with `ast`: "
        "custom ops whose kernel reads a layer's KV cache without `maybe_transfer_kv_layer`, "
        "and `vllm/models/<family>/` layers that own a cache. Verdicts are reviewed by hand; "
        "anything new shows as **not reviewed**.",
        "",
        "### Custom ops",
        "",
        "| op | file (newest) | vLLM | verdict | why |",
        "|---|---|---|---|---|",
    ]
    for op in sorted(ops):
        versions, where = ops[op]
        verdict, why = OP_DECISIONS.get(op, ("**not reviewed**", ""))
        lines.append(f"| `{op}` | `{where}` | {_span(versions)} | {verdict} | {why} |")
    lines += [
        "",
        "### `vllm/models/<family>/` layers with their own cache",
        "",
        "| family | vLLM | files | verdict | why |",
        "|---|---|---|---|---|",
    ]
    for fam in sorted(fams):
        versions, files = fams[fam]
        verdict, why = FAMILY_DECISIONS.get(fam, ("**not reviewed**", ""))
        shown = ", ".join(f"`{f.removeprefix('vllm/models/')}`" for f in sorted(files)[:4])
        more = f" (+{len(files) - 4})" if len(files) > 4 else ""
        lines.append(f"| `{fam}` | {_span(versions)} | {shown}{more} | {verdict} | {why} |")
    return "\n".join(lines)
