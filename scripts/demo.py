"""`make demo`: real vLLM (CPU) with the ucm_patch plugin and UCMPatchConnector.

Three vLLM processes (vLLM's KV-transfer state is per process) on the embedded local store
in a fresh temporary directory:

1. tiny Qwen3 (attention only), one process: request 1 misses and dumps its prefix;
   vLLM's own prefix cache is then reset, so request 2 (same prefix) can only hit the
   store: it loads row by row during the forward. Its output is compared with a
   recomputation.
2. tiny Qwen3-Next laid out like the released checkpoints (3 GDN layers per attention
   layer, several mamba KV-cache groups; vLLM's hybrid KV-cache manager kept on), across
   two processes: the first computes and dumps a prefix and exits; a fresh one hits it,
   restoring every group's GDN conv/SSM state (loaded between steps), and compares its
   output with a recomputation.

Block sizes are the ones vLLM chose in each run (they depend on the CPU). Then one report:
the patch status table, hook calls per layer kind, dumps done, tokens served from the
cache, time to first token on miss and on hit. Usage: ``.venv/bin/python scripts/demo.py``
(models from ``make models``).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # bf16 + CPU: single process (see README)
    "VLLM_PLUGINS": "ucm_patch",
}
# kind -> (model, prefix length in blocks, phases: each one vLLM process, in order, dtype).
# float32 for the attention-only model: with bf16, vLLM's CPU attention over a cached prefix
# and a one-pass prefill of the same 2,000 tokens differ in the last bits on AVX-512 CPUs
# (also without ucm_patch's changes), so "identical to recomputation" would test the kernel.
MODELS = {
    "qwen3": (REPO / "models" / "tiny-qwen3", 15, ("both",), "float32"),
    "qwen3_next_3to1": (
        REPO / "models" / "tiny-qwen3-next-3to1",
        2,
        ("dump", "load"),
        "bfloat16",
    ),
}


# ======================================================================================
# Child: one vLLM process
# ======================================================================================
def _generate(llm: Any, ids: list[int], max_tokens: int, salt: str | None = None) -> Any:
    from vllm import SamplingParams

    request: dict[str, Any] = {"prompt_token_ids": ids}
    if salt:
        request["cache_salt"] = salt
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([request], params, use_tqdm=False)[0]
    return out, time.perf_counter() - t0


def _flush(llm: Any) -> bool:
    """Let finished dumps be reported, then drop vLLM's own prefix cache."""
    from ucm_patch import connector

    return connector.release_finished(llm) and bool(llm.reset_prefix_cache())


def _same_output(a: Any, b: Any) -> bool:
    def of(out: Any) -> tuple[list[int], list[float]]:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        return ids, [lp[t].logprob for lp, t in zip(comp.logprobs, ids, strict=True)]

    return of(a) == of(b)


def child(kind: str, phase: str, store_dir: str, out_path: str) -> int:
    """One vLLM process: ``both`` dumps and loads; ``dump`` / ``load`` do one half."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    import ucm_patch
    from ucm_patch import connector
    from ucm_patch.hooks import layerwise

    model, blocks, _phases, dtype = MODELS[kind]
    llm = LLM(
        model=str(model),
        dtype=dtype,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=False,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="UCMPatchConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"store": "local", "local_path": store_dir},
            kv_load_failure_policy="recompute",
        ),
    )
    block = llm.llm_engine.vllm_config.cache_config.block_size  # chosen by vLLM for this CPU
    prefix = [random.Random(7).randrange(4, 1000) for _ in range(blocks * block + 40)]
    rng = random.Random(phase)
    for i in range(2):  # warm-up at the same length (first large prefills are slow)
        _generate(llm, [rng.randrange(4, 1000) for _ in range(len(prefix))], 1, f"warm{i}")
    flushed = _flush(llm)
    result: dict[str, Any] = {"model": model.name, "prompt_tokens": len(prefix) + 2}
    result["block"] = block
    result["pid"] = os.getpid()
    before = connector.stats()
    if phase in ("both", "dump"):
        # Time to first token = a 1-token generation (prefill + first sample).
        _out, result["ttft_miss_s"] = _generate(llm, [*prefix, 11, 12], 1)
        flushed = _flush(llm) and flushed
    after_miss = connector.stats()
    result["dumps"] = {k: after_miss[k] - before[k] for k in ("dump_blocks", "dumps_completed")}
    if phase in ("both", "load"):
        hit, result["ttft_hit_s"] = _generate(llm, [*prefix, 21, 22], 1)
        after_hit = connector.stats()
        recomputed, _t = _generate(llm, [*prefix, 21, 22], 1, salt="recompute")
        vocab = llm.llm_engine.model_config.get_vocab_size()
        comp = hit.outputs[0]
        result |= {
            "hit_tokens": after_hit["hit_tokens"] - after_miss["hit_tokens"],
            "cached_tokens_reported_by_vllm": hit.num_cached_tokens,
            "load": {
                k: after_hit[k] - after_miss[k]
                for k in ("loads_layerwise", "loads_sync_fallback", "loads_async", "loaded_pages")
            },
            "same_as_recompute": _same_output(hit, recomputed),
            "uniform_logits": all(
                abs(lp[t].logprob + math.log(vocab)) < 1e-3
                for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)
            ),
        }
    conn = connector.active_connectors()[0]
    kinds = {layer: g.kind for g in conn.layout.groups for layer in g.layers}
    result["mamba_groups"] = len(conn.layout.mamba_groups)
    calls = conn.layer_calls()
    per_kind: dict[str, dict[str, int]] = {}
    for layer, kind_name in kinds.items():
        row = per_kind.setdefault(kind_name, {"layers": 0, "wait": 0, "save": 0})
        row["layers"] += 1
        row["wait"] += calls["wait"].get(layer, 0)
        row["save"] += calls["save"].get(layer, 0)
    result |= {
        "flushed": flushed,
        "hooks_per_kind": per_kind,
        "patch_hook_calls": dict(layerwise.calls),
        "report": ucm_patch.report(),
        "stats": connector.stats(),
    }
    Path(out_path).write_text(json.dumps(result))
    return 0


# ======================================================================================
# Parent: run both, print the report
# ======================================================================================
def _run(kind: str, phase: str, store_dir: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{kind}-{phase}.json"
    env = {**os.environ, **ENV}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, phase, str(store_dir), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"demo: the {kind} {phase} run failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report per model: the dump process's miss, the load process's hit."""
    merged = dict(runs[-1])
    merged["ttft_miss_s"] = runs[0]["ttft_miss_s"]
    merged["dumps"] = runs[0]["dumps"]
    merged["pids"] = [r["pid"] for r in runs]
    merged["flushed"] = all(r["flushed"] for r in runs)
    for kind_name, row in merged["hooks_per_kind"].items():
        for r in runs[:-1]:
            other = r["hooks_per_kind"][kind_name]
            row["wait"] += other["wait"]
            row["save"] += other["save"]
    return merged


