"""Run real vLLM (CPU) in a subprocess with the stand-in connector, and read what it saw.

Why a subprocess: a vLLM engine cannot be torn down cleanly inside pytest, and each run
must start from a fresh import state (patches applied or not, by environment only).

``run_vllm(...)`` starts ``python -m tests.support.vllm_helpers`` (the ``_main`` below)
with the repository root on ``PYTHONPATH`` (so vLLM can import
``tests.support.standin_connector``, which writes every call to ``$UCM_TEST_RECORD``),
generates a few tokens for two prompts in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and returns the recorded connector calls plus the
process's ucm_patch report and hook counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import STANDIN_CONNECTOR, repo_pythonpath

PYTHON = sys.executable
RUN_TIMEOUT_S = 600

GDN_LAYER = "model.layers.0.linear_attn"  # tiny Qwen3-Next: layer 0 is GDN
ATTN_LAYER_NEXT = "model.layers.1.self_attn.attn"  # ... layer 1 full attention


@dataclass
class VllmRun:
    """What one generation run recorded."""

    calls: list[dict[str, Any]]
    report: list[dict[str, Any]] = field(default_factory=list)
    hook_calls: dict[str, int] = field(default_factory=dict)
    stderr_tail: str = ""

    def per_layer(self, call: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for c in self.calls:
            if c["call"] == call:
                counts[c["layer"]] = counts.get(c["layer"], 0) + 1
        return counts

    def steps(self) -> list[list[dict[str, Any]]]:
        """Per-layer calls grouped by forward step; ``wait_for_save`` closes a step.

        (``start_load_kv`` does not open one: from vLLM 0.32 it runs *after* the forward
        when no load is synchronous.) Steps with no per-layer call are dropped; calls after
        the last ``wait_for_save`` are an error.
        """
        steps: list[list[dict[str, Any]]] = []
        current: list[dict[str, Any]] = []
        for c in self.calls:
            if c["call"] == "wait_for_save":
                steps.append(current)
                current = []
            elif c["call"] in ("wait_for_layer_load", "save_kv_layer"):
                current.append(c)
        if current:
            raise AssertionError(f"per-layer calls after the last wait_for_save: {current}")
        return [s for s in steps if s]

    def state_of(self, record_id: str) -> str:
        for r in self.report:
            if r["id"] == record_id:
                return r["state"]
        raise KeyError(f"record {record_id!r} not in the report")


def run_vllm(
    model: Path,
    tmp: Path,
    env: dict[str, str] | None = None,
    hybrid: bool = False,
    max_tokens: int = 3,
) -> VllmRun:
    """Generate with real vLLM and the stand-in connector; raise with stderr on failure."""
    record = tmp / "calls.jsonl"
    result = tmp / "result.json"
    for p in (record, result):
        if p.exists():
            p.unlink()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_PATCH")}
    child_env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "PYTHONPATH": repo_pythonpath(),
            "UCM_TEST_RECORD": str(record),
        }
    )
    child_env.update(env or {})
    cmd = [
        PYTHON,
        "-m",
        "tests.support.vllm_helpers",
        str(model),
        str(result),
        "hybrid" if hybrid else "plain",
        str(max_tokens),
    ]
    proc = subprocess.run(
        cmd, env=child_env, cwd=tmp, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    if proc.returncode != 0 or not result.exists():
        raise AssertionError(
            f"vLLM run failed (rc={proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-6000:]}"
        )
    calls = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    data = json.loads(result.read_text())
    return VllmRun(
        calls=calls,
        report=data["report"],
        hook_calls=data["hook_calls"],
        stderr_tail=proc.stderr[-3000:],
    )


def _main(argv: list[str]) -> int:
    """Child process: ``MODEL RESULT_JSON hybrid|plain MAX_TOKENS``."""
    model, result, mode, max_tokens = argv
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    if os.environ.get("UCM_TEST_NATIVE_GDN") == "1":
        _bracket_cpu_gdn_op_natively()
    import ucm_patch  # activates from the environment, as a user's import would
    from ucm_patch.hooks import layerwise

    kwargs: dict[str, Any] = {}
    if mode == "hybrid":
        kwargs["disable_hybrid_kv_cache_manager"] = False
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=KVTransferConfig(**STANDIN_CONNECTOR, kv_role="kv_both"),
        **kwargs,
    )
    llm.generate(
        ["hello world this is", "the quick brown fox jumps"],
        SamplingParams(max_tokens=int(max_tokens), temperature=0.0),
        use_tqdm=False,
    )
    Path(result).write_text(
        json.dumps({"report": ucm_patch.report(), "hook_calls": dict(layerwise.calls)})
    )
    return 0


def _bracket_cpu_gdn_op_natively() -> None:
    """Do what upstream would: decorate vLLM CPU's GDN op with vLLM's own
    ``maybe_transfer_kv_layer`` (as it brackets attention), before ucm_patch activates.

    ``register_cpu_gdn_attention_ops()`` reads the module global when the first GDN layer
    is built, so the decorated function is the kernel vLLM registers. Its signature is
    given with the annotations evaluated: ``infer_schema`` would otherwise evaluate the
    module's string annotations in the decorator's module, where they do not resolve.
    """
    import inspect

    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    plain = gdn_attention.cpu_gdn_attention_core
    decorated = maybe_transfer_kv_layer(plain)
    decorated.__signature__ = inspect.signature(plain, eval_str=True)
    gdn_attention.cpu_gdn_attention_core = decorated


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
