"""Survey of every KV-cache write site in one vLLM release (0.33), for ``kv_ready_event``.

``kv_ready_event`` publishes a per-layer event right after the layer's KV write, so a
layerwise dump waits for exactly that write. It wraps the ops vLLM writes through
(``unified_kv_cache_update``, ``unified_mla_kv_cache_update`` and the fused RoPE+write ops).
This survey finds, mechanically with ``ast``, every call of a KV-write primitive
(:data:`PRIMITIVES`) in the release, outside the op-binding modules, keyed by the enclosing
function; each site is then judged by hand in :data:`DECISIONS`. A site with no decision
is listed as **not reviewed** and fails tests/test_kv_write_survey.py, so a new release
cannot add a write nobody looked at.

Run through ``python scripts/verify_targets.py --survey`` (sources in ``.cache/vllm-src``,
fetched by ``--download``): it writes ``scripts/data/kv_write_sites.json`` (the sites, so the
tests need no source) and the ``kv-write-survey`` section of docs/PATCHES.md.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

VERSION = "0.33.0"
REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "scripts" / "data" / "kv_write_sites.json"
SECTION = "kv-write-survey"

# Calls that write a layer's paged KV cache (ops, backend methods, the op entry points).
PRIMITIVES = frozenset(
    {
        "reshape_and_cache",
        "reshape_and_cache_flash",
        "concat_and_cache_mla",
        "concat_and_cache_ds_mla",
        "indexer_k_quant_and_cache",
        "do_kv_cache_update",
        "unified_kv_cache_update",
        "unified_mla_kv_cache_update",
        "precompute_and_store_context_kv",
    }
)
# Also a write: any call whose name contains these (Triton / CPU / ROCm variants of the
# cache-write kernels), and these ops of single models (a second survey found them).
PRIMITIVE_PARTS = ("reshape_and_cache", "concat_and_cache", "_kv_insert")
MODEL_WRITE_OPS = frozenset({"populate_sink_kv", "hpc_rope_norm_forward", "fused_norm_rope"})
# Modules that only bind kernels to Python names (the primitives themselves).
BINDING_MODULES = ("vllm._custom_ops", "vllm._ipex_ops", "vllm._xpu_ops", "vllm._aiter_ops")
# Modules that implement a primitive (their internal kernel launches are not sites).
KERNEL_MODULES = (
    "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
    "vllm.v1.attention.ops.int4_per_token_head",
)

COVERED = "covered"
TRANSITIVE = "covered (runs inside a covered op)"
REWRITTEN = "covered (the layer's own covered write follows)"
IN_SAVE_OP = "fallback is exact"
NO_SAVE = "no connector save on this path"
NOT_RUN = "never executed"
LEFT_OUT = "left out"

_BACKEND = (
    "A backend's `do_kv_cache_update`: called from `unified_kv_cache_update` (or the MLA op), "
    "whose wrapper records the event when it returns."
)
_IN_OP_NO_FACTORY = (
    "The write sits inside the attention op vLLM's `maybe_transfer_kv_layer` saves right "
    "after: the dumper's fallback, a current-stream event recorded at save time, follows it "
    "with nothing of this layer in between."
)
_IN_OP = (
    "The backend writes inside its own `forward` (`forward_includes_kv_cache_update`). "
    + _IN_OP_NO_FACTORY
    + " The impl class is built inside a factory function (no module attribute to wrap)."
)
_NO_SAVE = (
    "This path makes no connector call at all (no `maybe_transfer_kv_layer`), so there is no "
    "dump for an event to order; it is a connector bypass, listed in the bypass survey."
)
_PATTERN = (
    "A torch.compile pattern-matcher template: traced to build the graph pattern the fusion "
    "pass replaces by a fused op (whose kernel `kv_ready_event` wraps), never run for a "
    "request."
)
_DRAFTER = (
    "Spec-decode drafter (DFlash family): writes the context KV of the drafter's vLLM "
    "`Attention` layers before the drafter runs; each layer's own forward then writes "
    "through `unified_kv_cache_update` on the same stream in the same step, so the event "
    "re-recorded there follows this write too. Target-model layers never come here."
)
_EXPERIMENTAL = (
    "A `vllm/models/` family with CUDA/ROCm-only kernels and its own attention layers that "
    "make no connector call (bypass survey: left out); no dump to order."
)

# "module:qualname" of the enclosing function -> (category, reason or covering record id)
DECISIONS: dict[str, tuple[str, str]] = {
    "vllm.model_executor.layers.attention.attention:unified_kv_cache_update": (
        COVERED,
        "kv_ready_event@vllm-0.16",
    ),
    "vllm.model_executor.layers.attention.attention:Attention.forward": (
        COVERED,
        "kv_ready_event@vllm-0.16",
    ),
    "vllm.model_executor.layers.attention.mla_attention:MLAAttention.forward": (
        COVERED,
        "kv_ready_event@vllm-0.17-mla",
    ),
    "vllm.model_executor.layers.attention.mla_attention:MLAAttention.update_kv_cache": (
        TRANSITIVE,
        "Called by the op `unified_mla_kv_cache_update` (covered). Its other caller, "
        "`MLAAttention.forward`'s `use_direct_call` branch, runs only where the platform's "
        "`opaque_attention_op()` is False (none of CUDA, ROCm, XPU, CPU in 0.33) and calls "
        "`forward_impl` directly, without vLLM's connector save: " + _NO_SAVE,
    ),
    "vllm.model_executor.layers.attention.cross_attention:"
    "create_cross_attention_backend.CrossAttentionImpl.forward": (
        IN_SAVE_OP,
        "Encoder-decoder cross-attention (Whisper, ...). " + _IN_OP,
    ),
    "vllm.model_executor.models.whisper_causal:"
    "create_whisper_attention_backend_with_block_pooling."
    "WhisperCausalAttentionWithBlockPoolingImpl.forward": (
        IN_SAVE_OP,
        "Causal Whisper with block pooling. " + _IN_OP,
    ),
    "vllm.model_executor.layers.sparse_attn_indexer:sparse_attn_indexer": (
        LEFT_OUT,
        "DeepSeek-V3.2 / GLM indexer keys: an auxiliary cache written inside the sparse "
        "indexer op, read by the same layer's attention; the layer's latent KV goes through "
        "the covered MLA op. A connector dumping the indexer cache too would need an event "
        "here (one more op-kernel row of kv_ready_event).",
    ),
    "vllm.model_executor.models.extract_hidden_states:unified_kv_cache_update": (
        LEFT_OUT,
        "`extract_hidden_states` (exports hidden states for training speculators): its own "
        "op of the same name writes the hidden states into the cache-only layer's KV cache; "
        "`dummy_attention` (`@maybe_transfer_kv_layer`) then saves that layer. Not attention "
        "KV and not a serving path; an op-kernel row of `kv_ready_event` over this op would "
        "cover it (layer name: argument 1).",
    ),
    "vllm.model_executor.models.extract_hidden_states:CacheOnlyAttentionLayer.forward": (
        LEFT_OUT,
        "Calls the module's own `unified_kv_cache_update` above (same reason).",
    ),
    "vllm.models.deepseek_v32.attention:DeepseekV32Attention._sparse_indexer_and_attn": (
        NO_SAVE,
        "DeepSeek-V3.2 overrides `MLAAttention.forward` and writes in "
        "`_sparse_indexer_and_attn` (@eager_break_during_capture). " + _NO_SAVE,
    ),
    "vllm.models.step5.nvidia.model:Step5Attention.forward": (
        COVERED,
        "kv_ready_event@vllm-0.16",
    ),
    "vllm.models.step5.nvidia.model:Step5SparseAttention._forward_dsa_attention": (
        COVERED,
        "kv_ready_event@vllm-0.16",
    ),
    "vllm.v1.attention.backend:MLAAttentionImpl.do_kv_cache_update": (TRANSITIVE, _BACKEND),
    "vllm.v1.attention.backends.b12x:B12xPagedAttentionImpl.do_kv_cache_update": (
        TRANSITIVE,
        _BACKEND,
    ),
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.do_kv_cache_update": (
        TRANSITIVE,
        _BACKEND,
    ),
    "vllm.v1.attention.backends.flashinfer:FlashInferImpl.do_kv_cache_update": (
        TRANSITIVE,
        _BACKEND,
    ),
    "vllm.v1.attention.backends.flex_attention:FlexAttentionImpl.do_kv_cache_update": (
        TRANSITIVE,
        _BACKEND,
    ),
    "vllm.v1.attention.backends.rocm_aiter_fa:AiterFlashAttentionImpl.do_kv_cache_update": (
        TRANSITIVE,
        _BACKEND,
    ),
    "vllm.v1.attention.backends.rocm_aiter_unified_attn:"
    "RocmAiterUnifiedAttentionImpl.do_kv_cache_update": (TRANSITIVE, _BACKEND),
    "vllm.v1.attention.backends.rocm_attn:RocmAttentionImpl.do_rope_and_kv_cache_update": (
        TRANSITIVE,
        "ROCm's fused RoPE + write, called from its `do_kv_cache_update` path. " + _BACKEND,
    ),
    "vllm.v1.attention.backends.hpc_attn:HpcAttentionImpl.forward": (
        IN_SAVE_OP,
        "HPC attention backend: it writes inside its own `forward` "
        "(`forward_includes_kv_cache_update`). " + _IN_OP_NO_FACTORY,
    ),
    "vllm.v1.attention.ops.paged_attn:PagedAttention.write_to_paged_cache": (
        TRANSITIVE,
        "ROCm's native paged layout (block size 16 / 32), called from "
        "`RocmAttentionImpl.do_kv_cache_update`. " + _BACKEND,
    ),
    "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model.precompute_and_store_context_kv": (
        REWRITTEN,
        _DRAFTER,
    ),
    "vllm.model_executor.models.qwen3_dflash:DFlashQwen3ForCausalLM.precompute_and_store_context_kv": (  # noqa: E501
        IN_SAVE_OP,
        _DRAFTER,
    ),
    "vllm.model_executor.models.laguna_dflash:DFlashLagunaForCausalLM.precompute_and_store_context_kv": (  # noqa: E501
        IN_SAVE_OP,
        _DRAFTER,
    ),
    "vllm.models.beam.nvidia.dflash2:DFlash2BeamForCausalLM.precompute_and_store_context_kv": (
        REWRITTEN,
        _DRAFTER,
    ),
    "vllm.v1.spec_decode.dflash:DFlashProposer.dummy_run": (REWRITTEN, _DRAFTER),
    "vllm.v1.spec_decode.dflash:DFlashProposer.build_model_inputs_first_pass": (
        REWRITTEN,
        _DRAFTER,
    ),
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator._precompute_context_kv": (
        REWRITTEN,
        _DRAFTER,
    ),
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.propose": (
        REWRITTEN,
        _DRAFTER,
    ),
    "vllm.models.muse_spark.common.dspark:MuseSparkDSparkModel.precompute_and_store_context_kv": (
        REWRITTEN,
        _DRAFTER,
    ),
    "vllm.models.kimi_k3.nvidia.dspark_mla:K3DSparkModel._precompute_fused_context_kv": (
        REWRITTEN,
        _DRAFTER,
    ),
    "vllm.models.kimi_k3.nvidia.dspark_mla:K3DSparkForCausalLM.precompute_and_store_context_kv": (
        REWRITTEN,
        _DRAFTER,
    ),
    "vllm.models.dots3_note.nvidia.attention:Dots3NotePaddedSparseImpl.do_kv_cache_update": (
        LEFT_OUT,
        _EXPERIMENTAL,
    ),
    "vllm.models.minimax_m3.amd.model:MiniMaxM3SparseAttention._insert_aiter_sparse_pa_kv": (
        LEFT_OUT,
        _EXPERIMENTAL,
    ),
    "vllm.models.glm5next.nvidia.sparse_indexer:sparse_attn_indexer_kpool": (
        LEFT_OUT,
        _EXPERIMENTAL,
    ),
    "vllm.models.qwen4_exp.amd.qsa:Qwen4ExpQSAFlashAttentionImpl.do_kv_cache_update": (
        LEFT_OUT,
        _EXPERIMENTAL,
    ),
    "vllm.models.qwen4_exp.amd.qsa:Qwen4ExpQSAAttention._run_qsa": (LEFT_OUT, _EXPERIMENTAL),
    "vllm.models.qwen4_exp.nvidia.qsa:Qwen4ExpQSAAttention._run_qsa": (LEFT_OUT, _EXPERIMENTAL),
    "vllm.compilation.passes.fusion.mla_rope_kvcache_cat_fusion:"
    "fused_rope_unified_mla_kv_cache_update_impl": (
        COVERED,
        "kv_ready_event@vllm-0.22-mla-rope-fused",
    ),
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward": (
        IN_SAVE_OP,
        "The CPU backend's forward writes itself only on its own-write branch. "
        + _IN_OP_NO_FACTORY,
    ),
    "vllm.platforms.cpu:CpuPlatform.pack_kv_cache": (
        NOT_RUN,
        "Repacks the CPU KV cache's layout once when the cache is created, before any "
        "request: no dump to order.",
    ),
    "vllm.model_executor.layers.attention.static_sink_attention:StaticSinkAttention."
    "populate_sink_kv": (
        LEFT_OUT,
        "openPangu's static sink tokens: their KV is written once when the layer is first "
        "used, not per request, and they are not prefix-cache blocks.",
    ),
    "vllm.model_executor.layers.attention.static_sink_attention:maybe_populate_sink": (
        LEFT_OUT,
        "Calls `populate_sink_kv` above (same reason).",
    ),
    "vllm.model_executor.layers.hpc.rope_norm:HpcRopeNorm.forward_cuda": (
        LEFT_OUT,
        "HunYuan-V3 with the HPC attention backend (CUDA only, one model): its fused RoPE + "
        "norm + KV write op `vllm::hpc_rope_norm_forward` (layer name: argument 2) would be "
        "one more op-kernel row of `kv_ready_event`.",
    ),
    "vllm.models.deepseek_v32.attention:DeepseekV32Attention.forward": (
        NO_SAVE,
        "DeepSeek-V3.2's `fused_norm_rope` writes the latent KV. " + _NO_SAVE,
    ),
    "vllm.models.deepseek_v32.amd.rocm:DeepseekV32MLAAttention._fused_attention": (
        NO_SAVE,
        "The ROCm twin of DeepSeek-V3.2's attention. " + _NO_SAVE,
    ),
    "vllm.models.kimi_k3.amd.mla:KimiK3MultiHeadLatentAttentionWrapper._fused_decode": (
        IN_SAVE_OP,
        "Kimi-K3 MLA on ROCm: `mla_bypass@vllm-0.32-kimi-k3-amd` saves when this method "
        "returns, so the save-time event follows the write with nothing in between.",
    ),
}
for _family in ("deepseek_v4", "deepseek_v41", "minimax_m3", "muse_spark"):
    DECISIONS[f"vllm.models.{_family}."] = (LEFT_OUT, _EXPERIMENTAL)
for _prefix in (
    "vllm.compilation.passes.fusion.mla_rope_kvcache_cat_fusion:MLARoPEKVCacheCatPattern.pattern.",
    "vllm.compilation.passes.fusion.qk_norm_rope_kvcache_fusion:QkNormRopeKvCachePattern.",
    "vllm.compilation.passes.fusion.rope_kvcache_fusion:",
):
    DECISIONS[_prefix] = (NOT_RUN, _PATTERN)  # a prefix: every pattern function under it
for _family in ("v4.amd", "v4.nvidia", "v4.xpu", "v41.amd", "v41.nvidia"):
    DECISIONS[f"vllm.models.deepseek_{_family}.dspark:DSparkDeepseekV4ForCausalLM."] = (
        LEFT_OUT,
        _EXPERIMENTAL,
    )


# -- finding ---------------------------------------------------------------------------------
def find_sites(root: Path) -> list[dict[str, Any]]:
    """Every call of a primitive under ``root`` (a ``vllm/`` folder), outside the binding
    modules: ``{"site": "module:qualname", "call": name, "line": n}`` sorted."""
    out: list[dict[str, Any]] = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        if module in BINDING_MODULES or module in KERNEL_MODULES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        _visit(tree, module, [], out)
    return sorted(out, key=lambda s: (s["site"], s["line"]))


def _visit(node: ast.AST, module: str, qual: list[str], out: list[dict[str, Any]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _visit(child, module, [*qual, child.name], out)
            continue
        if isinstance(child, ast.Call):
            fn = child.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if is_write(name):
                site = f"{module}:{'.'.join(qual) or '<module>'}"
                out.append({"site": site, "call": name, "line": child.lineno})
        _visit(child, module, qual, out)


def is_write(name: str | None) -> bool:
    """Whether a call of ``name`` writes a KV cache (:data:`PRIMITIVES` and relatives)."""
    if not name:
        return False
    return name in PRIMITIVES or name in MODEL_WRITE_OPS or any(p in name for p in PRIMITIVE_PARTS)


def decision(site: str) -> tuple[str, str] | None:
    """The decision for ``site``: exact, else the longest prefix entry ending in ``.``/``:``."""
    if site in DECISIONS:
        return DECISIONS[site]
    prefixes = [k for k in DECISIONS if k.endswith((".", ":")) and site.startswith(k)]
    if prefixes:
        return DECISIONS[max(prefixes, key=len)]
    if site.startswith("vllm.v1.attention.backends.") and site.endswith(".do_kv_cache_update"):
        return (TRANSITIVE, _BACKEND)  # every backend's write method, called by the op
    return None


# -- data and docs -----------------------------------------------------------------------------
def write_data(src: Path) -> dict[str, Any]:
    root = src / f"vllm-{VERSION}" / "vllm"
    data = {
        "about": "Written by scripts/verify_targets.py --survey (scripts/survey_kv_writes.py).",
        "version": VERSION,
        "sites": find_sites(root),
    }
    DATA.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return data


def load_data() -> dict[str, Any]:
    return json.loads(DATA.read_text(encoding="utf-8"))


def survey_markdown(data: dict[str, Any]) -> str:
    """The ``kv-write-survey`` section body, from the committed site list."""
    by_site: dict[str, list[str]] = {}
    for s in data["sites"]:
        by_site.setdefault(s["site"], []).append(f"{s['call']}:{s['line']}")
    lines = [
        f"## KV-cache write survey (vLLM {data['version']})",
        "",
        "<!-- Written by scripts/verify_targets.py --survey from scripts/data/"
        "kv_write_sites.json; tests/test_kv_write_survey.py fails on a site with no "
        "decision or a stale section. -->",
        "",
        "Every call of a KV-write primitive (`" + "`, `".join(sorted(PRIMITIVES)) + "`; "
        "any call whose name contains `"
        + "`, `".join(PRIMITIVE_PARTS)
        + "`; and `"
        + "`, `".join(sorted(MODEL_WRITE_OPS))
        + "`) in "
        f"vLLM {data['version']}, found with `ast`, by enclosing function, and whether "
        "`kv_ready_event` publishes the layer's KV-ready event after it. *covered*: a "
        "`kv_ready_event` record wraps it; *fallback is exact*: the write sits inside the "
        "attention op vLLM saves right after, so the dumper's save-time event follows it "
        "with nothing in between; *no connector save*: the path never calls the connector, "
        "so no dump waits for it; *left out*: reason given.",
        "",
        "| site | calls | decision | why / record |",
        "|---|---|---|---|",
    ]
    for site, calls in by_site.items():
        found = decision(site)
        category, why = found if found else ("**not reviewed**", "")
        short = site.replace("vllm.model_executor.", "…").replace("vllm.", "")
        lines.append(f"| `{short}` | {', '.join(calls)} | {category} | {why} |")
    return "\n".join(lines)
