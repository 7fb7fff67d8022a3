"""`make demo`: real vLLM (CPU) with the ucm_patch plugin and UCMPatchConnector.

Two short runs, each in its own process (vLLM's KV-transfer state is per process), on the
embedded local store in a fresh temporary directory:

1. tiny Qwen3 (attention only): request 1 misses and dumps its prefix; vLLM's own prefix
   cache is then reset, so request 2 (same prefix) can only hit the store: it loads row
   by row during the forward. Its output is compared with a recomputation.
2. tiny Qwen3-Next (GDN + attention, vLLM's hybrid KV-cache manager kept on): the same,
   where the hit also restores the GDN conv/SSM state (loaded between steps).

Then one report: the patch status table, hook calls per layer kind, dumps done, tokens
served from the cache, time to first token on miss and on hit. Usage:
``.venv/bin/python scripts/demo.py`` (models from ``make models``).
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
MODELS = {
    "qwen3": (REPO / "models" / "tiny-qwen3", 128, 15),  # path, block size, prefix blocks
    "qwen3_next": (REPO / "models" / "tiny-qwen3-next", 1152, 2),
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
    from vllm import SamplingParams

    from ucm_patch import connector

    connector.wait_for_dumps()
    for _ in range(2):
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False
        )
    return bool(llm.reset_prefix_cache())


def child(kind: str, store_dir: str, out_path: str) -> int:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    import ucm_patch
    from ucm_patch import connector
    from ucm_patch.hooks import layerwise

    model, block, blocks = MODELS[kind]
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
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
    rng = random.Random(7)
    prefix = [rng.randrange(4, 1000) for _ in range(blocks * block + 40)]
    for i in range(2):  # warm-up at the same length (first large prefills are slow)
        _generate(llm, [rng.randrange(4, 1000) for _ in range(len(prefix))], 1, f"warm{i}")
    connector.wait_for_dumps()
    before = connector.stats()
    # Time to first token = a 1-token generation (prefill + first sample).
    _out, ttft_miss = _generate(llm, [*prefix, 11, 12], 1)
    flushed = _flush(llm)
    after_miss = connector.stats()
    hit, ttft_hit = _generate(llm, [*prefix, 21, 22], 1)
    after_hit = connector.stats()
    recomputed, _t = _generate(llm, [*prefix, 21, 22], 1, salt="recompute")
    conn = connector.active_connectors()[0]
    kinds = {layer: g.kind for g in conn.layout.groups for layer in g.layers}
    worker = conn._worker_side
    per_kind: dict[str, dict[str, int]] = {}
    for layer, kind_name in kinds.items():
        row = per_kind.setdefault(kind_name, {"layers": 0, "wait": 0, "save": 0})
        row["layers"] += 1
        row["wait"] += worker.wait_calls.get(layer, 0)
        row["save"] += worker.save_calls.get(layer, 0)
    result = {
        "model": model.name,
        "prompt_tokens": len(prefix) + 2,
        "block": block,
        "flushed": flushed,
        "ttft_miss_s": ttft_miss,
        "ttft_hit_s": ttft_hit,
        "hit_tokens": after_hit["hit_tokens"] - after_miss["hit_tokens"],
        "cached_tokens_reported_by_vllm": hit.num_cached_tokens,
        "dumps": {k: after_miss[k] - before[k] for k in ("dump_blocks", "dumps_completed")},
        "load": {
            k: after_hit[k] - after_miss[k]
            for k in ("loads_layerwise", "loads_sync_fallback", "loads_async", "loaded_pages")
        },
        "same_as_recompute": (
            list(hit.outputs[0].token_ids) == list(recomputed.outputs[0].token_ids)
            and [
                lp[t].logprob
                for lp, t in zip(hit.outputs[0].logprobs, hit.outputs[0].token_ids, strict=True)
            ]
            == [
                lp[t].logprob
                for lp, t in zip(
                    recomputed.outputs[0].logprobs, recomputed.outputs[0].token_ids, strict=True
                )
            ]
        ),
        "uniform_logits": all(
            abs(lp[t].logprob + math.log(llm.llm_engine.model_config.get_vocab_size())) < 1e-3
            for lp, t in zip(hit.outputs[0].logprobs, hit.outputs[0].token_ids, strict=True)
        ),
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
def _run(kind: str, store_dir: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{kind}.json"
    env = {**os.environ, **ENV}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(store_dir), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"demo: the {kind} run failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def _status_table(report: list[dict[str, Any]]) -> str:
    from ucm_patch.table import format_table

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
    return "\n".join(
        [
            f"  model                 {r['model']} (prompt {r['prompt_tokens']} tokens, "
            f"block {r['block']})",
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
    for kind, (path, _b, _n) in MODELS.items():
        if not (path / "config.json").exists():
            raise SystemExit(f"demo: {path} missing; run `make models` first ({kind})")
    with tempfile.TemporaryDirectory(prefix="ucm-demo-") as tmp:
        store = Path(tmp) / "kv"
        print(f"demo: local store in {store}; running tiny Qwen3, then tiny Qwen3-Next ...")
        results = {kind: _run(kind, store, Path(tmp)) for kind in MODELS}
    print()
    print("== ucm_patch status (in the vLLM process) ==")
    print(_status_table(results["qwen3_next"]["report"]))
    for kind, r in results.items():
        print()
        print(f"== UCMPatchConnector, {kind} ==")
        print(_section(r))
    bad = [k for k, r in results.items() if not r["hit_tokens"] or not r["flushed"]]
    if bad:
        print(f"\ndemo: no cache hit for {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(*sys.argv[2:5]))
    sys.exit(main())
