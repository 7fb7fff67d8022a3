"""``make gpu-check``: ucm_patch and UCMPatchConnector on a machine with CUDA vLLM.

What the CPU suite cannot see (CUDA graphs, torch.compile, FlashAttention's layout, the GPU
model runner), checked on two models with random weights (``load_format="dummy"``, configs
written here, no hub, no tokenizer: prompts are token ids):

* ``dense``: Qwen3-8B's shape (36 layers, 8 KV heads of 128);
* ``hybrid``: a Qwen3-Next laid out like the checkpoint (``[GDN x 3, attention] x 2``,
  MoE), smaller so it starts quickly.

Per model, each run a fresh interpreter (vLLM's default compilation: torch.compile and
CUDA graphs, no ``enforce_eager``):

1. **hooks**: the tests' counting connector, with ucm_patch and with ``UCM_PATCH=0``:
   per-layer waits / saves on GDN and attention layers per forward step;
2. **cross-process hit**: process A stores prompt P (80 % shared prefix + a tail) through
   UCMPatchConnector on a local store, then times the same-prefix prompt Q recomputed
   (another ``cache_salt``) and served by vLLM's own prefix cache (the ceiling);
   process B (same ``PYTHONHASHSEED``) runs Q: hit tokens, tokens and logprobs equal to
   A's recomputation, and its time to first token;
3. **OffloadingConnector**: vLLM's own CPU offload in one process (P, reset of the GPU
   prefix cache, Q): the peer's time to first token;
4. **dump bandwidth** against the rate at which prefill produces KV: bytes the connector
   stored for P over the time from P's start to its last dump, against the same bytes
   over P's prefill time.

Prints one table (and writes it as JSON with ``--json``). Exit status 1 when a check that
has a right answer (hook counts, hit length, equal tokens) fails.

    python scripts/gpu_check.py [--workdir DIR] [--json OUT] [--models dense,hybrid]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPT_LEN = 8192
SHARED = 0.8
SEED = 0
REFUSAL = "hybrid prefix hits need vLLM"

# Qwen3-8B's shape (config.json of Qwen/Qwen3-8B), weights random.
DENSE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# Qwen3-Next's per-layer shape (GDN heads and dims as in Qwen3-Next-80B-A3B), 8 layers
# laid out as the checkpoint ([linear x 3, full] repeated), fewer and smaller experts.
HYBRID = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3
    + ["full_attention"]
    + ["linear_attention"] * 3
    + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MODELS = {"dense": DENSE, "hybrid": HYBRID}


def write_model(workdir: Path, name: str) -> Path:
    """A model directory vLLM loads with ``load_format="dummy"`` (a config is enough)."""
    path = workdir / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODELS[name], indent=1))
    return path


def layer_kinds(config: dict[str, Any]) -> dict[str, list[str]]:
    """vLLM's layer names per kind, from a config."""
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    gdn = [f"model.layers.{i}.linear_attn" for i, t in enumerate(types) if t == "linear_attention"]
    attn = [
        f"model.layers.{i}.self_attn.attn" for i, t in enumerate(types) if t != "linear_attention"
    ]
    return {"gdn": gdn, "attention": attn}


def prompts(block: int, seed: int = 1) -> tuple[list[int], list[int], int]:
    """(P, Q, shared): ``PROMPT_LEN`` tokens each, sharing their first 80 % in whole
    ``block``-token units (``shared`` tokens; the connector's hit unit)."""
    import random

    rng = random.Random(seed)
    shared = int(PROMPT_LEN * SHARED) // block * block
    prefix = [rng.randrange(4, 100000) for _ in range(shared)]
    tail = PROMPT_LEN - shared
    return (
        prefix + [rng.randrange(4, 100000) for _ in range(tail)],
        prefix + [rng.randrange(4, 100000) for _ in range(tail)],
        shared,
    )


# ======================================================================================
# child (one vLLM process)
# ======================================================================================
def _llm(model: str, ktc: Any, hybrid: bool) -> Any:
    from vllm import LLM

    extra: dict[str, Any] = {}
    if hybrid:  # FlashInfer's GDN prefill is Hopper's default; the Triton one always runs
        extra["additional_config"] = {"gdn_prefill_backend": "triton"}
    return LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=PROMPT_LEN + 64,
        max_num_seqs=4,
        seed=SEED,
        gpu_memory_utilization=0.8,
        enable_prefix_caching=True,
        kv_transfer_config=ktc,
        **extra,
    )


def _ktc(kind: str, store: str) -> Any:
    from vllm.config import KVTransferConfig

    if kind == "ucm":
        return KVTransferConfig(
            kv_connector="UCMPatchConnector",
            kv_connector_module_path="ucm_patch.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"store": "local", "local_path": store},
        )
    if kind == "standin":
        from tests.support import STANDIN_CONNECTOR

        return KVTransferConfig(**STANDIN_CONNECTOR, kv_role="kv_both")
    if kind == "offloading":
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 16 << 30},
        )
    raise ValueError(f"unknown connector kind {kind!r}")


