"""Run real vLLM (CPU) with UCMPatchConnector in a child process and report what happened.

Why a child: a vLLM engine cannot be torn down cleanly inside pytest, every run must start
from a fresh import state, and the Mooncake run must live inside a private network
namespace. The child runs in single-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
bf16 works there, while spawned CPU workers die of SIGILL in AMX code), so the scheduler
side, the worker side and the test steps share one process and the connector's counters.

``run_child(spec, tmp_path)`` writes ``spec`` as JSON, runs ``python -m
tests.support.connector_child SPEC OUT`` (optionally through
``scripts/mooncake_netns.sh``) and returns the parsed output. A spec is ``{"model": path,
"extra": kv_connector_extra_config | None (no connector), "multi": bool (MultiConnector
[ours, ExampleConnector]), "steps": [...]}`` with steps:

* ``{"op": "gen", "name": N, "prompt": [ids], "salt": str | None}``: generate, record
  tokens, logprobs, ``num_cached_tokens``, wall time and the connector counters after it;
* ``{"op": "seed", "name": N, "stored": [ids], "hit": n | "hit_of": name, "salt": s}``:
  fill vLLM's own prefix cache with exactly what a connector hit of ``n`` tokens of
  ``stored`` loads (``hit_of``: the ``num_cached_tokens`` of an earlier ``gen`` of this
  process), under ``salt``: the exact oracle of a hit (:func:`oracle_seed`). A ``gen`` of
  a prompt sharing that prefix, with the same salt, then hits ``n`` tokens in vLLM's cache;
* ``{"op": "flush"}``: wait for dumps, run one tiny request so finished requests are
  reported and pins dropped, then ``reset_prefix_cache()`` (must succeed: nothing leaked)
  so the next request cannot hit vLLM's own prefix cache, only the store;
* ``{"op": "corrupt", "count": n}``: flip a payload byte in ``n`` stored files (local
  store), so a later load fails its checksum;
* ``{"op": "mutate"}``: rewrite every value this process put into the local store with a
  changed payload (the sign bit of every 16-bit word flipped: finite numbers, different
  KV) inside a *valid* frame, so a later load passes its checksum and serves wrong KV (a
  test shows the model's output then differs from a recomputation);
* ``{"op": "break_gets"}``: from now on every ``LocalStore.get_many`` raises
  ``RuntimeError("store exploded")`` (not a ``StoreError``: a bug or a store that breaks
  its contract); ERROR lines of the ``ucm_patch`` loggers are reported in ``ucm_errors``.
* ``{"op": "sizes"}``: record internal map sizes (connector sides, scheduler, block pool).
* ``{"op": "store_keys"}``: per TP rank, how many of the keys this process's scheduler
  side planned to dump (every row of every dumped block, ``record_dump_keys``) the store
  holds (``exists_many``): with worker processes the workers' counters are out of reach,
  the store is not.
* ``{"op": "reset"}``: ``reset_prefix_cache()`` alone (no step in between);
  ``{"op": "release"}``: :func:`ucm_patch.connector.release_finished`, then the reset.
* ``{"op": "stress", "requests": [{"id", "prompt", "max_tokens", "abort_at"}],
  "inflight": n}``: drive the engine step by step (``LLMEngine.add_request`` / ``step``
  / ``abort_request``) with up to ``n`` requests outstanding; a request whose
  ``abort_at`` is not None is aborted once it has that many output tokens (0: right
  after the step that follows its arrival, possibly still waiting). Records every
  finished request's tokens, the aborted ids and how often vLLM preempted.

``"multi_ours": [extra, extra, ...]`` (instead of ``extra``/``multi``): a ``MultiConnector``
of several UCMPatchConnectors, one per extra config; each instance's async-save answers
(``request_finished``) and ``finished_sending`` reports are recorded under
``per_connector[<store kind>]`` and ``sizes`` lists every instance's maps, so a test can
check that each instance reports exactly its own requests.

Tensor parallel: ``"tp": n`` (vLLM's ``tensor_parallel_size``; the workers are separate
processes, the scheduler side stays in this one), ``"env": {...}`` (extra environment for
the child, e.g. ``VLLM_CPU_OMP_THREADS_BIND``), ``"record_dump_keys": true``.

Other spec keys: ``block_size`` (vLLM's ``--block-size``; hybrid models round it up to fit
the mamba page), ``mamba_copy`` (``"record"``: log mamba align copies and ``start_load_kv``
calls in order; ``"deferred"``: also run each copy after ``start_load_kv``, the order
vLLM-Ascend >= 0.21 uses), ``force_sync_loads`` (load hybrid states inside the forward step,
which the connector refuses in production, to show what the copy does to them).

Every ``gen`` also reports ``logit_abs_max`` (the largest |logit| vLLM's
``LogitsProcessor`` produced during it) and ``logit_unit_roundoff`` (half the logits'
dtype's ``eps``: 2^-8 for bf16), so a test can derive how far rounding alone moves a
logprob (:func:`rounding_bound`); in-process engines only (None with worker processes).

Every connected run reports ``layout`` (the connector's groups and hit unit), ``vllm``
(the block sizes vLLM chose at run time) and ``state_boundaries`` (group -> token boundaries
whose mamba state was dumped), so tests derive expected numbers instead of typing them in.
``python -m tests.support.connector_child --chain SPEC OUT [SPEC OUT ...]`` runs several
specs one after another, each in a fresh interpreter (the Mooncake runs share one
namespace that way).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support import REPO, repo_pythonpath

PYTHON = sys.executable
MAX_MODEL_LEN = 4096
NETNS = REPO / "scripts" / "mooncake_netns.sh"


def run_child(
    spec: dict[str, Any],
    tmp: Path,
    name: str,
    *,
    netns: bool = False,
    timeout: float = 600,
) -> dict[str, Any]:
    """Run one child vLLM process for ``spec``; raise with its stderr tail on failure."""
    spec_path = tmp / f"{name}.spec.json"
    out_path = tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_PATCH")}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # bf16 needs single-process mode on this CPU (AMX SIGILL in spawned workers)
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if spec.get("multiprocess") else "0",
            "VLLM_PLUGINS": "ucm_patch",
            "PYTHONPATH": repo_pythonpath(),
        }
    )
    env.update(spec.get("env", {}))
    cmd = [PYTHON, "-m", "tests.support.connector_child", str(spec_path), str(out_path)]
    if netns:
        cmd = ["bash", str(NETNS), "--", *cmd]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out_path.exists():
        raise AssertionError(
            f"child {name} failed (rc={proc.returncode}): {' '.join(cmd)}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    result = json.loads(out_path.read_text())
    result["stderr"] = proc.stderr
    return result


def run_children(
    specs: list[tuple[str, dict[str, Any]]],
    tmp: Path,
    *,
    netns: bool = False,
    timeout: float = 1200,
) -> dict[str, dict[str, Any]]:
    """Run ``(name, spec)`` pairs one after another, each in a fresh child interpreter.

    With ``netns`` they share one network namespace (one Mooncake master and storage node),
    so a later process reads what an earlier one stored."""
    if not netns:
        return {name: run_child(spec, tmp, name) for name, spec in specs}
    args: list[str] = []
    for name, spec in specs:
        (tmp / f"{name}.spec.json").write_text(json.dumps(spec))
        args += [str(tmp / f"{name}.spec.json"), str(tmp / f"{name}.out.json")]
    chain = {"chain": args}
    return {"chain": run_child(chain, tmp, "chain", netns=True, timeout=timeout)} | {
        name: json.loads((tmp / f"{name}.out.json").read_text()) for name, _spec in specs
    }


def prompt(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids in [4, 1000) (the tiny vocab is 1024)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(n)]


# ======================================================================================
# Child side
# ======================================================================================
def hit_unit(run: dict[str, Any]) -> int:
    """Tokens of one hit unit in ``run``: the connector's own layout when the child could
    read it, else derived from the block size vLLM chose, as ``KVLayout`` derives it
    (attention-only models, the default ``chunk_tokens``: worker processes)."""
    from ucm_patch.connector.config import CHUNK_TOKENS
    from ucm_patch.connector.layout import attention_chunk_blocks

    layout = run.get("layout")
    if layout:
        return int(layout["unit"])
    block = int(run["vllm"]["block_size"])
    return attention_chunk_blocks(block, CHUNK_TOKENS) * block


def whole_units(run: dict[str, Any], tokens: int) -> int:
    """``tokens`` rounded down to whole hit units of ``run`` (what can be stored and hit)."""
    unit = hit_unit(run)
    return tokens // unit * unit


def oracle_seed(stored: list[int], hit: int) -> list[int]:
    """The prompt that puts in vLLM's own prefix cache exactly what a connector hit of the
    first ``hit`` tokens of ``stored`` loads, so that a request then computes the same
    suffix on the same KV bits: the exact oracle of a hit (issue #36).

    Two things decide the bits: where the prefill is split (the hit; vLLM's own cache hits
    whole blocks, and ``hit`` is whole blocks) and how the cached KV was computed. The KV
    of the stored tokens depends on how many tokens the prefill step that computed them
    held (the CPU kernels block by it: ``stored[:hit]`` alone in a shorter prefill gets
    other bits, 2.6e-2 apart in a logprob of tests/test_e2e_hybrid_layouts.py's layerwise
    case). So the seed is ``stored[:hit]``, then as many other tokens as ``stored`` has
    (each changed: from token ``hit`` on, no block of the seed matches ``stored`` or a
    prompt sharing its prefix, so only the first ``hit`` tokens can hit)."""
    tail = [(t - 3) % 996 + 4 for t in stored[hit:]]  # t + 1, kept in [4, 1000)
    return [*stored[:hit], *tail]


def seed_step(
    name: str, stored: list[int], salt: str | None = None, **hit: int | str
) -> dict[str, Any]:
    """A ``seed`` step: ``hit=n`` tokens, or ``hit_of="gen name"`` (that gen's hit)."""
    return {"op": "seed", "name": name, "stored": stored, "salt": salt, **hit}


def oracle_steps(
    name: str, stored: list[int], ids: list[int], hit_of: str, **gen: Any
) -> list[dict[str, Any]]:
    """Steps that compute ``ids`` on the exact oracle of the hit of the ``gen`` named
    ``hit_of``: ``{name}_seed`` fills vLLM's own prefix cache, under the salt ``name``,
    with that hit's tokens of ``stored`` (the prompt whose prefill computed the stored
    KV), then ``name`` runs ``ids`` under the same salt (``gen``: other gen keys)."""
    run = {"op": "gen", "name": name, "prompt": ids, "salt": name, **gen}
    return [seed_step(f"{name}_seed", stored, salt=name, hit_of=hit_of), run]


def assert_same_as_oracle(hit: dict[str, Any], oracle: dict[str, Any]) -> None:
    """``hit`` (a connector hit) equals its exact oracle (:func:`oracle_steps`) bit for
    bit: vLLM's own cache hit the same tokens (the same split of the prefill) on KV
    computed as the stored KV was, so no tolerance is needed on any CPU."""
    cached = (hit["num_cached_tokens"], oracle["num_cached_tokens"])
    assert cached[0] > 0 and cached[0] == cached[1], cached
    assert hit["tokens"] == oracle["tokens"]
    assert hit["logprobs"] == oracle["logprobs"]


def rounding_bound(*gens: dict[str, Any]) -> float:
    """How far the rounding of the logits alone moves a logprob, for these ``gen`` results.

    A logprob is ``z_t - logsumexp(z)``; vLLM computes the logits ``z`` in the model dtype
    and the log-softmax in float32. A perturbation ``dz`` of the logits moves it by
    ``dz_t - sum_j p_j dz_j``: at most ``2 max_j |dz_j|``. Each logit is rounded to its
    dtype with a relative error of at most the unit roundoff ``u`` (2^-8 for bf16: 8
    significant bits), so two computations of the same logits that differ by their
    rounding differ by at most ``2 u max|z|`` per logit, and their logprobs by
    ``4 u max|z|``, with ``max|z|`` the largest |logit| either run produced."""
    u = max(float(g["logit_unit_roundoff"]) for g in gens)
    return 4 * u * max(float(g["logit_abs_max"]) for g in gens)


def _env_values(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with ``"$NAME"`` values read from the environment."""
    return {
        k: os.environ[v[1:]] if isinstance(v, str) and v.startswith("$") else v
        for k, v in extra.items()
    }


def _llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if spec.get("hybrid"):
        kwargs["disable_hybrid_kv_cache_manager"] = False
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("tp"):
        kwargs["tensor_parallel_size"] = spec["tp"]
        kwargs["distributed_executor_backend"] = "mp"
    extra = spec.get("extra")
    if spec.get("multi_ours"):
        children = [
            {
                "kv_connector": "UCMPatchConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": _env_values(child),
            }
            for child in spec["multi_ours"]
        ]
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": children},
            kv_load_failure_policy="recompute",
        )
    elif extra is not None:
        # "$NAME" values come from the environment (the Mooncake master's address is only
        # known inside the network namespace).
        extra = {
            k: os.environ[v[1:]] if isinstance(v, str) and v.startswith("$") else v
            for k, v in extra.items()
        }
        ours = {
            "kv_connector": "UCMPatchConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        if spec.get("module_path"):
            ours["kv_connector_module_path"] = "ucm_patch.connector"
        if spec.get("multi"):
            example = {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": spec["example_dir"]},
            }
            ktc = KVTransferConfig(
                kv_connector="MultiConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"connectors": [ours, example]},
                kv_load_failure_policy="recompute",
            )
        else:
            ktc = KVTransferConfig(**ours, kv_load_failure_policy="recompute")
        kwargs["kv_transfer_config"] = ktc
    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=spec.get("max_model_len", MAX_MODEL_LEN),
        max_num_batched_tokens=spec.get("max_model_len", MAX_MODEL_LEN),
        max_num_seqs=spec.get("max_num_seqs", 4),
        num_gpu_blocks_override=spec.get("num_blocks"),
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=spec.get("prefix_caching", True),
        **kwargs,
    )


def _stats(connected: bool) -> dict[str, int]:
    if not connected or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
        return {}
    from ucm_patch import connector

    out = connector.stats()
    found = connector.active_connectors()
    if found:  # the store's own counters, prefixed (e.g. Mooncake's zero-copy puts)
        out |= {f"store_{k}": v for k, v in found[0].store.stats.items()}
    return out


class _Logits:
    """The largest |logit| since the last :meth:`take`, and the logits' unit roundoff.

    Test-side instrumentation: vLLM's ``LogitsProcessor.forward`` wrapped in this process
    (the engine's worker runs here in single-process mode; not with worker processes)."""

    abs_max: float | None = None
    unit_roundoff: float | None = None

    @classmethod
    def install(cls) -> None:
        import torch
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        forward = LogitsProcessor.forward

        def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
            logits = forward(self, *args, **kwargs)
            if logits is not None and logits.numel():
                seen = float(logits.detach().abs().max())
                cls.abs_max = seen if cls.abs_max is None else max(cls.abs_max, seen)
                cls.unit_roundoff = torch.finfo(logits.dtype).eps / 2
            return logits

        LogitsProcessor.forward = recording  # type: ignore[method-assign]

    @classmethod
    def take(cls) -> dict[str, float | None]:
        out = {"logit_abs_max": cls.abs_max, "logit_unit_roundoff": cls.unit_roundoff}
        cls.abs_max = None
        return out


def _gen(llm: Any, step: dict[str, Any], connected: bool) -> dict[str, Any]:
    from vllm import SamplingParams

    request: dict[str, Any] = {"prompt_token_ids": step["prompt"]}
    if step.get("salt"):
        request["cache_salt"] = step["salt"]
    params = SamplingParams(
        max_tokens=step.get("max_tokens", 4), temperature=0.0, logprobs=1, ignore_eos=True
    )
    _Logits.take()
    t0 = time.perf_counter()
    out = llm.generate([request], params, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    logits = _Logits.take()
    comp = out.outputs[0]
    logprobs = [comp.logprobs[i][tok].logprob for i, tok in enumerate(comp.token_ids)]
    if connected:
        from ucm_patch import connector

        connector.wait_for_dumps()
    return {
        "tokens": list(comp.token_ids),
        "logprobs": logprobs,
        "num_cached_tokens": out.num_cached_tokens,
        "wall_s": wall,
        "stats": _stats(connected),
        **logits,
    }


def _flush(llm: Any, connected: bool) -> dict[str, Any]:
    from vllm import SamplingParams

    if connected:
        from ucm_patch import connector

        connector.wait_for_dumps()  # in-process only (no-op with worker processes)
    # Tiny requests make the engine step: finished dumps (delayed frees) and done steps
    # (pins) are reported, then the scheduler drops them. With worker processes the
    # dumps may still run, so retry the reset for a while.
    deadline = time.monotonic() + 60
    attempts = 0
    while True:
        attempts += 1
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False
        )
        if attempts >= 2 and llm.reset_prefix_cache():
            return {"reset": True, "attempts": attempts}
        if time.monotonic() > deadline:
            return {"reset": False, "attempts": attempts}
        time.sleep(0.05 if attempts >= 2 else 0)


_UCM_ERRORS: list[str] = []


class _ErrorLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _UCM_ERRORS.append(record.getMessage())


def _break_gets() -> dict[str, Any]:
    from ucm_patch.hooks.stores.local import LocalStore

    def exploding(self: Any, *args: Any) -> Any:
        raise RuntimeError("store exploded")

    LocalStore.get_many = exploding  # type: ignore[method-assign]
    LocalStore.get_many_into = exploding  # type: ignore[method-assign]  (loads: a device)
    LocalStore.get_many_scattered = exploding  # type: ignore[method-assign]  (a host cache)
    # The connector logs under vLLM's logger ("vllm.ucm_patch..."), the rest under ucm_patch.
    for name in ("ucm_patch", "vllm.ucm_patch"):
        logging.getLogger(name).addHandler(_ErrorLines(logging.ERROR))
    return {"broken": True}


def _local_store(spec: dict[str, Any]) -> Any:
    """The run's local store, opened as the connector opens it (both tiers)."""
    from ucm_patch.hooks.stores import make_store, split_store_config

    return make_store(split_store_config(spec["extra"])[0])


def _corrupt(spec: dict[str, Any], count: int) -> dict[str, Any]:
    store = _local_store(spec)
    done = []
    for at in store.placements()[:count]:
        with open(at.file, "r+b") as f:  # last payload byte: the checksum no longer matches
            f.seek(at.offset + at.size - 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        done.append(f"{at.file}@{at.offset}")
    store.close()
    return {"corrupted": done}


_PUT_KEYS: list[str] = []


def _record_put_keys() -> None:
    """Remember every key put into a local store in this process (for ``mutate``)."""
    from ucm_patch.hooks.stores.local import LocalStore

    put_many = LocalStore.put_many

    def recording(self: Any, items: Any) -> Any:
        items = list(items)
        _PUT_KEYS.extend(key for key, _value in items)
        return put_many(self, items)

    LocalStore.put_many = recording  # type: ignore[method-assign]


def _mutate(spec: dict[str, Any]) -> dict[str, Any]:
    """Rewrite each recorded value in place with a changed payload and a valid frame."""
    from ucm_patch.hooks.stores.framing import HEADER_SIZE, key_bytes, make_header

    store = _local_store(spec)
    mutated = 0
    for key in dict.fromkeys(_PUT_KEYS):
        at = store.where(key)
        if at is None:
            continue
        with open(at.file, "r+b") as f:
            f.seek(at.offset)
            payload = bytearray(f.read(at.size))
            payload[1::2] = bytes(b ^ 0x80 for b in payload[1::2])
            f.seek(at.offset - HEADER_SIZE)
            f.write(make_header(key_bytes(key), memoryview(payload)) + bytes(payload))
        mutated += 1
    store.close()
    return {"keys": len(set(_PUT_KEYS)), "mutated": mutated}


def _stress(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    preempted: list[str] = []
    original_preempt = sched._preempt_request

    def counting_preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return original_preempt(request, *args, **kwargs)

    sched._preempt_request = counting_preempt  # instance attribute: the scheduler's own calls
    todo = list(reversed(step["requests"]))
    by_id = {r["id"]: r for r in step["requests"]}
    outstanding: dict[str, int] = {}  # id -> output tokens seen so far
    finished: dict[str, list[int]] = {}
    aborted: list[str] = []
    steps = 0
    t0 = time.perf_counter()
    while todo or outstanding:
        while todo and len(outstanding) < step["inflight"]:
            r = todo.pop()
            params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, params)
            outstanding[r["id"]] = 0
        for out in engine.step():
            rid = out.request_id
            if rid not in outstanding:
                continue
            outstanding[rid] = len(out.outputs[0].token_ids)
            if out.finished:
                finished[rid] = list(out.outputs[0].token_ids)
                del outstanding[rid]
        steps += 1
        to_abort = [
            rid
            for rid, n in outstanding.items()
            if by_id[rid]["abort_at"] is not None and n >= by_id[rid]["abort_at"]
        ]
        if to_abort:
            engine.abort_request(to_abort)
            aborted.extend(to_abort)
            for rid in to_abort:
                del outstanding[rid]
    return {
        "finished": finished,
        "aborted": aborted,
        "preempted": preempted,
        "steps": steps,
        "wall_s": time.perf_counter() - t0,
    }


def _reset(llm: Any, release: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if release:
        from ucm_patch import connector

        out["released"] = connector.release_finished(llm)
    out["reset"] = llm.reset_prefix_cache()
    return out


class _Observer:
    """What a connected child reports besides outputs: stored state boundaries, copy order.

    Test-side instrumentation: it wraps vLLM's and the connector's public methods in this
    process only."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.state_boundaries: dict[int, set[int]] = {}
        self.order: list[list[Any]] = []
        self.step = 0
        self.dump_keys: dict[int, set[str]] | None = {} if spec.get("record_dump_keys") else None
        if spec.get("extra") is None:
            return
        from ucm_patch import connector
        from ucm_patch.connector import scheduler_side as connector_scheduler

        if spec.get("force_sync_loads"):
            connector_scheduler.choose_load_async = lambda _layout, _mode: False
        cls = connector.UCMPatchConnector
        build, start = cls.build_connector_meta, cls.start_load_kv
        observer = self

        def build_connector_meta(self: Any, so: Any) -> Any:
            md = build(self, so)
            observer.step += 1
            observer.record_states(self, so, md)
            observer.record_keys(self, md)
            return md

        cls.build_connector_meta = build_connector_meta  # type: ignore[method-assign]
        mode = spec.get("mamba_copy")
        if not mode:
            return
        from contextlib import contextmanager

        from vllm.v1.worker import mamba_utils
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        mixin = KVConnectorModelRunnerMixin
        copy, connector_context = mamba_utils.do_mamba_copy_block, mixin._get_kv_connector_output
        pending: list[Any] = []

        def do_mamba_copy_block(bufs: Any) -> None:
            if bufs.offset:
                observer.order.append(["copy", observer.step])
            if mode == "deferred":
                pending.append(bufs)
            else:
                copy(bufs)

        def start_load_kv(self: Any, forward_context: Any, **kwargs: Any) -> None:
            observer.order.append(["start_load_kv", observer.step])
            start(self, forward_context, **kwargs)

        @contextmanager
        def kv_connector_output(*args: Any, **kwargs: Any) -> Any:
            # vLLM's connector context: a step's sync loads start on entry, then the
            # forward runs in its body. vLLM-Ascend >= 0.21 runs the mamba copy first
            # thing in that body ("deferred").
            with connector_context(*args, **kwargs) as output:
                while pending:
                    copy(pending.pop())
                observer.order.append(["forward", observer.step])
                yield output

        mamba_utils.do_mamba_copy_block = do_mamba_copy_block
        cls.start_load_kv = start_load_kv  # type: ignore[method-assign]
        mixin._get_kv_connector_output = staticmethod(kv_connector_output)

    def record_keys(self, conn: Any, md: Any) -> None:
        """rank -> every store key this step's dumps write (all rows, every TP rank)."""
        if self.dump_keys is None:
            return
        layout = conn.layout
        for entries in md.dumps.values():
            for gid, _bid, block_hash in entries:
                for rank in range(layout.tp_size):
                    keys = self.dump_keys.setdefault(rank, set())
                    keys.update(layout.keys_for_rank(block_hash, gid, rank))

    def store_keys(self, llm: Any) -> dict[str, Any]:
        """Per rank: planned dump keys and how many the store holds."""
        conn = _our_scheduler_connectors(llm)[0]
        out: dict[str, Any] = {}
        for rank, keys in sorted((self.dump_keys or {}).items()):
            present = conn.store.exists_many(sorted(keys))
            out[str(rank)] = {"expected": len(keys), "present": sum(present)}
        return out

    def record_states(self, conn: Any, so: Any, md: Any) -> None:
        """group -> boundary (tokens) of every mamba state this step's metadata dumps."""
        layout = conn.layout
        mamba = {g.index for g in layout.mamba_groups}
        if not mamba:
            return
        for rid, entries in md.dumps.items():
            hashes = [h.hex() for h in _scheduler_request(rid).block_hashes]
            for gid, _bid, block_hash in entries:
                if gid in mamba:
                    boundary = (hashes.index(block_hash) + 1) * layout.hash_block_size
                    self.state_boundaries.setdefault(gid, set()).add(boundary)

    def report(self) -> dict[str, Any]:
        return {
            "state_boundaries": {str(g): sorted(b) for g, b in self.state_boundaries.items()},
            "order": self.order,
        }


class _PerInstance:
    """Each UCMPatchConnector instance's async-save answers and ``finished_sending`` ids.

    Test-side instrumentation (this process only): ``request_finished`` /
    ``request_finished_all_groups`` (scheduler side) and ``get_transfer_results`` (worker
    side) are wrapped on the class and recorded under the instance's store kind."""

    def __init__(self) -> None:
        self.saves: dict[str, list[str]] = {}
        self.sending: dict[str, list[str]] = {}
        from ucm_patch import connector

        cls = connector.UCMPatchConnector
        record = self
        finished, finished_all = cls.request_finished, cls.request_finished_all_groups
        results = cls.get_transfer_results

        def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
            out = finished(self, request, block_ids)
            record.saved(self, request, out)
            return out

        def request_finished_all_groups(self: Any, request: Any, block_ids: Any) -> Any:
            out = finished_all(self, request, block_ids)
            record.saved(self, request, out)
            return out

        def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
            out = results(self, finished_req_ids)
            label = self.config.store_kind
            record.sending.setdefault(label, []).extend(sorted(out.finished_sending))
            return out

        cls.request_finished = request_finished  # type: ignore[method-assign]
        cls.request_finished_all_groups = request_finished_all_groups  # type: ignore[method-assign]
        cls.get_transfer_results = get_transfer_results  # type: ignore[method-assign]

    def saved(self, conn: Any, request: Any, out: tuple[bool, Any]) -> None:
        ids = self.saves.setdefault(conn.config.store_kind, [])
        if out[0]:
            ids.append(request.request_id)

    def report(self) -> dict[str, Any]:
        labels = sorted(set(self.saves) | set(self.sending))
        return {
            label: {
                "async_saves": self.saves.get(label, []),
                "sending": self.sending.get(label, []),
            }
            for label in labels
        }


_LLM: Any = None


def _scheduler_request(rid: str) -> Any:
    return _LLM.llm_engine.engine_core.engine_core.scheduler.requests[rid]


def _our_scheduler_connectors(llm: Any) -> list[Any]:
    """This process's scheduler-side UCMPatchConnector(s), also inside a MultiConnector."""
    conns = [llm.llm_engine.engine_core.engine_core.scheduler.connector]
    ours = []
    while conns:
        c = conns.pop()
        if type(c).__name__ == "UCMPatchConnector":
            ours.append(c)
        conns.extend(getattr(c, "_connectors", ()))
    return ours


def _layout_report(llm: Any) -> dict[str, Any]:
    """The connector's layout and the block sizes vLLM chose for this run."""
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    out: dict[str, Any] = {
        "vllm": {
            "block_size": cache.block_size,
            "mamba_block_size": cache.mamba_block_size,
            "mamba_cache_mode": cache.mamba_cache_mode,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        }
    }
    from ucm_patch import connector

    found = connector.active_connectors()
    if not found and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1":
        found = _our_scheduler_connectors(llm)  # worker processes (tp > 1): same layout
    if found:
        layout = found[0].layout
        out["layout"] = {
            "unit": layout.unit,
            "fingerprint": layout.fingerprint,
            "hash_block_size": layout.hash_block_size,
            "groups": [
                {
                    "index": g.index,
                    "kind": g.kind,
                    "block_size": g.block_size,
                    "layers": list(g.layers),
                    "rows": len(layout.rows_of_group[g.index]),
                }
                for g in layout.groups
            ],
        }
    return out


def _sizes(llm: Any, connected: bool) -> dict[str, Any]:
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    out: dict[str, Any] = {
        "scheduler_requests": len(sched.requests),
        "free_blocks": pool.get_num_free_blocks(),
        "total_blocks": pool.num_gpu_blocks,
    }
    if connected:
        from ucm_patch.hooks.dump import get_scheduler

        conns = [sched.connector]
        ours = []
        while conns:
            c = conns.pop()
            if type(c).__name__ == "UCMPatchConnector":
                ours.append(c)
            conns.extend(getattr(c, "_connectors", ()))
        from ucm_patch import connector

        out["connector_scheduler"] = ours[0]._sched_side.internal_sizes()
        workers = connector.active_connectors()  # this process's worker side(s)
        out["connector_worker"] = workers[0]._worker_side.internal_sizes() if workers else {}
        # Every instance (several under "multi_ours"), and MultiConnector's own count of
        # outstanding extra async saves on both sides.
        out["connector_schedulers"] = [c._sched_side.internal_sizes() for c in ours]
        out["connector_workers"] = [c._worker_side.internal_sizes() for c in workers]
        from vllm.distributed.kv_transfer import kv_transfer_state

        agent = getattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
        out["multi_extra_async_saves"] = [
            len(getattr(c, "_extra_async_saves", {})) for c in (sched.connector, agent)
        ]
        # (no worker side in this process, e.g. tp > 1: the dump scheduler lives there)
        out["dump_scheduler"] = get_scheduler().internal_sizes() if workers else {}
    return out


def _layer_calls() -> dict[str, Any]:
    from ucm_patch import connector

    found = connector.active_connectors()
    if not found:
        return {}
    worker = found[0]._worker_side
    groups = {layer: g.kind for g in found[0].layout.groups for layer in g.layers}
    return {
        "wait": dict(worker.wait_calls),
        "save": dict(worker.save_calls),
        "kinds": groups,
    }


def _chain(args: list[str]) -> dict[str, Any]:
    """Run each (spec, out) pair in a fresh interpreter, in order; stop at the first failure."""
    runs = []
    for spec_path, out_path in zip(args[::2], args[1::2], strict=True):
        cmd = [PYTHON, "-m", "tests.support.connector_child", spec_path, out_path]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        runs.append({"spec": spec_path, "rc": proc.returncode})
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-8000:])
            raise SystemExit(f"chained child {spec_path} failed (rc={proc.returncode})")
    return {"runs": runs}


def main(argv: list[str]) -> int:
    global _LLM
    spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    if "chain" in spec:
        Path(out_path).write_text(json.dumps(_chain(spec["chain"])))
        return 0
    connected = spec.get("extra") is not None or bool(spec.get("multi_ours"))
    per_instance = _PerInstance() if spec.get("multi_ours") else None
    if any(step["op"] == "mutate" for step in spec["steps"]):
        _record_put_keys()
    observer = _Observer(spec)
    llm = _LLM = _llm(spec)
    _Logits.install()  # after vLLM and the plugin loaded: nothing imported before them
    results: dict[str, Any] = {}
    for i, step in enumerate(spec["steps"]):
        op = step["op"]
        name = step.get("name", f"{op}{i}")
        if op == "gen":
            results[name] = _gen(llm, step, connected)
        elif op == "seed":
            hit = step["hit"] if "hit" in step else results[step["hit_of"]]["num_cached_tokens"]
            ids = oracle_seed(step["stored"], hit)
            seed = {"prompt": ids, "salt": step.get("salt"), "max_tokens": 1}
            results[name] = _gen(llm, seed, connected) | {"hit": hit}
        elif op == "flush":
            results[name] = _flush(llm, connected)
        elif op == "corrupt":
            results[name] = _corrupt(spec, step["count"])
        elif op == "break_gets":
            results[name] = _break_gets()
        elif op == "store_keys":
            results[name] = observer.store_keys(llm)
        elif op == "mutate":
            results[name] = _mutate(spec)
        elif op == "stress":
            results[name] = _stress(llm, step)
        elif op == "sizes":
            results[name] = _sizes(llm, connected)
        elif op in ("reset", "release"):
            results[name] = _reset(llm, op == "release")
        else:
            raise ValueError(f"unknown step op {op!r}")
    if connected and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1":
        results["layer_calls"] = _layer_calls()
        results["final_stats"] = _stats(True)
        results.update(observer.report())
        if per_instance is not None:
            results["per_connector"] = per_instance.report()
    results.update(_layout_report(llm))
    results["ucm_errors"] = _UCM_ERRORS
    Path(out_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
