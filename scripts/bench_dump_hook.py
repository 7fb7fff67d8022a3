"""Per-layer host cost of the save path *with a dump*: hook -> our connector -> DumpScheduler.

Completes the hook-overhead figures of ``bench_hooks.py`` (bare, ucm_patch idle, connector
with nothing to dump) with the case that does work (goal G2:
<= 1.5 us per layer on the host, no allocation on the hot path).

Real objects end to end: a real :class:`ucm_patch.connector.UCMPatchConnector` (worker
role) over a 48-layer KV cache (one storage row per layer, so *every* layer call submits a
dump), its real worker side and the process's real
:class:`~ucm_patch.hooks.dump.DumpScheduler` (dumping into an in-memory store: the
store's speed is ``bench_stores.py``'s subject); vLLM's real ``kv_transfer_state`` and
forward context. Each step binds a
metadata object with ``--requests`` requests x ``--blocks`` blocks to dump (pinned, as on
vLLM 0.32: the page copy runs later on a dump thread), then runs the 48 layer calls timed
as one loop; the dumps run on the scheduler's threads meanwhile, as in production.

Each layer call is timed on its own (``perf_counter_ns`` around it; the timer's cost is in
the bare-function row and cancels in "added"). Per step: the median call, and the mean
per layer over the whole loop (this one includes the calls that lost the GIL to a dump
thread, i.e. what the forward thread really paid). Reported: the median over steps, for:

* ``connector.save_kv_layer``: what vLLM's own attention path pays per layer into our
  connector (``maybe_transfer_kv_layer`` calls it): row lookup + submit_layer;
* ``GDN kernel wrapper``: the ``gdn_layerwise`` CPU-op record applied by a real Registry
  around a no-op GDN core: gate, ``wait_for_layer_load``, core, ``save_kv_layer``, submit;
* the same two with the connector bound but nothing to dump this step.

Usage: python scripts/bench_dump_hook.py [--steps 400] [--requests 4] [--blocks 4]
Prints a table and writes ``bench-results/dump_hook.json``. Not a test.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support.connector_harness

import bench_common as bc

from ucm_patch.hooks.stores.base import KVStore

LAYERS = tuple(f"model.layers.{i}.linear_attn" for i in range(48))
BUDGET_NS = 1500.0  # goal G2: the save path at the speed of peer offload systems


class MemoryStore(KVStore):
    """A dict store the connector dumps into (dict operations are atomic under the GIL).

    What is measured is the forward thread's cost; the store's own speed is
    ``bench_stores.py``'s subject. A file store would make every step wait for hundreds of
    tiny files between the timed loops and add file-system noise to the dump threads.
    """

    name = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def put_many(self, items: Sequence[tuple[str, Any]]) -> list[bool]:
        for key, value in items:
            self.data.setdefault(key, bytes(value))
        return [True] * len(items)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.data.get(k) for k in keys]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.data for k in keys]


def _kernel(mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any, layer_name: Any) -> None:
    return None


def _apply_cpu_op_record(obj: Any) -> Any:
    """The ``gdn_layerwise`` CPU-op record applied by a real Registry to a stand-in module,
    without the record's ``skip_when``."""
    from ucm_patch.patches.vllm import gdn_layerwise

    src = {r.era: r for r in gdn_layerwise.RECORDS}["vllm-0.21-cpu"]
    name = "cpu_gdn_attention_core"
    module = bc.registry_applied(src, "ucm_bench_dump_kernel", name, obj, skip_when=False)
    return module.cpu_gdn_attention_core


def _best_ns(fn: Any, calls: int = 48, repeat: int = 300) -> float:
    """Fastest of ``repeat`` loops of ``calls`` calls, per call (timeit: the floor)."""
    import timeit

    return min(timeit.repeat(fn, number=calls, repeat=repeat)) / calls * 1e9