def _generate(llm: Any, ids: list[int], salt: str | None = None, tokens: int = 4) -> dict[str, Any]:
    from vllm import SamplingParams

    request: dict[str, Any] = {"prompt_token_ids": ids}
    if salt:
        request["cache_salt"] = salt
    params = SamplingParams(
        max_tokens=tokens, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False
    )
    t0 = time.perf_counter()
    out = llm.generate([request], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    comp = out.outputs[0]
    return {
        "seconds": seconds,
        "tokens": list(comp.token_ids),
        "logprobs": [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)],
        "num_cached_tokens": int(out.num_cached_tokens or 0),
    }


def _ttft(llm: Any, ids: list[int], salt: str | None = None) -> dict[str, Any]:
    return _generate(llm, ids, salt, tokens=1)


def child(mode: str, model: str, store: str, hybrid: bool) -> dict[str, Any]:
    import ucm_patch  # activates (UCM_PATCH=0 switches it off), as a user's import would

    kind = {"hooks": "standin", "offload": "offloading"}.get(mode, "ucm")
    llm = _llm(model, _ktc(kind, store), hybrid)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    unit = block  # a hit is whole chunks of our connector (KVLayout.unit): read it there
    if kind == "ucm":
        from ucm_patch import connector

        found = connector.active_connectors()
        unit = found[0].layout.unit if found else block
    p, q, shared = prompts(unit)
    _ttft(llm, prompts(unit, seed=99)[0], salt="warm-up")  # compile, capture, allocate
    out: dict[str, Any] = {"block_size": block, "unit": unit, "shared": shared}
    if mode == "hooks":
        _generate(llm, p)
        out["applied"] = [r["id"] for r in ucm_patch.report() if r["state"] == "applied"]
    elif mode == "dump":
        connector.wait_for_dumps(600)  # the warm-up's dumps are not P's
        before = connector.stats()["bytes_written"]
        t0 = time.perf_counter()
        out["cold"] = _ttft(llm, p)
        if not connector.wait_for_dumps(600):
            raise RuntimeError("gpu_check: the dumps of P did not finish in 600 s")
        out["dump_seconds"] = time.perf_counter() - t0
        out["dump_bytes"] = connector.stats()["bytes_written"] - before
        out["own_cache"] = _ttft(llm, q)  # Q's prefix from vLLM's own prefix cache
        out["recompute"] = _generate(llm, q, salt="recompute")  # nothing can hit
        out["recompute_ttft"] = _ttft(llm, q, salt="recompute-2")
        connector.wait_for_dumps(600)
    elif mode == "load":
        out["hit_ttft"] = _ttft(llm, q)  # first request: the prefix comes from the store
        out["hit"] = _generate(llm, q)  # the loaded blocks, now in vLLM's own cache
    elif mode == "offload":
        _ttft(llm, p)
        for _ in range(2):  # let finished requests' offloads complete and free
            _ttft(llm, [5, 6, 7])
        if not llm.reset_prefix_cache():
            raise RuntimeError("gpu_check: reset_prefix_cache failed (blocks still held)")
        out["hit_ttft"] = _ttft(llm, q)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return out


# ======================================================================================
# parent
# ======================================================================================
def run_child(
    mode: str, model: Path, store: Path, hybrid: bool, env: dict[str, str]
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [
        sys.executable,
        __file__,
        "child",
        mode,
        str(model),
        str(store),
        str(int(hybrid)),
        str(out),
    ]
    full_env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(REPO), **env}
    print(f"[gpu-check] {model.name} {mode} {env or ''}", flush=True)
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=1800)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return {"error": output[-3000:]}
    result = json.loads(out.read_text())
    out.unlink()
    refusal = [ln for ln in output.splitlines() if REFUSAL in ln]
    if refusal:
        result["refused"] = refusal[0].split(REFUSAL, 1)[1].strip(" :.")
    return result


def hook_counts(record: Path, layers: list[str]) -> dict[str, int]:
    """Waits and saves the counting connector recorded (JSON lines) on ``layers``."""
    calls = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    want = set(layers)
    waits = sum(1 for c in calls if c["call"] == "wait_for_layer_load" and c.get("layer") in want)
    saves = sum(1 for c in calls if c["call"] == "save_kv_layer" and c.get("layer") in want)
    return {"waits": waits, "saves": saves}


def hooks_ok(kinds: dict[str, list[str]], patched: dict[str, Any], plain: dict[str, Any]) -> bool:
    """Every layer kind gets waits and saves with ucm_patch (one of each per step); GDN
    layers get none without it (vLLM makes none for them)."""
    if "counts" not in patched or "counts" not in plain:
        return False
    for kind, layers in kinds.items():
        got = patched["counts"][kind]
        if layers and not (got["waits"] > 0 and got["waits"] == got["saves"]):
            return False
    return not kinds["gdn"] or plain["counts"]["gdn"]["waits"] == 0


