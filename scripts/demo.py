"""`make demo`: run real vLLM (CPU) with the ucm_patch plugin and print what it did.

Replaced by the connector demo once the KV connector lands (issue 8); for now it shows the
patch status table inside a real vLLM run on the tiny Qwen3-Next (GDN + attention).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "ucm_patch")


def main() -> int:
    from vllm import LLM, SamplingParams

    import ucm_patch
    from ucm_patch.table import format_table

    model = str(REPO / "models" / "tiny-qwen3-next")
    llm = LLM(
        model=model,
        max_model_len=128,
        enforce_eager=True,
        dtype="bfloat16",
        max_num_seqs=2,
        max_num_batched_tokens=128,
    )
    out = llm.generate(["hello world this is"], SamplingParams(max_tokens=4, temperature=0))
    print("generated:", list(out[0].outputs[0].token_ids))
    print(format_table(ucm_patch.report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