def _status_table(report: list[dict[str, Any]]) -> str:
    from ucm_patch.status_table import format_table

    shown = [r for r in report if r["state"] != "skipped-version"]
    skipped = len(report) - len(shown)
    return format_table(shown) + f"\n({skipped} records for other versions/libraries skipped)"


def _section(r: dict[str, Any]) -> str:
    names = {"attention": "attention", "mamba": "GDN"}
    kinds = ", ".join(
        f"{names.get(kind, kind)}: {v['layers']} layer(s), {v['wait']} wait / {v['save']} save"
        for kind, v in r["hooks_per_kind"].items()
    )
    load = ", ".join(f"{k}={v}" for k, v in r["load"].items() if v)
    speedup = r["ttft_miss_s"] / r["ttft_hit_s"] if r["ttft_hit_s"] else float("nan")
    procs = (
        f"dumped by process {r['pids'][0]}, loaded by a fresh process {r['pids'][1]}"
        if len(r["pids"]) > 1
        else f"one process ({r['pids'][0]})"
    )
    return "\n".join(
        [
            f"  model                 {r['model']} (prompt {r['prompt_tokens']} tokens, "
            f"block {r['block']} chosen by vLLM, {r['mamba_groups']} mamba group(s))",
            f"  processes             {procs}",
            f"  hook calls per kind   {kinds}",
            f"  GDN patch hook calls  {r['patch_hook_calls']}",
            f"  dumps done            {r['dumps']['dump_blocks']} block(s) in "
            f"{r['dumps']['dumps_completed']} dump task(s)",
            f"  tokens from cache     {r['hit_tokens']} "
            f"(vLLM reports {r['cached_tokens_reported_by_vllm']} cached); {load}",
            f"  time to first token   miss {r['ttft_miss_s'] * 1000:.1f} ms, "
            f"hit {r['ttft_hit_s'] * 1000:.1f} ms ({speedup:.1f}x)",
            f"  output on hit         "
            f"first token and logprob "
            f"{'identical to recomputation' if r['same_as_recompute'] else 'DIFFER'}"
            + (
                " (vacuous: this model's logits are uniform, see docs/CONNECTOR.md)"
                if r["uniform_logits"]
                else ""
            ),
        ]
    )


def main() -> int:
    for kind, (path, _n, _phases, _dtype) in MODELS.items():
        if not (path / "config.json").exists():
            raise SystemExit(f"demo: {path} missing; run `make models` first ({kind})")
    results: dict[str, dict[str, Any]] = {}
    from ucm_patch.hooks.stores.local import scratch_memory_tiers

    with tempfile.TemporaryDirectory(prefix="ucm-demo-") as tmp, scratch_memory_tiers():
        store = Path(tmp) / "kv"
        print(
            f"demo: local store in {store}; tiny Qwen3 in one process, then the 3:1 tiny "
            "Qwen3-Next in two (dump, then load in a fresh process) ..."
        )
        for kind, (_path, _n, phases, _dtype) in MODELS.items():
            runs = [_run(kind, phase, store, Path(tmp)) for phase in phases]
            results[kind] = _merge(runs) if len(runs) > 1 else runs[0] | {"pids": [runs[0]["pid"]]}
    print()
    print("== ucm_patch status (in the vLLM process) ==")
    print(_status_table(results["qwen3_next_3to1"]["report"]))
    for kind, r in results.items():
        print()
        print(f"== UCMPatchConnector, {kind} ==")
        print(_section(r))
    bad = [
        k
        for k, r in results.items()
        if not r["hit_tokens"] or not r["flushed"] or not r["same_as_recompute"]
    ]
    if bad:
        print(
            f"\ndemo: no cache hit, or an output that differs from recomputation: {bad}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(*sys.argv[2:6]))
    sys.exit(main())