def judge(name: str, config: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """One model's column of the table, and whether the checks with a right answer hold."""
    kinds = layer_kinds(config)
    col: dict[str, Any] = {"model": name}
    ok = True
    for label in ("patched", "plain"):
        hooks = runs.get(f"hooks_{label}", {})
        col[f"hooks_{label}"] = hooks.get("counts", hooks.get("error", "")[-200:])
    ok = hooks_ok(kinds, runs.get("hooks_patched", {}), runs.get("hooks_plain", {}))
    dump, load, off = runs.get("dump", {}), runs.get("load", {}), runs.get("offload", {})
    if "error" in dump or "error" in load:
        col["hit"] = (dump.get("error") or load.get("error") or "")[-300:]
        ok = False
    elif dump.get("refused"):  # the connector's own start-up refusal (older vLLM)
        col["hit"] = f"refused at start: {dump['refused']}"
        ok &= load["hit_ttft"]["num_cached_tokens"] == 0 and dump["dump_bytes"] == 0
    elif dump and load:
        unit = load.get("unit", load["block_size"])
        want = load["shared"] // unit * unit
        ref, hit = dump["recompute"], load["hit"]
        diff = max(
            (abs(a - b) for a, b in zip(ref["logprobs"], hit["logprobs"], strict=False)),
            default=0.0,
        )
        col["hit"] = f"{load['hit_ttft']['num_cached_tokens']}/{want} tokens"
        col["same_tokens"] = ref["tokens"] == hit["tokens"]
        col["max_logprob_diff"] = diff
        ok &= load["hit_ttft"]["num_cached_tokens"] == want and col["same_tokens"]
        col["ttft_ms"] = {
            "recompute": 1000 * dump["recompute_ttft"]["seconds"],
            "vllm_prefix_cache": 1000 * dump["own_cache"]["seconds"],
            "ucm_hit": 1000 * load["hit_ttft"]["seconds"],
            "offloading_connector": 1000 * off["hit_ttft"]["seconds"]
            if "hit_ttft" in off
            else None,
        }
        prefill_s = dump["cold"]["seconds"]
        produce = dump["dump_bytes"] / prefill_s if prefill_s else 0.0
        dumped = dump["dump_bytes"] / dump["dump_seconds"] if dump["dump_seconds"] else 0.0
        col["kv_produced_gbps"] = produce / 1e9
        col["dump_gbps"] = dumped / 1e9
        col["dump_vs_production"] = dumped / produce if produce else 0.0
    col["ok"] = ok
    return col


def render(cols: list[dict[str, Any]]) -> str:
    rows = [("check", [c["model"] for c in cols])]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}"
        if isinstance(value, dict):
            return ", ".join(f"{k} {cell(v)}" for k, v in value.items())
        return str(value)

    for key in (
        "hooks_patched",
        "hooks_plain",
        "hit",
        "same_tokens",
        "max_logprob_diff",
        "ttft_ms",
        "kv_produced_gbps",
        "dump_gbps",
        "dump_vs_production",
        "ok",
    ):
        rows.append((key, [cell(c.get(key, "-")) for c in cols]))
    lines = ["| " + " | ".join([rows[0][0], *rows[0][1]]) + " |", "|" + "---|" * (len(cols) + 1)]
    lines += ["| " + " | ".join([k, *vals]) + " |" for k, vals in rows[1:]]
    return "\n".join(lines)


def check_model(name: str, workdir: Path) -> dict[str, Any]:
    config = MODELS[name]
    model = write_model(workdir, name)
    hybrid = name == "hybrid"
    kinds = layer_kinds(config)
    runs: dict[str, Any] = {}
    for label, env in (("patched", {}), ("plain", {"UCM_PATCH": "0"})):
        record = workdir / f"{name}-{label}.jsonl"
        record.unlink(missing_ok=True)
        env = {**env, "UCM_TEST_RECORD": str(record)}
        result = run_child("hooks", model, workdir / "unused", hybrid, env)
        if "error" not in result:
            result["counts"] = {kind: hook_counts(record, v) for kind, v in kinds.items()}
        runs[f"hooks_{label}"] = result
    store = workdir / f"{name}-store"
    runs["dump"] = run_child("dump", model, store, hybrid, {})
    runs["load"] = run_child("load", model, store, hybrid, {})
    runs["offload"] = run_child("offload", model, workdir / "unused", hybrid, {})
    return judge(name, config, runs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        mode, model, store, hybrid, out = argv[1:]
        Path(out).write_text(json.dumps(child(mode, model, store, hybrid == "1")))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default="dense,hybrid")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ucm-gpu-check-"))
    cols = [check_model(name, workdir) for name in args.models.split(",")]
    print(render(cols))
    if args.json:
        Path(args.json).write_text(json.dumps(cols, indent=1))
    return 0 if all(c["ok"] for c in cols) else 1


if __name__ == "__main__":
    sys.exit(main())
