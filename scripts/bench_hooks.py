"""Per-layer, per-step cost the GDN wrappers add (benchmark, not a test).

Budget: per GDN layer per step, < 1 us added with no KV connector configured,
< 2 us added with a connector that has nothing to dump.

Measured on the real wrapper code, real ``ucm_patch.hooks.layerwise`` bound to the real
vLLM modules (``kv_transfer_state``, ``get_forward_context`` with a forward context set
through ``override_forward_context``), around a GDN core that does nothing, so the
difference to the unwrapped call is exactly what ucm_patch adds:

* ``method``: ``QwenGatedDeltaNetAttention._forward_core``-style method wrapper (CUDA /
  ROCm paths), called with keywords as vLLM's op calls it;
* ``cpu op``: the kernel wrapper of ``vllm::cpu_gdn_attention_core``, called positionally
  with a ``LayerName``-encoded name as the dispatcher does on 0.32 CPU.

Each path is measured applied three ways: ``registry`` (the record applied by a real
``ucm_patch.registry.Registry``: the exact-signature trampoline with the call-time guard
inline, what runs in production; the CPU-op record is applied as a plain wrap of a
stand-in module function, so torch's dispatcher cost, which is upstream's, is left out),
``wrapt`` (a bare ``wrapt.FunctionWrapper`` around the same wrapper, the installer used
before the trampolines and still used for targets they cannot take) and ``closure`` (the
wrapper called from a plain ``*args, **kwargs`` function), so the cost of each
application layer is visible separately.

The "connector, nothing to dump" case uses the tests' stand-in connector with metadata bound
and recording off (``tests.support.standin_connector``): its ``wait_for_layer_load`` /
``save_kv_layer`` return at once, so the figure is the hooks' own cost.

Usage: python scripts/bench_hooks.py [--number N] [--repeat R] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
import types
from pathlib import Path
from typing import Any

import torch
import wrapt

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support

import bench_common as bc

LAYER = "model.layers.0.linear_attn"
BUDGET_NS = {"no connector": 1000.0, "connector, nothing to dump": 2000.0}


def _core(self: Any, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> None:
    return None


def _kernel(mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any, layer_name: Any) -> None:
    return None


def _closure_method(orig: Any, wrapper: Any) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrapper(orig.__get__(self), self, args, kwargs)

    return method


def _closure_function(orig: Any, wrapper: Any) -> Any:
    def function(*args: Any, **kwargs: Any) -> Any:
        return wrapper(orig, None, args, kwargs)

    return function


def _best_ns(stmt: Any, number: int, repeat: int) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e9


def run(number: int, repeat: int) -> list[dict[str, Any]]:
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import override_forward_context
    from vllm.utils.torch_utils import _encode_layer_name

    from tests.support.standin_connector import StandInConnector
    from ucm_patch.hooks import layerwise
    from ucm_patch.patches.vllm import gdn_layerwise

    class Plain:
        _forward_core = _core

    class Wrapped:
        _forward_core = wrapt.FunctionWrapper(_core, gdn_layerwise.make_method_wrapper())

    class Closure:
        _forward_core = _closure_method(_core, gdn_layerwise.make_method_wrapper())

    class Applied:
        _forward_core = _core

    by_era = {r.era: r for r in gdn_layerwise.RECORDS}
    bc.registry_applied(by_era["vllm-0.22"], "ucm_bench_method", "Applied._forward_core", Applied)
    kernel_mod = bc.registry_applied(
        by_era["vllm-0.21-cpu"], "ucm_bench_kernel", "cpu_gdn_attention_core", _kernel
    )
    kernel_applied = kernel_mod.cpu_gdn_attention_core

    kv = [torch.zeros(1), torch.zeros(1)]
    plain, wrapped, closure, applied = Plain(), Wrapped(), Closure(), Applied()
    for layer in (plain, wrapped, closure, applied):
        layer.prefix = LAYER
        layer.kv_cache = kv
    kernel = wrapt.FunctionWrapper(_kernel, gdn_layerwise.make_cpu_op_wrapper())
    kernel_closure = _closure_function(_kernel, gdn_layerwise.make_cpu_op_wrapper())
    encoded = _encode_layer_name(LAYER)
    x = torch.zeros(1)
    fc = types.SimpleNamespace(
        attn_metadata={LAYER: object()}, no_compile_layers={LAYER: wrapped}, virtual_engine=0
    )

    def m_plain() -> None:
        plain._forward_core(mixed_qkv=x, b=x, a=x, core_attn_out=x)

    def m_wrapped() -> None:
        wrapped._forward_core(mixed_qkv=x, b=x, a=x, core_attn_out=x)

    def m_applied() -> None:
        applied._forward_core(mixed_qkv=x, b=x, a=x, core_attn_out=x)

    def k_applied() -> None:
        kernel_applied(x, x, x, x, encoded)

    def m_closure() -> None:
        closure._forward_core(mixed_qkv=x, b=x, a=x, core_attn_out=x)

    def k_plain() -> None:
        _kernel(x, x, x, x, encoded)

    def k_wrapped() -> None:
        kernel(x, x, x, x, encoded)

    def k_closure() -> None:
        kernel_closure(x, x, x, x, encoded)

    rows = []
    saved = kv_transfer_state._KV_CONNECTOR_AGENT
    try:
        with override_forward_context(fc):  # type: ignore[arg-type]
            for case, conn in (
                ("no connector", None),
                ("connector, nothing to dump", StandInConnector(record=False)),
            ):
                kv_transfer_state._KV_CONNECTOR_AGENT = conn
                paths = (
                    ("method", "registry", m_plain, m_applied),
                    ("method", "wrapt", m_plain, m_wrapped),
                    ("method", "closure", m_plain, m_closure),
                    ("cpu op", "registry", k_plain, k_applied),
                    ("cpu op", "wrapt", k_plain, k_wrapped),
                    ("cpu op", "closure", k_plain, k_closure),
                )
                for path, how, base, wrap in paths:
                    layerwise.reset_for_tests()
                    wrap()  # warm up; with a connector this must hook the layer
                    if conn is not None and layerwise.calls["save"] != 1:
                        raise RuntimeError(f"{path}/{how}: the wrapper did not hook the layer")
                    b_ns = _best_ns(base, number, repeat)
                    w_ns = _best_ns(wrap, number, repeat)
                    rows.append(
                        {
                            "case": case,
                            "path": path,
                            "applied_as": how,
                            "baseline_ns": round(b_ns, 1),
                            "wrapped_ns": round(w_ns, 1),
                            "added_ns": round(w_ns - b_ns, 1),
                            "budget_ns": BUDGET_NS[case],
                        }
                    )
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved
        layerwise.reset_for_tests()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = run(args.number, args.repeat)
    print(f"python {sys.version.split()[0]}, wrapt {wrapt.__version__}, torch {torch.__version__}")
    print(
        f"{'case':28} {'path':7} {'as':8} {'baseline':>9} {'wrapped':>9} {'added':>8} {'budget':>7}"
    )
    over = 0
    for r in rows:
        ok = r["added_ns"] < r["budget_ns"]
        over += not ok
        print(
            f"{r['case']:28} {r['path']:7} {r['applied_as']:8} {r['baseline_ns']:>7.0f}ns "
            f"{r['wrapped_ns']:>7.0f}ns {r['added_ns']:>6.0f}ns {r['budget_ns']:>5.0f}ns "
            f"{'ok' if ok else 'OVER'}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
