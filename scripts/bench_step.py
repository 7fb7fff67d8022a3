"""Step overhead of ucm_patch on real vLLM CPU: the same workload with and without it.

Target: with ucm_patch active and no KV connector configured, the engine
is at most 1 % slower than without ucm_patch (``UCM_PATCH=0``): ratio <= 1.01.

How: one vLLM process per measurement (``UCM_PATCH=0`` only takes effect at start), in
single-process mode, bf16, eager. Each process runs a fixed workload (``--prompts`` prompts
of ``--prompt-len`` random token ids, ``--max-tokens`` generated tokens each, prefix caching
off so every repetition computes the same thing), ``--warmup`` untimed then ``--reps``
timed ``llm.generate`` calls; the per-process median is one sample. Processes alternate
off/on, on/off, ... for ``--pairs`` pairs so drift and background load hit both alike. The
ratio is median(on samples) / median(off samples); its 95 % bootstrap interval over the
per-generate times and the per-pair ratios show how far to trust it.

Models (what ucm_patch wraps on each):

* ``next``: tiny Qwen3-Next (GDN linear-attention + full-attention layers): the
  ``gdn_layerwise`` record overrides the CPU kernel of ``vllm::cpu_gdn_attention_core``,
  so every GDN layer call goes through our wrapper. A tiny model: the step is host-bound,
  the worst case for a per-layer Python cost.
* ``small``: a small Qwen3 (8 layers, hidden 512) with the opt-in ``kv_ready_event``
  record on (``UCM_PATCH_KV_READY_EVENT=1``): every attention layer's KV-cache write op
  goes through our kernel wrapper. (With the default records nothing of ucm_patch runs
  per layer on a plain-attention model.)

Across processes the noise is several % (the per-pair ratios show it), more than the 1 %
being tested. So for ``small`` one more process runs ``--toggle-pairs`` pairs of adjacent
``generate`` calls with the record switched off and on again in between (a reverted kernel
override leaves vLLM's own kernel current, exactly as without ucm_patch): the paired ratio
of that process is the precise figure, the process pairs check it end to end.

Prints a table, writes ``bench-results/step.json``. Not a test.

    .venv/bin/python scripts/bench_step.py            # full (~5 min)
    .venv/bin/python scripts/bench_step.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc

MODELS: dict[str, dict[str, Any]] = {
    "next": {
        "label": "tiny Qwen3-Next (GDN kernel wrapped)",
        "path": bc.MODELS / "tiny-qwen3-next",
        "build": ("qwen3_next", ()),
        "env_on": {},
    },
    "small": {
        "label": "small Qwen3, 8 layers (KV-write kernel wrapped)",
        "path": bc.MODELS / "small-qwen3",
        "build": ("qwen3_small", ("--layers", "8", "--hidden", "512")),
        "env_on": {"UCM_PATCH_KV_READY_EVENT": "1"},
        # Its records override op kernels: reverting restores vLLM's kernel exactly, so the
        # record can also be switched off and on inside one process (``--toggle-pairs``).
        "toggle_record": "kv_ready_event",
    },
}


# ======================================================================================
# child: one vLLM process
# ======================================================================================
def child(spec_path: str, out_path: str) -> int:
    import random

    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=2048,
        max_num_batched_tokens=4096,
        max_num_seqs=spec["prompts"],
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=False,
    )
    rng = random.Random(1)
    prompts = [
        {"prompt_token_ids": [rng.randrange(4, 1000) for _ in range(spec["prompt_len"])]}
        for _ in range(spec["prompts"])
    ]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    times: list[float] = []
    for i in range(spec["warmup"] + spec["reps"]):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        if any(len(o.outputs[0].token_ids) != spec["max_tokens"] for o in outs):
            raise RuntimeError("bench_step: a request produced the wrong number of tokens")
        if i >= spec["warmup"]:
            times.append(dt)
    applied: list[str] = []
    if "ucm_patch" in sys.modules:
        import ucm_patch

        applied = _applied(ucm_patch)
    out: dict[str, Any] = {"times_s": times, "applied": applied}
    if spec.get("toggle_pairs"):
        out["toggle"] = _toggle_pairs(llm, prompts, params, spec)
    Path(out_path).write_text(json.dumps(out))
    return 0


def _applied(ucm_patch: Any) -> list[str]:
    return sorted(
        r.get("id", r.get("name", "?")) for r in ucm_patch.report() if r["state"] == "applied"
    )


def _toggle_pairs(
    llm: Any, prompts: list[Any], params: Any, spec: dict[str, Any]
) -> dict[str, Any]:
    """The same engine timed with one record switched off and on, call by call.

    Process-to-process noise (memory layout, thread placement: several % here) cancels:
    each pair is two adjacent ``generate`` calls of one process, the record reverted
    (``activate(patches={name: False})`` destroys our kernel registration, vLLM's own
    kernel is current again) and applied again. Only for records whose revert restores
    the original exactly (a kernel override); the order alternates per pair.
    """
    import ucm_patch

    name = spec["toggle_record"]
    on_ids = _applied(ucm_patch)
    if not any(i.startswith(f"{name}@") for i in on_ids):
        raise RuntimeError(f"bench_step: {name} is not applied at start: {on_ids}")
    times: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(spec["toggle_pairs"]):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            ucm_patch.activate(patches={name: mode == "on"})
            ids = _applied(ucm_patch)
            if (mode == "on") != (ids == on_ids):
                raise RuntimeError(f"bench_step: toggling {name} {mode}: applied {ids}")
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[mode].append(time.perf_counter() - t0)
    return {"record": name, "applied_on": on_ids, "times_s": times}


# ======================================================================================
# parent
# ======================================================================================
def bench_model(key: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = MODELS[key]
    kind, build_args = cfg["build"]
    model = bc.ensure_model(kind, cfg["path"], *build_args)
    spec = {
        "model": str(model),
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "warmup": args.warmup,
        "reps": args.reps,
    }
    off: list[float] = []
    on: list[float] = []
    pairs: list[dict[str, float]] = []
    applied_on: list[str] = []
    applied_off: list[str] = []
    for p in range(args.pairs):
        order = ("off", "on") if p % 2 == 0 else ("on", "off")
        got: dict[str, list[float]] = {}
        for mode in order:
            env = {"UCM_PATCH": "0"} if mode == "off" else dict(cfg["env_on"])
            res = bc.run_child(Path(__file__), spec, f"step-{key}-{p}-{mode}", env=env)
            got[mode] = res["times_s"]
            if mode == "on":
                applied_on = res["applied"]
            else:
                applied_off = res["applied"]
            med_ms = statistics.median(res["times_s"]) * 1e3
            print(
                f"  [{key}] pair {p} {mode:3}: median {med_ms:8.1f} ms / generate "
                f"({res['child_wall_s']:.0f} s process)",
                flush=True,
            )
        off += got["off"]
        on += got["on"]
        pairs.append(
            {
                "off_ms": statistics.median(got["off"]) * 1e3,
                "on_ms": statistics.median(got["on"]) * 1e3,
                "ratio": statistics.median(got["on"]) / statistics.median(got["off"]),
            }
        )
    ratio = statistics.median(on) / statistics.median(off)
    lo, hi = bc.ratio_ci(on, off)
    toggle = None
    if cfg.get("toggle_record") and args.toggle_pairs:
        spec_t = dict(
            spec, reps=1, toggle_pairs=args.toggle_pairs, toggle_record=cfg["toggle_record"]
        )
        res = bc.run_child(Path(__file__), spec_t, f"step-{key}-toggle", env=dict(cfg["env_on"]))
        t = res["toggle"]
        toggle = {
            "record": t["record"],
            "pairs": args.toggle_pairs,
            **bc.paired(t["times_s"]["off"], t["times_s"]["on"]),
            "off_ms_median": statistics.median(t["times_s"]["off"]) * 1e3,
            "on_ms_median": statistics.median(t["times_s"]["on"]) * 1e3,
            "times_ms": {m: [x * 1e3 for x in v] for m, v in t["times_s"].items()},
        }
        print(
            f"  [{key}] in-process toggle of {t['record']}, {args.toggle_pairs} pairs: ratio "
            f"{toggle['ratio']:.4f} [{toggle['ratio_ci95'][0]:.4f}, {toggle['ratio_ci95'][1]:.4f}]",
            flush=True,
        )
    cfg_json = json.loads((model / "config.json").read_text())
    types = cfg_json.get("layer_types") or []
    wrapped_layers = (
        sum(t == "linear_attention" for t in types)
        if key == "next"
        else cfg_json["num_hidden_layers"]
    )
    steps = args.max_tokens  # one prefill step (all prompts fit) + max_tokens - 1 decodes
    return {
        "model": cfg["label"],
        "model_path": str(model),
        "records_applied_on": applied_on,
        "records_applied_off": applied_off,
        "off_ms_median": statistics.median(off) * 1e3,
        "on_ms_median": statistics.median(on) * 1e3,
        "off_ms_iqr": [x * 1e3 for x in bc.iqr(off)],
        "on_ms_iqr": [x * 1e3 for x in bc.iqr(on)],
        "step_ms_off": statistics.median(off) * 1e3 / steps,
        "ratio": ratio,
        "ratio_ci95": [lo, hi],
        "ratio_min": min(on) / min(off),
        # One wrapped call per wrapped layer per engine step; all prompts prefill in one
        # step, then max_tokens - 1 decode steps.
        "wrapped_calls_per_generate": wrapped_layers * steps,
        "pair_ratios": [p["ratio"] for p in pairs],
        "pairs": pairs,
        "off_times_ms": [x * 1e3 for x in off],
        "on_times_ms": [x * 1e3 for x in on],
        "target_max": 1.01,
        "met": ratio <= 1.01,
        "confident": hi <= 1.01,
        "toggle": toggle,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="next,small", help="comma list of: next, small")
    ap.add_argument("--pairs", type=int, default=4, help="off/on process pairs per model")
    ap.add_argument("--reps", type=int, default=6, help="timed generate calls per process")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--toggle-pairs",
        type=int,
        default=40,
        help="off/on generate pairs in one process, record toggled (models with a toggle_record)",
    )
    ap.add_argument("--quick", action="store_true", help="1 pair, 3 reps, next model only")
    args = ap.parse_args(argv)
    if args.quick:
        args.pairs, args.reps, args.warmup, args.models = 1, 3, 1, "next"
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = set(keys) - set(MODELS)
    if unknown:
        ap.error(f"--models: unknown {sorted(unknown)}; accepted: {sorted(MODELS)}")
    for name in ("pairs", "reps", "prompts", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    load0 = __import__("os").getloadavg()[0]
    results = {k: bench_model(k, args) for k in keys}
    payload = {
        "bench": "step",
        "params": {k: v for k, v in vars(args).items() if k != "quick"},
        "machine": bc.machine(load0),
        "results": results,
    }
    path = bc.write_result("step", payload)
    rows = []
    for r in results.values():
        rows.append(
            (
                r["model"],
                f"{r['off_ms_median']:.1f}",
                f"{r['on_ms_median']:.1f}",
                f"{r['ratio']:.4f}",
                f"[{r['ratio_ci95'][0]:.4f}, {r['ratio_ci95'][1]:.4f}]",
                ", ".join(f"{x:.3f}" for x in r["pair_ratios"]),
                "<= 1.01 " + ("met" if r["met"] else "MISSED"),
            )
        )
    print(
        bc.table(
            (
                "model",
                "without (UCM_PATCH=0), ms/generate",
                "with ucm_patch, ms/generate",
                "ratio",
                "95% CI",
                "per-pair ratios",
                "target",
            ),
            rows,
        )
    )
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