def profile(
    conn: Any, sched: Any, kernel: Any, encoded: list[Any], x: Any, metadata: Any, drain: Any
) -> dict[str, float]:
    """Where the per-layer time of "GDN kernel wrapper -> connector, with a dump" goes:
    each piece of the path timed alone (fastest loop, ns per call), and the unit they are
    made of, one Python call, on this machine. The wrapper path runs ten Python frames:
    trampoline, layer bracket, has_connector_metadata, wait_for_layer_load, shim, the
    kernel, save_kv_layer, submit_layer, EventLedger.resolve, the event's record."""
    from ucm_patch import guard, trampoline
    from ucm_patch.hooks import layerwise

    def five(a: Any, b: Any, c: Any, d: Any, e: Any) -> None:
        return None

    def passthrough(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    cell = guard.CallCell()
    enabled = guard.make_enabled(cell, layerwise.idle)
    tramp = trampoline.make_trampoline(
        _kernel, passthrough, enabled, False, cell, lambda exc: None, lambda: False
    )
    name, e0 = LAYERS[0], encoded[0]
    parts: dict[str, float] = {}
    parts["empty loop"] = _best_ns(lambda: None)
    parts["Python call, 5 arguments (the unit)"] = _best_ns(lambda: five(x, x, x, x, e0))
    parts["trampoline + guard around a pass-through wrapper"] = _best_ns(
        lambda: tramp(x, x, x, x, e0)
    )
    md = metadata(True)
    conn.bind_connector_metadata(md)
    conn.start_load_kv(None)
    parts["connector.has_connector_metadata"] = _best_ns(conn.has_connector_metadata)
    parts["connector.wait_for_layer_load, nothing loading"] = _best_ns(
        lambda: conn.wait_for_layer_load(name)
    )
    ledger, pool = sched.events, sched.device.free_events

    def resolve() -> None:
        pool.append(ledger.resolve(name, None)[0])

    parts["EventLedger.resolve (+ list append to give the event back)"] = _best_ns(resolve)
    side = conn.worker_side
    batch = side.open_batch
    plans = (side.row_plan(row) for row in range(len(conn.layout.rows)))
    keys, produce = next(p for p in plans if p is not None)
    per_call: list[int] = []
    pc = time.perf_counter_ns
    for _ in range(50):
        drain()
        for i in range(48):
            t0 = pc()
            sched.submit_layer(batch, LAYERS[i], None, i, keys, produce)
            per_call.append(pc() - t0)
    parts["DumpScheduler.submit_layer (resolve + enqueue)"] = float(min(per_call))
    conn.wait_for_save()
    drain()
    conn.get_finished(set(md.dumps))
    conn.clear_connector_metadata()
    return parts


def run(steps: int, requests: int, blocks: int) -> dict[str, Any]:
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import override_forward_context
    from vllm.utils.torch_utils import _encode_layer_name
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from tests.support.connector_harness import SPEC, vllm_config
    from ucm_patch.connector import UCMPatchConnector
    from ucm_patch.connector import kv_connector as connector
    from ucm_patch.connector.meta import UCMConnectorMetadata
    from ucm_patch.hooks import layerwise
    from ucm_patch.hooks.dump import get_scheduler

    num_blocks = requests * blocks + 1
    page = SPEC.page_size_bytes
    kvcc = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=len(LAYERS) * num_blocks * page,
                layers=list(LAYERS),
                layer_stride=num_blocks * page,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), SPEC)],
    )
    tmp = tempfile.TemporaryDirectory(prefix="bench-dump-hook-")
    cfg = vllm_config({"store": "local", "local_path": tmp.name}, model="bench-dump-hook")
    connector.make_store = lambda _config, **_kw: MemoryStore()  # this process only: MemoryStore
    conn = UCMPatchConnector(cfg, KVConnectorRole.WORKER, kvcc)
    buf = torch.zeros(len(LAYERS) * num_blocks * page, dtype=torch.int8)
    conn.register_kv_caches(dict.fromkeys(LAYERS, buf))
    if len(conn.layout.rows) != len(LAYERS):
        raise RuntimeError(f"expected one row per layer, got {len(conn.layout.rows)} rows")
    sched = get_scheduler()
    kernel = _apply_cpu_op_record(_kernel)
    encoded = [_encode_layer_name(name) for name in LAYERS]
    x = torch.zeros(1)
    owner = types.SimpleNamespace(kv_cache=buf)
    fc = types.SimpleNamespace(
        attn_metadata=dict.fromkeys(LAYERS, types.SimpleNamespace()),
        no_compile_layers=dict.fromkeys(LAYERS, owner),
        virtual_engine=0,
    )
    step_no = [0]

    def metadata(dump: bool) -> UCMConnectorMetadata:
        step_no[0] += 1
        s = step_no[0]
        dumps = {
            f"s{s}-r{r}": [
                (0, (1 + r * blocks + b,), f"{s:08x}{r:04x}{b:04x}") for b in range(blocks)
            ]
            for r in range(requests)
        }
        return UCMConnectorMetadata(step=s, dumps=dumps if dump else {}, pinned=True)

    pc = time.perf_counter_ns
    n = len(LAYERS)
    ts = [0] * (n + 1)

    def loop_bare() -> None:
        k = _kernel
        for i in range(n):
            ts[i] = pc()
            k(x, x, x, x, encoded[i])
        ts[n] = pc()

    def loop_save() -> None:
        save = conn.save_kv_layer
        for i in range(n):
            ts[i] = pc()
            save(LAYERS[i], buf, None)
        ts[n] = pc()

    def loop_wrapper() -> None:
        k = kernel
        for i in range(n):
            ts[i] = pc()
            k(x, x, x, x, encoded[i])
        ts[n] = pc()

    def drain() -> None:
        while sched.internal_sizes()["slots_in_use"]:
            time.sleep(0.0005)

    def one_step(body: Any, dump: bool) -> tuple[float, float]:
        """(median ns of one layer call, mean ns per layer over the whole loop)."""
        drain()  # each step starts with idle dump threads; its own dumps run during it
        md = metadata(dump)
        conn.bind_connector_metadata(md)
        conn.start_load_kv(None)
        body()
        conn.wait_for_save()
        conn.get_finished(set(md.dumps))
        conn.clear_connector_metadata()
        per_call = [ts[i + 1] - ts[i] for i in range(n)]
        return statistics.median(per_call), (ts[n] - ts[0]) / n

    cases = (
        ("connector.save_kv_layer", loop_save),
        ("GDN kernel wrapper -> connector", loop_wrapper),
    )
    saved = kv_transfer_state._KV_CONNECTOR_AGENT
    layerwise.bind()
    results: dict[str, Any] = {}
    try:
        kv_transfer_state._KV_CONNECTOR_AGENT = conn
        with override_forward_context(fc):  # type: ignore[arg-type]
            completed0 = sched.metrics.dumps_completed
            for body in (loop_bare, loop_save, loop_wrapper):  # warm up every path
                for dump in (False, True):
                    for _ in range(20):
                        one_step(body, dump)
            per: dict[str, list[tuple[float, float]]] = {"bare function": []}
            for label, _ in cases:
                per[f"{label}, nothing to dump"] = []
                per[f"{label}, with a dump"] = []
            gc.collect()
            gc.disable()  # a collection inside one timed loop is noise, not hook cost
            try:
                for _ in range(steps):
                    per["bare function"].append(one_step(loop_bare, False))
                    for label, body in cases:
                        per[f"{label}, nothing to dump"].append(one_step(body, False))
                        per[f"{label}, with a dump"].append(one_step(body, True))
            finally:
                gc.enable()
            drain()
            conn.get_finished(set())
            dumps = sched.metrics.dumps_completed - completed0
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved
    expected = (20 * 2 + steps * 2) * len(LAYERS)  # warm-up + timed dump steps, 2 paths
    if dumps < expected:
        raise RuntimeError(f"only {dumps} of {expected} dumps completed: a path did not submit")
    with override_forward_context(fc):  # type: ignore[arg-type]
        kv_transfer_state._KV_CONNECTOR_AGENT = conn
        try:
            parts = profile(conn, sched, kernel, encoded, x, metadata, drain)
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = saved
    bare = statistics.median(m for m, _ in per["bare function"])
    bare_mean = statistics.median(a for _, a in per["bare function"])
    for name, xs in per.items():
        med = statistics.median(m for m, _ in xs)
        mean = statistics.median(a for _, a in xs)
        results[name] = {
            "ns_per_call_median": med,
            "ns_per_layer_incl_stalls": mean,
            "added_ns": med - bare,
            "added_ns_incl_stalls": mean - bare_mean,
        }
    conn.shutdown()
    tmp.cleanup()
    return {
        "layers": len(LAYERS),
        "requests": requests,
        "blocks_per_request": blocks,
        "steps": steps,
        "dumps_completed": dumps,
        "budget_ns": BUDGET_NS,
        "paths": results,
        "profile": parts,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4, help="blocks per request per step")
    args = ap.parse_args(argv)
    for name in ("steps", "requests", "blocks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    import os

    load0 = os.getloadavg()[0]
    res = run(args.steps, args.requests, args.blocks)
    payload = {"bench": "dump_hook", "machine": bc.machine(load0), "results": res}
    path = bc.write_result("dump_hook", payload)
    rows = []
    for name, r in res["paths"].items():
        dump = "with a dump" in name
        verdict = ""
        if dump:
            verdict = f"<= {BUDGET_NS:.0f} " + ("met" if r["added_ns"] <= BUDGET_NS else "MISSED")
        rows.append(
            (
                name,
                f"{r['ns_per_call_median']:.0f}",
                f"{r['added_ns']:.0f}",
                f"{r['added_ns_incl_stalls']:.0f}",
                verdict,
            )
        )
    print(
        f"{res['layers']} layers, one row each; {res['requests']} requests x "
        f"{res['blocks_per_request']} blocks dumped per layer per step; {res['steps']} steps"
    )
    print(
        bc.table(
            (
                "path",
                "ns per call (median)",
                "added over bare",
                "added, step mean (incl. GIL stalls)",
                "G2 target (added)",
            ),
            rows,
        )
    )
    print("where the time goes (each piece alone, fastest loop, ns per call):")
    print(bc.table(("piece", "ns"), [(k, f"{v:.0f}") for k, v in res["profile"].items()]))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
