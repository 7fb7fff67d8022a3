"""The white-box oracle of the connector's Mamba/GDN state offers, run inside a matrix
venv by ``tests/test_older_release_e2e.py`` (``scripts/runtime_matrix.run_child`` with
``child=`` this file), the way ``scripts/matrix_child.py`` runs its checks: the repository
root on ``PYTHONPATH``, a fresh interpreter per trace, a ``__main__`` guard.

``state-oracle MODEL STORE TRACE OUT``: one of the traces of :func:`run_state_oracle`;
the state dumps the connector starts, on every release; and on a release with state
offers (vLLM >= 0.29), beside every step, vLLM's own boundary-state offers against those
the connector finds by position on 0.22 - 0.28.

A test, not a script: it replaces ``SchedulerSide``'s own steps (``_plan_dumps``,
``_state_dumps``) to watch and compare them, which no user-facing code may do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import matrix_child as mc  # the matrix's helpers: the same engine and prompts


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
        llm = mc._llm(model, mc._connector_config(store), max_num_batched_tokens=block)
        assert llm.llm_engine.vllm_config.cache_config.block_size == block
        mc._generate(llm, mc.token_ids(9, 3 * block + 5))
        mc._wait_for_dumps()
        return {**seen, "block_size": block}
    if trace.startswith("preempt:"):
        preempted = _preempted(model, store, int(trace.split(":", 1)[1]))
        return {**seen, **preempted}
    if trace != "steps":
        raise SystemExit(f"unknown trace {trace!r} (steps, chunked:BLOCK, preempt:BLOCKS)")
    llm = mc._llm(model, mc._connector_config(store))
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prefix, p1, p2 = mc._prompts(llm)
    mc._generate(llm, p1)
    mc._wait_for_dumps()
    pair = [{"prompt_token_ids": [*mc.token_ids(7, 2 * block), t]} for t in (1, 2)]
    llm.generate(pair, SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    crossing = {"prompt_token_ids": mc.token_ids(8, block - 2)}
    decode = SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)
    llm.generate([crossing], decode, use_tqdm=False)
    mc._wait_for_dumps()
    llm.reset_prefix_cache()  # prompt 2's prefix now comes from the store: an async hit
    hit = mc._generate(llm, p2)
    again = mc._generate(llm, mc._third(prefix))  # a local hit on the loaded prefix
    mc._wait_for_dumps()
    return {**seen, "block_size": block, "hit": hit, "again": again, "prefix_len": len(prefix)}


def _preempted(model: str, store: str, blocks: int) -> dict[str, Any]:
    """Two requests decoding at once in a KV cache of ``blocks`` blocks: when their
    decodes cross a block boundary the cache runs out, vLLM preempts one (its blocks
    freed, its tokens computed again when it is scheduled again) and finishes both.
    Counted: the preemptions (``Scheduler._preempt_request`` calls) and the tokens each
    request produced."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    llm = mc._llm(model, mc._connector_config(store), num_gpu_blocks_override=blocks)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    preemptions = [0]
    preempt = Scheduler._preempt_request

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        preemptions[0] += 1
        return preempt(self, *args, **kwargs)

    Scheduler._preempt_request = counted  # type: ignore[method-assign]
    prompts = [{"prompt_token_ids": mc.token_ids(20 + i, 2 * block - 4)} for i in range(2)]
    decode = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    outputs = llm.generate(prompts, decode, use_tqdm=False)
    mc._wait_for_dumps()
    return {
        "block_size": block,
        "blocks": blocks,
        "max_tokens": decode.max_tokens,
        "preemptions": preemptions[0],
        "tokens": [len(o.outputs[0].token_ids) for o in outputs],
    }


def main(argv: list[str]) -> int:
    mode, *args, out = argv
    if mode != "state-oracle":
        raise SystemExit(f"unknown mode {mode!r} (state-oracle)")
    from ucm_patch import connector

    result = run_state_oracle(*args)
    # blocks found by position whose hash was not the state's (counted, never dumped)
    result["state_offer_mismatches"] = connector.stats().get("state_offer_mismatches", 0)
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
