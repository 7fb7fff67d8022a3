"""One check of the runtime matrix, run by ``scripts/runtime_matrix.py`` inside a matrix venv.

Usage (the repository root on ``PYTHONPATH``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

* ``gdn MODEL OUT``: generate with the tests' counting connector
  (``tests.support.standin_connector``, every call a JSON line in ``$UCM_TEST_RECORD``);
  ucm_patch activates from the environment (``UCM_PATCH=0`` switches it off). Writes the
  model's GDN layer names (from its ``config.json``) and this process's report.
* ``e2e-dump MODEL STORE OUT``: UCMPatchConnector on a local store in ``STORE``: prompt 1
  (a prefix of two and a half blocks, derived from the block size vLLM chose) is computed
  and dumped; prompt 2 (same prefix, another tail) is computed under another
  ``cache_salt`` (a miss everywhere): the reference output.
* ``e2e-load MODEL STORE OUT``: a fresh process on the same store runs prompt 2: it loads
  the prefix's full blocks from the store.
* ``plain MODEL OUT``: prompt 1 without a connector (does this vLLM run the model at all).

Why a separate script and a ``__main__`` guard: some vLLM releases (0.22 on CPU) start a
worker process even in single-process mode, and a spawned worker re-imports the main
module; every run must also start from a fresh import state. Only APIs every release in the
matrix has are used (``LLM``, ``generate`` with token ids, ``cache_salt``, the connector's
public helpers).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

# Two and a half hybrid blocks of 1152 tokens (and a tail) must fit.
MAX_MODEL_LEN = 4096
SEED = 0


def gdn_layers(model: str) -> list[str]:
    """vLLM's names of the model's GDN layers, from ``layer_types`` in its config."""
    types = json.loads((Path(model) / "config.json").read_text())["layer_types"]
    return [f"model.layers.{i}.linear_attn" for i, t in enumerate(types) if t == "linear_attention"]


def token_ids(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids in [4, 1000) (the tiny models' vocabulary is 1024)."""
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(n)]


def _llm(model: str, kv_transfer_config: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        dtype="bfloat16",  # Qwen3-Next on vLLM CPU needs it; the tiny Qwen3 is bf16 too
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_MODEL_LEN,
        max_num_seqs=4,
        seed=SEED,
        enforce_eager=True,
        # What vLLM >= 0.32 picks by itself on this CPU (AVX-512 BF16 without AMX); 0.26
        # resets it only on AMX CPUs, and its GDN kernel then fails with "Input tensor
        # dtype mismatch" on bf16 states. Ignored by models without a mamba state.
        mamba_ssm_cache_dtype="float32",
        # Prompts are token ids: no tokenizer needed, and the tiny models' tokenizer files
        # (written by transformers 5) do not load in transformers 4 (vLLM <= 0.18 pins it).
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=False,
        kv_transfer_config=kv_transfer_config,
    )


def _generate(llm: Any, ids: list[int], salt: str | None = None) -> dict[str, Any]:
    from vllm import SamplingParams

    request: dict[str, Any] = {"prompt_token_ids": ids}
    if salt:
        request["cache_salt"] = salt
    params = SamplingParams(
        max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False
    )
    out = llm.generate([request], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    return {
        "tokens": list(comp.token_ids),
        "logprobs": [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)],
        "num_cached_tokens": out.num_cached_tokens,
    }


def run_gdn(model: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    import ucm_patch  # activates from the environment, as a user's import would
    from tests.support import STANDIN_CONNECTOR

    llm = _llm(model, KVTransferConfig(**STANDIN_CONNECTOR, kv_role="kv_both"))
    prompts = [{"prompt_token_ids": token_ids(s, 40 + 10 * s)} for s in (1, 2)]
    params = SamplingParams(max_tokens=3, temperature=0.0, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    return {"gdn_layers": gdn_layers(model), "report": ucm_patch.report()}


def _connector_config(store: str) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="UCMPatchConnector",
        kv_connector_module_path="ucm_patch.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"store": "local", "local_path": store},
    )


def _prompts(llm: Any) -> tuple[list[int], list[int], list[int]]:
    """(prefix, prompt 1, prompt 2): the prefix is two and a half of vLLM's blocks."""
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prefix = token_ids(1, 2 * block + block // 2)
    return prefix, [*prefix, 5, 6, 7], [*prefix, 8, 9, 10, 11]


def _hit_unit(llm: Any) -> int:
    """Tokens of one hit unit: whole chunks of vLLM's block size, as the connector's
    ``KVLayout`` derives them with its default ``chunk_tokens`` (the engine core may be
    another process here, so it is derived, not read)."""
    from ucm_patch.connector.layout import CHUNK_TOKENS, attention_chunk_blocks

    block = llm.llm_engine.vllm_config.cache_config.block_size
    return attention_chunk_blocks(block, CHUNK_TOKENS) * block


def _wait_for_dumps() -> None:
    from ucm_patch import connector

    connector.wait_for_dumps()  # this process's dumps (a worker process flushes at exit)


def run_e2e_dump(model: str, store: str) -> dict[str, Any]:
    llm = _llm(model, _connector_config(store))
    prefix, p1, p2 = _prompts(llm)
    first = _generate(llm, p1)
    _wait_for_dumps()
    reference = _generate(llm, p2, salt="recompute")
    _wait_for_dumps()
    return {
        "prefix_len": len(prefix),
        "prompt_len": len(p2),
        "first": first,
        "reference": reference,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    }


def run_e2e_load(model: str, store: str) -> dict[str, Any]:
    llm = _llm(model, _connector_config(store))
    _prefix, _p1, p2 = _prompts(llm)
    return {
        "hit": _generate(llm, p2),
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "unit": _hit_unit(llm),
    }


def run_plain(model: str) -> dict[str, Any]:
    """Prompt 1 without any connector: does this vLLM run the model at all?"""
    llm = _llm(model, None)
    _prefix, p1, _p2 = _prompts(llm)
    return {"first": _generate(llm, p1)}


def main(argv: list[str]) -> int:
    mode, *args, out = argv
    if mode == "gdn":
        result = run_gdn(*args)
    elif mode == "e2e-dump":
        result = run_e2e_dump(*args)
    elif mode == "e2e-load":
        result = run_e2e_load(*args)
    elif mode == "plain":
        result = run_plain(*args)
    else:
        raise SystemExit(f"unknown mode {mode!r} (gdn, e2e-dump, e2e-load, plain)")
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
