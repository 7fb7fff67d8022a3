"""Time to first token on a prefix hit vs recompute, real vLLM CPU, a 0.19 B random Qwen3.

Target: at 80 % of the prompt cached, TTFT with the hit is at least 4x
faster than recomputing (issue #18), or the ceiling below it is shown: the ``vLLM prefix
cache`` row is the hit with no load at all, so recompute / that row bounds any connector
(UCM #656 reports 3.26-3.86x at 80 % hit on GPU, QwQ-32B).

Model: ``scripts/make_bench_model.py`` (Qwen3-0.6B's layer shape, 12 layers, 190 M
parameters, bf16, random weights), vLLM single-process, eager. Workload per repetition,
one fresh random prompt P of ``--prompt-len`` tokens, and S = its first 80 % (whole
128-token blocks):

1. ``cold``: generate P (computes it; a connector stores its blocks);
2. ``vLLM prefix cache``: S + a new tail, while P is still in vLLM's own in-memory prefix
   cache (no connector load at all: the upper bound of a hit);
3. wait for the connector's dumps, then ``reset_prefix_cache()``: from here on only the
   connector can supply S;
4. ``hit``: S + another new tail (80 % of the prompt can come from the connector);
5. ``recompute``: a fresh prompt of the same length (nothing can hit; a connector stores
   it, as it would on any miss; a ``cache_salt`` is not used because ExampleConnector
   ignores it and would hit);
6. ``replay``: reset again, then P itself (a whole-prompt hit: the only hit vLLM's
   ExampleConnector can serve, it keys a whole prompt).

TTFT is the wall time of ``llm.generate`` with ``max_tokens=1`` (prefill + one sampled
token); the speed-up is median(recompute) / median(hit) within one process. Connectors:
ours (local store), vLLM's ExampleConnector, no connector, and the peers that vLLM 0.32
ships or that install from PyPI (OffloadingConnector, SimpleCPUOffloadConnector,
LMCache): each is tried; one that cannot run on CPU is reported with its exact error.

Prints a table, writes ``bench-results/ttft.json``. Not a test.

    .venv/bin/python scripts/bench_ttft.py              # full (~6 min)
    .venv/bin/python scripts/bench_ttft.py --quick      # smoke (ours only, 1 rep)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc

BLOCK = 128  # vLLM CPU block size
LMCACHE_SITE = bc.REPO / ".venv-lmcache" / "site"
LMCACHE_PACKAGES = ("lmcache==0.5.6", "sortedcontainers", "aiofile", "caio")

CONNECTORS: dict[str, dict[str, Any]] = {
    "ucm": {"label": "UCMPatchConnector (local store)"},
    "none": {"label": "no connector (vLLM alone)"},
    "example": {"label": "vLLM ExampleConnector"},
    "offloading": {"label": "vLLM OffloadingConnector (CPU)"},
    "simple_cpu": {"label": "vLLM SimpleCPUOffloadConnector"},
    "lmcache": {"label": "LMCache (LMCacheConnectorV1)"},
}


# ======================================================================================
# child
# ======================================================================================
def _ktc(kind: str, store_dir: str) -> Any:
    from vllm.config import KVTransferConfig

    if kind == "none":
        return None
    if kind == "ucm":
        return KVTransferConfig(
            kv_connector="UCMPatchConnector",
            kv_connector_module_path="ucm_patch.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"store": "local", "local_path": store_dir},
            kv_load_failure_policy="recompute",
        )
    if kind == "example":
        return KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": store_dir},
        )
    if kind == "offloading":
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 2 << 30},
        )
    if kind == "simple_cpu":
        return KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 2 << 30},
        )
    if kind == "lmcache":
        return KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    raise ValueError(f"unknown connector kind {kind!r}")


def child(spec_path: str, out_path: str) -> int:
    import random

    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    kind = spec["connector"]
    n, shared = spec["prompt_len"], spec["shared"]
    from ucm_patch.hooks.stores.local import scratch_memory_tiers

    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp, scratch_memory_tiers():
        t_start = time.perf_counter()
        ktc = _ktc(kind, tmp)
        llm = LLM(
            model=spec["model"],
            dtype="bfloat16",
            max_model_len=spec["max_model_len"],
            max_num_batched_tokens=spec["max_model_len"],
            max_num_seqs=4,
            seed=0,
            enforce_eager=True,
            enable_prefix_caching=True,
            **({"kv_transfer_config": ktc} if ktc is not None else {}),
        )
        startup_s = time.perf_counter() - t_start
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def gen(ids: list[int]) -> tuple[float, int]:
            req: dict[str, Any] = {"prompt_token_ids": ids}
            t0 = time.perf_counter()
            out = llm.generate([req], one, use_tqdm=False)[0]
            return time.perf_counter() - t0, int(out.num_cached_tokens or 0)

        def settle_and_reset() -> None:
            if kind == "ucm":
                from ucm_patch import connector

                if not connector.wait_for_dumps(120):
                    raise RuntimeError("bench_ttft: dumps did not finish in 120 s")
            # Finished requests' delayed frees are reported on later steps: step twice.
            for _ in range(2):
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], one, use_tqdm=False)
            if not llm.reset_prefix_cache():
                raise RuntimeError("bench_ttft: reset_prefix_cache failed (blocks still held)")

        rng = random.Random(11)

        def tokens(k: int) -> list[int]:
            return [rng.randrange(4, 1000) for _ in range(k)]

        gen(tokens(n))  # warm up: first-call costs (allocator, kernels) out of the figures
        gen(tokens(n // 2))
        settle_and_reset()
        rows: dict[str, list[float]] = {
            k: [] for k in ("cold", "vllm_prefix_cache", "hit", "recompute", "replay")
        }
        cached: dict[str, list[int]] = {k: [] for k in rows}
        for _rep in range(spec["reps"]):
            p = tokens(n)
            for name, ids, reset in (
                ("cold", p, False),
                ("vllm_prefix_cache", p[:shared] + tokens(n - shared), False),
                ("hit", p[:shared] + tokens(n - shared), True),
                ("recompute", tokens(n), False),
                ("replay", p, True),
            ):
                if reset:
                    settle_and_reset()
                dt, hit = gen(ids)
                rows[name].append(dt)
                cached[name].append(hit)
            settle_and_reset()
        out: dict[str, Any] = {"times_s": rows, "cached_tokens": cached, "startup_s": startup_s}
        if kind == "ucm":
            from ucm_patch import connector

            out["stats"] = connector.stats()
        Path(out_path).write_text(json.dumps(out))
    return 0


# ======================================================================================
# parent
# ======================================================================================
def install_lmcache() -> str | None:
    """Install LMCache beside the venv (``.venv-lmcache/site``); None, or why it failed.

    Not into the venv: LMCache 0.5.6 requires cupy-cuda13x, cuda-python and numpy<=2.2.6,
    which would replace the CPU venv's numpy and pull CUDA wheels. Its own wheel and the
    three pure-Python modules its vLLM adapter imports are enough to start it, so they go
    to a separate folder put on ``PYTHONPATH`` for its child process only.
    """
    if (LMCACHE_SITE / "lmcache").is_dir():
        return None
    cmd = [bc.PY, "-m", "pip", "install", "-q", "--no-deps", "--target", str(LMCACHE_SITE)]
    cmd += [*LMCACHE_PACKAGES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return f"pip install {' '.join(LMCACHE_PACKAGES)} failed: {bc.last_error_line(proc.stderr)}"
    return None


def run_connector(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    env: dict[str, str] = {}
    if kind == "lmcache":
        why = install_lmcache()
        if why is not None:
            return {"error": why}
        env = {
            "PYTHONPATH": os.pathsep.join([str(bc.REPO), str(LMCACHE_SITE)]),
            "LMCACHE_CHUNK_SIZE": "256",
            "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "2.0",
            "LMCACHE_USE_EXPERIMENTAL": "True",
        }
    reps = spec["reps"] if kind in ("ucm", "none") else spec["peer_reps"]
    res = bc.run_child(
        Path(__file__),
        dict(spec, connector=kind, reps=reps),
        f"ttft-{kind}",
        env=env,
        check=kind in ("ucm", "none"),
        timeout=spec["timeout_s"],
    )
    if "error" in res:
        return res
    t = res["times_s"]
    stderr = (bc.RESULTS / "tmp" / f"ttft-{kind}.stderr.txt").read_text(errors="replace")
    summary: dict[str, Any] = {
        "ms": {k: statistics.median(v) * 1e3 for k, v in t.items()},
        "ms_iqr": {k: [x * 1e3 for x in bc.iqr(v)] for k, v in t.items()},
        "cached_tokens": {k: statistics.median(v) for k, v in res["cached_tokens"].items()},
        "speedup_hit": statistics.median(t["recompute"]) / statistics.median(t["hit"]),
        "speedup_hit_ci95": list(bc.ratio_ci(t["recompute"], t["hit"])),
        "speedup_replay": statistics.median(t["recompute"]) / statistics.median(t["replay"]),
        "speedup_vllm_prefix_cache": statistics.median(t["recompute"])
        / statistics.median(t["vllm_prefix_cache"]),
        "startup_s": res["startup_s"],
        "reps": reps,
        "raw": res,
    }
    if kind == "none":
        summary["note"] = "baseline: with no connector the 80 % hit after the reset recomputes"
    elif not any(res["cached_tokens"]["hit"]) and not any(res["cached_tokens"]["replay"]):
        # It ran but never served a hit: say why, from its own log when it says.
        plain = re.sub(r"\x1b\[[0-9;]*m", "", stderr).splitlines()
        exc = [ln.strip() for ln in plain if re.match(r"^\w+(Error|Exception): ", ln.strip())]
        why = (
            exc[:1]
            + [
                re.sub(r"^[.\s]*|\s*\(\w+\.py:\d+:[\w.]+\)$", "", ln)
                for ln in plain
                if "degraded mode" in ln
            ][:1]
        )
        timeouts = sum("Timeout occurred" in ln for ln in plain)
        if timeouts:
            why.append(f"{timeouts} lookup timeouts (its lookup server never started)")
        summary["note"] = "runs, but serves no hit" + (f": {'; '.join(why)}" if why else "")
    elif not any(res["cached_tokens"]["hit"]):
        summary["note"] = "no hit on a shared prefix (serves whole-prompt replays only)"
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=1920)
    ap.add_argument("--hit", type=float, default=0.8, help="share of the prompt cached")
    ap.add_argument("--reps", type=int, default=4, help="repetitions, ours and no connector")
    ap.add_argument("--peer-reps", type=int, default=2, help="repetitions, peer connectors")
    ap.add_argument(
        "--connectors",
        default="ucm,none,example,offloading,simple_cpu,lmcache",
        help=f"comma list of: {', '.join(CONNECTORS)}",
    )
    # 600 s cut off the no-connector process on the machine of 2026-11-26 (a cold 1920-token
    # prefill took 40 s there, 4 repetitions of 5 prompts)
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per connector process")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.connectors = 1, "ucm"
    kinds = [k.strip() for k in args.connectors.split(",") if k.strip()]
    if set(kinds) - set(CONNECTORS):
        ap.error(f"--connectors: unknown {sorted(set(kinds) - set(CONNECTORS))}")
    if not 0 < args.hit < 1:
        ap.error(f"--hit must be in (0, 1), got {args.hit}")
    shared = int(args.prompt_len * args.hit) // BLOCK * BLOCK
    if shared < BLOCK or args.prompt_len < 2 * BLOCK:
        ap.error(f"--prompt-len {args.prompt_len} x --hit {args.hit}: less than one block shared")
    load0 = os.getloadavg()[0]
    model = bc.ensure_model("qwen3", bc.MODELS / "bench-qwen3", script="make_bench_model.py")
    params = json.loads((model / "ucm_tiny.json").read_text()).get("params")
    spec = {
        "model": str(model),
        "prompt_len": args.prompt_len,
        "shared": shared,
        "reps": args.reps,
        "peer_reps": args.peer_reps,
        "max_model_len": max(2048, args.prompt_len + 64),
        "timeout_s": args.timeout,
    }
    results: dict[str, Any] = {}
    for kind in kinds:
        print(f"  [{kind}] running ...", flush=True)
        results[kind] = run_connector(kind, spec)
        r = results[kind]
        if "error" in r:
            print(f"  [{kind}] does not run: {r['error']}", flush=True)
        else:
            print(
                f"  [{kind}] hit {r['ms']['hit']:.0f} ms, recompute {r['ms']['recompute']:.0f} ms"
                f" -> {r['speedup_hit']:.2f}x",
                flush=True,
            )
    payload = {
        "bench": "ttft",
        "params": {
            "prompt_len": args.prompt_len,
            "shared_tokens": shared,
            "hit_share": shared / args.prompt_len,
            "reps": args.reps,
            "peer_reps": args.peer_reps,
            "model": "random Qwen3, 12 layers, hidden 1024, 16 heads / 8 KV heads x 128, bf16",
            "model_params": params,
        },
        "machine": bc.machine(load0),
        "target_speedup": 3.0,
        "results": {k: {kk: vv for kk, vv in v.items() if kk != "raw"} for k, v in results.items()},
        "raw": {k: v.get("raw") for k, v in results.items()},
        "labels": {k: CONNECTORS[k]["label"] for k in kinds},
    }
    path = bc.write_result("ttft", payload)
    print(
        f"{args.prompt_len}-token prompts, {shared} shared ({100 * shared / args.prompt_len:.0f} %)"
        f", {args.reps} reps, median ms"
    )
    rows = []
    for kind, r in results.items():
        label = CONNECTORS[kind]["label"]
        if "error" in r:
            rows.append((label, "does not run on vLLM CPU: " + r["error"], "", "", "", "", ""))
            continue
        ms, ct = r["ms"], r["cached_tokens"]
        rows.append(
            (
                label,
                f"{ms['cold']:.0f}",
                f"{ms['recompute']:.0f}",
                f"{ms['hit']:.0f} ({ct['hit']:.0f} tok)",
                f"{r['speedup_hit']:.2f}x",
                f"{ms['replay']:.0f} ({ct['replay']:.0f} tok)",
                f"{ms['vllm_prefix_cache']:.0f}",
            )
        )
    print(
        bc.table(
            (
                "connector",
                "cold (stores)",
                "recompute",
                "80 % hit (cached)",
                "speed-up (>= 4x)",
                "replay (cached)",
                "vLLM prefix cache",
            ),
            rows,
        )
    )
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
