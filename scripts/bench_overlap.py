"""Dump overlap: step time with layerwise dumps vs without, against synchronous baselines.

Targets: with a fast-enough store, a step with dumps takes at most 1.05x a
step without (``step ratio``), and at least 95 % of the dump time is hidden behind compute
(``hidden = 1 - (step time increase) / (dump work time)``).

Two parts, each comparing modes measured in the same run, interleaved round by round:

**A. Scheduler level (controlled store).** A 48-layer "forward" on one thread (a
single-threaded torch matmul per layer: it releases the GIL like a device computing), a
CPU "KV cache" per layer, and a store whose latency and bandwidth are spent in
``time.sleep`` (GIL released, like real I/O). The store is set so the dump work is a
given fraction (``--loads``) of the compute. Modes:

* ``none``: no dumps (the baseline);
* ``ucm async``: our :class:`~ucm_patch.hooks.dump.DumpScheduler`, ``submit_layer``
  per layer, ``seal`` + non-blocking ``get_finished`` at the step end;
* ``ucm blocking``: the same scheduler with ``blocking_finish=True`` (UCM #989
  behaviour: the step end waits for its finished requests' dumps);
* ``sync layerwise``: copy + ``put_many`` inline in each layer, what vLLM's
  ``ExampleConnector`` does (``safetensors.save_file`` inside ``save_kv_layer``).

**B. Real vLLM CPU** (small Qwen3, 8 layers, single-process, bf16, eager): prefill-only
requests with fresh prompts (every block is dumped), ``llm.generate`` timed.

* ``UCMPatchConnector``: its store is a local store behind a latency + bandwidth
  wrapper; modes alternate in one process: dumps off (the scheduler side plans none),
  async, and blocking (``blocking_finish``);
* vLLM's ``ExampleConnector`` (synchronous, layerwise): ``safetensors.save_file`` behind
  the same latency + bandwidth wrapper; dumps off (its ``save_kv_layer`` skipped) vs on.

Caveat for B: on this CPU host the "device" is the CPU itself. vLLM computes with an OpenMP
team on every core, so dump work that needs CPU (the page copy, the checksum and the file
write of the local store) competes with compute; only the controlled latency is free to
hide. Part A isolates the scheduler with one compute core; B is also run with vLLM
computing on one thread (``OMP_NUM_THREADS=1``, no binding), the other core left to the
dump threads as a GPU host's CPU is while its device computes.

Prints tables, writes ``bench-results/overlap.json``. Not a test.

    .venv/bin/python scripts/bench_overlap.py            # full (~4 min)
    .venv/bin/python scripts/bench_overlap.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc

MODES_A = ("none", "ucm async", "ucm blocking", "sync layerwise")


class Busy:
    """A thread-safe accumulator of nanoseconds spent (store time, copy time)."""

    def __init__(self) -> None:
        self.ns = 0
        self._lock = threading.Lock()

    def add(self, ns: int) -> None:
        with self._lock:
            self.ns += ns


def spend(latency_s: float, nbytes: int, bandwidth_Bps: float) -> None:
    """The controlled store cost: latency + bytes / bandwidth, GIL released."""
    time.sleep(latency_s + nbytes / bandwidth_Bps)


def make_latency_store(inner: Any, latency_s: float, bandwidth_Bps: float, busy: Busy) -> Any:
    """A KVStore that writes through ``inner`` after the controlled latency + bandwidth."""
    from ucm_patch.hooks.stores.base import KVStore

    class LatencyStore(KVStore):
        name = "latency"

        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.latency_s = latency_s
            self.bandwidth_Bps = bandwidth_Bps
            if inner is not None:
                self.stats = inner.stats

        def put_many(self, items: Sequence[tuple[str, Any]]) -> list[bool]:
            t0 = time.perf_counter_ns()
            nbytes = 0
            for _, value in items:
                nbytes += memoryview(value).nbytes
            spend(self.latency_s, nbytes, self.bandwidth_Bps)
            out = inner.put_many(items) if inner is not None else [True] * len(items)
            busy.add(time.perf_counter_ns() - t0)
            return out

        def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
            return inner.get_many(keys) if inner is not None else [None] * len(keys)

        def exists_many(self, keys: Sequence[str]) -> list[bool]:
            return inner.exists_many(keys) if inner is not None else [False] * len(keys)

        def close(self) -> None:
            if inner is not None:
                inner.close()

    return LatencyStore()


# ======================================================================================
# Part A: scheduler level
# ======================================================================================
class Forward:
    """``layers`` single-threaded matmuls (GIL released) and a CPU KV cache to dump from."""

    def __init__(self, layers: int, dim: int, row_bytes: int) -> None:
        import torch

        torch.manual_seed(0)
        self.layers = layers
        self.a = torch.randn(dim, dim)
        self.b = torch.randn(dim, dim)
        self.out = torch.empty(dim, dim)
        self.kv = torch.ones(layers, row_bytes, dtype=torch.uint8)
        self.host = torch.empty(layers, row_bytes, dtype=torch.uint8)  # staging buffer
        self.mm = torch.mm

    def layer(self) -> None:
        self.mm(self.a, self.b, out=self.out)


def part_a(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ucm_patch.hooks.device import CpuDevice
    from ucm_patch.hooks.dump import DumpScheduler

    torch.set_num_threads(1)
    layers, requests, kv_bytes = args.layers, args.requests, args.kv_bytes
    fwd = Forward(layers, args.dim, requests * kv_bytes)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    keys = [[f"r{i}/{row}" for i in range(requests)] for row in range(layers)]
    views = [
        [memoryview(fwd.host[row].numpy())[i * kv_bytes : (i + 1) * kv_bytes]
         for i in range(requests)]
        for row in range(layers)
    ]  # fmt: skip
    busy = Busy()

    def produce_row(row: int) -> list[memoryview]:
        t0 = time.perf_counter_ns()
        fwd.host[row].copy_(fwd.kv[row])  # the device->host copy stand-in (GIL released)
        busy.add(time.perf_counter_ns() - t0)
        return views[row]

    def produce(task: Any) -> list[memoryview]:
        return produce_row(task.row)

    store = make_latency_store(None, args.store_latency_us / 1e6, 1e12, busy)
    scheds = {
        "ucm async": DumpScheduler(CpuDevice(), workers=args.workers, capacity=4096),
        "ucm blocking": DumpScheduler(
            CpuDevice(), workers=args.workers, capacity=4096, blocking_finish=True
        ),
    }
    clients = {mode: sched.client("bench") for mode, sched in scheds.items()}
    step_no = [0]

    def step(mode: str) -> float:
        step_no[0] += 1
        ids = [f"s{step_no[0]}-r{i}" for i in range(requests)]
        dumps = clients.get(mode)
        t0 = time.perf_counter()
        batch = dumps.open_batch(ids, store) if dumps is not None else None
        for i in range(layers):
            fwd.layer()
            if dumps is not None:
                dumps.submit_layer(batch, names[i], None, i, keys[i], produce)
            elif mode == "sync layerwise":
                store.put_many(list(zip(keys[i], produce_row(i), strict=True)))
        if dumps is not None:
            dumps.seal(batch)
            dumps.get_finished(ids)
        return time.perf_counter() - t0

    def drain() -> None:
        for mode, sched in scheds.items():
            deadline = time.monotonic() + 30
            while sched.internal_sizes()["slots_in_use"]:
                if time.monotonic() > deadline:
                    raise RuntimeError("bench_overlap: dumps did not drain in 30 s")
                time.sleep(0.0005)
            clients[mode].get_finished(())

    for mode in MODES_A:  # warm up every path
        for _ in range(3):
            step(mode)
        drain()
    base = statistics.median(step("none") for _ in range(20))
    payload = layers * requests * kv_bytes
    results: list[dict[str, Any]] = []
    for load in args.loads:
        # Dump work per step = load x compute: per layer, latency + bytes / bandwidth.
        per_layer = load * base / layers - store.latency_s
        if per_layer <= 0:
            raise SystemExit(f"--loads {load}: the store latency alone exceeds it")
        store.bandwidth_Bps = requests * kv_bytes / per_layer
        times: dict[str, list[float]] = {m: [] for m in MODES_A}
        work: dict[str, float] = dict.fromkeys(MODES_A, 0.0)
        for _ in range(args.rounds):
            gc.collect()
            for mode in MODES_A:
                busy.ns = 0
                for _ in range(args.steps):
                    times[mode].append(step(mode))
                drain()  # the tail of the last step's dumps belongs to this mode
                work[mode] += busy.ns / 1e9
        med = {m: statistics.median(v) for m, v in times.items()}
        n = args.rounds * args.steps
        # Per-round medians: the modes of one round ran back to back, so comparing them
        # round by round cancels drift between rounds (VM load, CPU frequency).
        k = args.steps
        per_round = {
            m: [statistics.median(v[i : i + k]) for i in range(0, n, k)] for m, v in times.items()
        }
        row: dict[str, Any] = {
            "load": load,
            "store_bandwidth_MBps": store.bandwidth_Bps / 1e6,
            "store_latency_us": args.store_latency_us,
            "step_ms_none": med["none"] * 1e3,
            "modes": {},
        }
        for mode in MODES_A[1:]:
            work_s = work[mode] / n
            pair = bc.paired(per_round["none"], per_round[mode])
            row["modes"][mode] = {
                "step_ms": med[mode] * 1e3,
                "step_ms_iqr": [x * 1e3 for x in bc.iqr(times[mode])],
                "ratio": pair["ratio"],
                "ratio_ci95": pair["ratio_ci95"],
                "step_increase_ms": pair["increase"] * 1e3,
                "dump_work_ms": work_s * 1e3,
                "hidden_share": 1.0 - max(0.0, pair["increase"]) / work_s if work_s else 1.0,
            }
        results.append(row)
        print(
            f"  [A] load {load:.2f}: none {med['none'] * 1e3:.2f} ms, "
            + ", ".join(f"{m} {med[m] * 1e3:.2f} ms" for m in MODES_A[1:]),
            flush=True,
        )
    for sched in scheds.values():
        sched.shutdown()
    return {
        "layers": layers,
        "requests": requests,
        "kv_bytes_per_request_layer": kv_bytes,
        "bytes_per_step": payload,
        "compute_ms_per_step": base * 1e3,
        "workers": args.workers,
        "rows": results,
    }


# ======================================================================================
# Part B: real vLLM (child process per connector)
# ======================================================================================
def _child_llm(spec: dict[str, Any], store_dir: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if spec["connector"] == "ucm":
        ktc = KVTransferConfig(
            kv_connector="UCMPatchConnector",
            kv_connector_module_path="ucm_patch.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"store": "local", "local_path": store_dir},
        )
    else:
        ktc = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": store_dir},
        )
    return LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=4096,
        max_num_batched_tokens=8192,
        max_num_seqs=max(4, spec["prompts"]),
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_transfer_config=ktc,
    )


def child(spec_path: str, out_path: str) -> int:
    import random

    spec = json.loads(Path(spec_path).read_text())
    busy = Busy()
    latency_s = spec["store_latency_us"] / 1e6
    bw = [spec.get("store_bandwidth_Bps") or 1e12]  # set after the baseline when None
    nbytes_put = [0]
    from ucm_patch.hooks.stores.local import scratch_memory_tiers

    tmpdir = tempfile.TemporaryDirectory(prefix="bench-overlap-", dir=spec.get("tmp"))
    with tmpdir as tmp, scratch_memory_tiers():
        if spec["connector"] == "ucm":
            from ucm_patch.connector import kv_connector as connector

            orig_make = connector.make_store
            holder: dict[str, Any] = {}

            def make_store(cfg: Any, *, value_bytes: int = 0) -> Any:
                store = orig_make(cfg, value_bytes=value_bytes)
                holder["store"] = make_latency_store(store, latency_s, bw[0], busy)
                return holder["store"]

            connector.make_store = make_store  # this child only: wrap the configured store
        else:
            import safetensors.torch

            orig_save = safetensors.torch.save_file

            def save_file(tensors: dict[str, Any], filename: str, *a: Any, **kw: Any) -> None:
                t0 = time.perf_counter_ns()
                n = sum(t.numel() * t.element_size() for t in tensors.values())
                nbytes_put[0] += n
                orig_save(tensors, filename, *a, **kw)
                spend(latency_s, n, bw[0])
                busy.add(time.perf_counter_ns() - t0)

            safetensors.torch.save_file = save_file
        llm = _child_llm(spec, tmp)
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        rng = random.Random(7)
        core = llm.llm_engine.engine_core.engine_core
        conn_sched = core.scheduler.connector

        if spec["connector"] == "ucm":
            from ucm_patch.hooks.dump import get_scheduler

            dump_sched = get_scheduler()
            side = conn_sched.scheduler_side

            def set_mode(mode: str) -> None:
                side.can_dump = mode != "off"
                dump_sched.blocking_finish = mode == "blocking"

            def settle() -> None:
                if not connector.wait_for_dumps(60):
                    raise RuntimeError("bench_overlap: dumps did not finish in 60 s")

            modes = ("off", "async", "blocking")
        else:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker_conn = get_kv_transfer_group()

            def set_mode(mode: str) -> None:
                if mode == "off":
                    worker_conn.save_kv_layer = lambda *a, **k: None
                else:
                    worker_conn.__dict__.pop("save_kv_layer", None)

            def settle() -> None:
                return None

            modes = ("off", "sync")

        def run_once() -> float:
            prompts = [
                {"prompt_token_ids": [rng.randrange(4, 1000) for _ in range(spec["prompt_len"])]}
                for _ in range(spec["prompts"])
            ]
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            settle()
            return dt

        for mode in modes:  # warm up every path
            set_mode(mode)
            for _ in range(2):
                run_once()
        if spec.get("store_bandwidth_Bps") is None:
            set_mode("off")
            base = statistics.median(run_once() for _ in range(3))
            set_mode(modes[1])
            busy.ns = 0
            nbytes0 = _bytes_written(spec, holder if spec["connector"] == "ucm" else None)
            nbytes_put[0] = 0
            run_once()
            n = _bytes_written(spec, holder if spec["connector"] == "ucm" else None) - nbytes0
            n = n or nbytes_put[0]
            # Dump work ~= load x prefill compute: bytes / bandwidth takes what latency leaves.
            calls = max(1, spec["calls_per_generate"])
            bw[0] = n / max(1e-4, spec["load"] * base - calls * latency_s)
            if spec["connector"] == "ucm":
                holder["store"].bandwidth_Bps = bw[0]
        times: dict[str, list[float]] = {m: [] for m in modes}
        work: dict[str, float] = dict.fromkeys(modes, 0.0)
        puts: dict[str, int] = dict.fromkeys(modes, 0)
        for _ in range(spec["rounds"]):
            for mode in modes:
                set_mode(mode)
                busy.ns = 0
                nbytes_put[0] = 0
                times[mode].append(run_once())
                work[mode] += busy.ns / 1e9
                puts[mode] += nbytes_put[0]
        out: dict[str, Any] = {
            "times_s": times,
            "work_s": {m: work[m] / spec["rounds"] for m in modes},
            "store_bandwidth_Bps": bw[0],
        }
        if spec["connector"] == "ucm":
            out["stats"] = connector.stats()
        else:
            out["bytes_saved_per_generate"] = puts["sync"] / spec["rounds"]
        Path(out_path).write_text(json.dumps(out))
    return 0


def _bytes_written(spec: dict[str, Any], holder: dict[str, Any] | None) -> int:
    if holder is None:
        return 0
    from ucm_patch.connector import kv_connector as connector

    connector.wait_for_dumps(60)
    return int(holder["store"].inner.stats["bytes_written"])


def part_b(args: argparse.Namespace) -> dict[str, Any]:
    model = bc.ensure_model(
        "qwen3_small", bc.MODELS / "small-qwen3", "--layers", "8", "--hidden", "512"
    )
    spec = {
        "model": str(model),
        "prompts": args.b_prompts,
        "prompt_len": args.b_prompt_len,
        "rounds": args.b_rounds,
        "store_latency_us": args.b_store_latency_us,
        "store_bandwidth_Bps": None,
        "load": args.b_load,
        "connector": "ucm",
        "calls_per_generate": 8,  # one put per storage row (8 layers)
    }
    ucm = bc.run_child(Path(__file__), spec, "overlap-ucm")
    spec_ex = dict(spec, connector="example", store_bandwidth_Bps=ucm["store_bandwidth_Bps"])
    example = bc.run_child(Path(__file__), spec_ex, "overlap-example", check=False)
    # The same UCM workload with vLLM computing on one thread: the host's other core is
    # left to the dump threads, as a GPU host leaves its CPU to them while the device
    # computes. Baseline and dump modes run under the same setting, so the ratio is fair.
    one_core_env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    ucm_1 = bc.run_child(Path(__file__), spec, "overlap-ucm-1core", env=one_core_env)
    out: dict[str, Any] = {
        "model": "small Qwen3 (8 layers, hidden 512), bf16, eager",
        "prompts": args.b_prompts,
        "prompt_len": args.b_prompt_len,
        "rounds": args.b_rounds,
        "store_latency_us": args.b_store_latency_us,
        "store_bandwidth_MBps": ucm["store_bandwidth_Bps"] / 1e6,
        "rows": [],
    }

    def rows_of(
        label: str, res: dict[str, Any], base: str, modes: Sequence[str], target: bool = False
    ) -> None:
        t = res["times_s"]
        b = statistics.median(t[base])
        for mode in modes:
            # One generate per mode per round, the modes back to back: paired by round.
            pair = bc.paired(t[base], t[mode])
            work = res["work_s"][mode]
            out["rows"].append(
                {
                    "connector": label,
                    "mode": mode,
                    "ms_without": b * 1e3,
                    "ms_with": statistics.median(t[mode]) * 1e3,
                    "ratio": pair["ratio"],
                    "ratio_ci95": pair["ratio_ci95"],
                    "increase_ms": pair["increase"] * 1e3,
                    "dump_work_ms": work * 1e3,
                    "hidden_share": 1.0 - max(0.0, pair["increase"]) / work if work else None,
                    "target": target,
                }
            )

    rows_of("UCMPatchConnector", ucm, "off", ("async", "blocking"))
    # The budget row: compute on one core, the other left to the dumps (a GPU host's CPU
    # while its device computes). With compute on both cores of a 2-core host the dump's
    # own CPU work (page copy, checksum, file write) can only add to the step.
    rows_of("UCMPatchConnector, compute on 1 thread", ucm_1, "off", ("async", "blocking"), True)
    out["ucm_stats"] = ucm.get("stats")
    if "error" in example:
        out["example_error"] = example["error"]
    else:
        rows_of("ExampleConnector (vLLM)", example, "off", ("sync",))
        out["example_bytes_saved_per_generate"] = example.get("bytes_saved_per_generate")
    return out


# ======================================================================================
# main
# ======================================================================================
def print_tables(res: dict[str, Any]) -> None:
    a = res.get("scheduler")
    if a:
        print(
            f"A. scheduler level: {a['layers']} layers, {a['compute_ms_per_step']:.1f} ms compute"
            f" per step, {a['bytes_per_step'] / 2**20:.1f} MiB dumped per step"
        )
        rows = []
        for row in a["rows"]:
            for mode, m in row["modes"].items():
                rows.append(
                    (
                        f"{row['load']:.2f}",
                        mode,
                        f"{row['step_ms_none']:.2f}",
                        f"{m['step_ms']:.2f}",
                        f"{m['ratio']:.3f}",
                        f"{m['dump_work_ms']:.2f}",
                        f"{m['hidden_share'] * 100:.1f} %",
                    )
                )
        print(
            bc.table(
                (
                    "dump work / compute",
                    "mode",
                    "step ms, no dumps",
                    "step ms, dumps",
                    "ratio (<= 1.05)",
                    "dump work ms/step",
                    "hidden (>= 95 %)",
                ),
                rows,
            )
        )
    b = res.get("vllm")
    if b:
        print(
            f"B. real vLLM CPU: {b['model']}, {b['prompts']} x {b['prompt_len']}-token prefills, "
            f"store {b['store_latency_us']:.0f} us + {b['store_bandwidth_MBps']:.0f} MB/s"
        )
        rows = [
            (
                r["connector"],
                r["mode"],
                f"{r['ms_without']:.1f}",
                f"{r['ms_with']:.1f}",
                f"{r['ratio']:.3f}",
                f"{r['dump_work_ms']:.1f}",
                "n/a" if r["hidden_share"] is None else f"{r['hidden_share'] * 100:.1f} %",
            )
            for r in b["rows"]
        ]
        print(
            bc.table(
                (
                    "connector",
                    "mode",
                    "ms, dumps off",
                    "ms, dumps on",
                    "ratio",
                    "dump work ms",
                    "hidden",
                ),
                rows,
            )
        )
        if "example_error" in b:
            print(f"ExampleConnector did not run: {b['example_error']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="scheduler,vllm", help="comma list: scheduler, vllm")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--dim", type=int, default=320, help="matmul size of one layer's compute")
    ap.add_argument("--kv-bytes", type=int, default=32768, help="bytes per request per layer")
    ap.add_argument("--store-latency-us", type=float, default=50.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 0.9],
        help="dump work as a fraction of compute (one row each)",
    )
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--b-prompts", type=int, default=2)
    ap.add_argument("--b-prompt-len", type=int, default=1024)
    ap.add_argument("--b-rounds", type=int, default=12)
    ap.add_argument("--b-store-latency-us", type=float, default=200.0)
    ap.add_argument("--b-load", type=float, default=0.5, help="dump work / prefill compute")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.loads, args.b_rounds = 2, 5, [0.5], 3
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - {"scheduler", "vllm"}:
        ap.error(f"--parts: unknown {sorted(parts - {'scheduler', 'vllm'})}")
    load0 = os.getloadavg()[0]
    res: dict[str, Any] = {}
    if "scheduler" in parts:
        res["scheduler"] = part_a(args)
    if "vllm" in parts:
        res["vllm"] = part_b(args)
    payload = {
        "bench": "overlap",
        "params": {k: v for k, v in vars(args).items() if k != "quick"},
        "machine": bc.machine(load0),
        "targets": {"ratio_max": 1.05, "hidden_min": 0.95},
        "results": res,
    }
    path = bc.write_result("overlap", payload)
    print_tables(res)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
