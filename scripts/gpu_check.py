"""``make gpu-check``: ucm_patch and UCMPatchConnector on a machine with CUDA vLLM.

What the CPU suite cannot see (CUDA graphs, torch.compile, FlashAttention's layout, the GPU
model runner), checked on two models with random weights (``load_format="dummy"``, configs
written here, no hub, no tokenizer: prompts are token ids):

* ``dense``: Qwen3-8B's shape (36 layers, 8 KV heads of 128);
* ``hybrid``: a Qwen3-Next laid out like the checkpoint (``[GDN x 3, attention] x 2``,
  MoE), smaller so it starts quickly.

Per model, each run a fresh interpreter (vLLM's default compilation: torch.compile and
CUDA graphs, no ``enforce_eager``):

1. **hooks**: the tests' counting connector, with ucm_patch and with ``UCM_PATCH=0``:
   per-layer waits / saves on GDN and attention layers per forward step;
2. **cross-process hit**: process A stores prompt P (80 % shared prefix + a tail) through
   UCMPatchConnector on a local store, then times the same-prefix prompt Q recomputed
   (another ``cache_salt``) and served by vLLM's own prefix cache (the ceiling);
   process B (same ``PYTHONHASHSEED``) runs Q: hit tokens, tokens and logprobs equal to
   A's recomputation, and its time to first token;
3. **OffloadingConnector**: vLLM's own CPU offload in one process (P, reset of the GPU
   prefix cache, Q): the peer's time to first token (not run for a model whose
   connector refused at start: there is no hit to compare);
4. **dump bandwidth** against the rate at which prefill produces KV: the bytes the
   connector stored for P over the wall seconds during which any dump worker was copying
   or storing them (``dump_busy_s``: waits for KV-ready events and idle time left out,
   workers at work together counted once), against the same bytes over P's prefill time;
   the tail: how long after P's first token its last dump landed; and the dump and load
   threads the connector chose (``copy_threads``).

The runs of one model that depend on each other (dump, then load) form a chain; the
chains run side by side (``--jobs``), each process with a fixed KV cache
(``kv_cache_memory_bytes``: no memory profiling that another process could disturb) and
its own compile cache. Every GPU step (generate, and P's dumps) holds one lock, so timed
sections never overlap another process's GPU work. A lent GPU is lent for minutes:
``--deadline-s`` starts no run past it, and ``--json`` is rewritten after every run.

Prints one table (and writes it as JSON with ``--json``). Exit status 1 when a check that
has a right answer (hook counts, hit length, equal tokens) fails.

    python scripts/gpu_check.py [--workdir DIR] [--json OUT] [--logs DIR]
        [--models dense,hybrid] [--jobs N] [--deadline-s S]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPT_LEN = 8192
SHARED = 0.8
SEED = 0
REFUSAL = "hybrid prefix hits need vLLM"
# A fixed KV cache per process: vLLM then skips its memory profiling (which fails when
# another process on the GPU frees memory meanwhile), and several processes fit at once.
KV_CACHE_BYTES = {"dense": 6 << 30, "hybrid": 4 << 30}
# With kv_cache_memory_bytes set, vLLM reads this only to check free memory at start.
GPU_MEMORY_UTILIZATION = 0.1
LOCK_ENV = "UCM_GPU_CHECK_LOCK"
# our connector's hit unit, given to the runs without it (the same hit length for all)
UNIT_ENV = "UCM_GPU_CHECK_UNIT"
# ``--threads``: the dump and load threads of a column's connector (else its default)
THREADS_ENV = "UCM_GPU_CHECK_THREADS"
KILLED = "[gpu-check] killed at the deadline"
# Host memory for KV, the same for our store's memory tier and vLLM's OffloadingConnector.
HOST_KV_BYTES = 16 << 30
# ``--tiny`` (a dry run on a CPU host): what its RAM holds beside a CPU vLLM
TINY_HOST_KV_BYTES = 1 << 30
HOST_KV_ENV = "UCM_GPU_CHECK_HOST_KV"
# Hits timed after the first one in the load process (median and spread reported).
STEADY_SAMPLES = 5

# Qwen3-8B's shape (config.json of Qwen/Qwen3-8B), weights random.
DENSE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# Qwen3-Next's per-layer shape (GDN heads and dims as in Qwen3-Next-80B-A3B), 8 layers
# laid out as the checkpoint ([linear x 3, full] repeated), fewer and smaller experts.
HYBRID = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3
    + ["full_attention"]
    + ["linear_attention"] * 3
    + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MODELS = {"dense": DENSE, "hybrid": HYBRID}
# ``--tiny``: the same layer layouts, narrow, for a dry run of the check on CPU vLLM.
TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_experts": 4,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}


def write_model(workdir: Path, name: str, tiny: bool = False) -> Path:
    """A model directory vLLM loads with ``load_format="dummy"`` (a config is enough)."""
    config = dict(MODELS[name])
    if tiny:
        config.update({k: v for k, v in TINY.items() if k in config})
    path = workdir / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def layer_kinds(config: dict[str, Any]) -> dict[str, list[str]]:
    """vLLM's layer names per kind, from a config."""
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    gdn = [f"model.layers.{i}.linear_attn" for i, t in enumerate(types) if t == "linear_attention"]
    attn = [
        f"model.layers.{i}.self_attn.attn" for i, t in enumerate(types) if t != "linear_attention"
    ]
    return {"gdn": gdn, "attention": attn}


def prompts(block: int, seed: int = 1) -> tuple[list[int], list[int], list[int], int]:
    """(P, Q, R, shared): ``PROMPT_LEN`` tokens each, sharing their first 80 % in whole
    ``block``-token units (``shared`` tokens; the connector's hit unit), tails apart.
    P is stored; Q measures vLLM's own prefix cache in P's process (and is stored too);
    R is the prompt the other process loads: its hit is the shared prefix, nothing of Q's."""
    import random

    rng = random.Random(seed)
    shared = int(PROMPT_LEN * SHARED) // block * block
    prefix = [rng.randrange(4, 100000) for _ in range(shared)]
    tail = PROMPT_LEN - shared
    p, q, r = (prefix + [rng.randrange(4, 100000) for _ in range(tail)] for _ in range(3))
    return p, q, r, shared


# ======================================================================================
# child (one vLLM process)
# ======================================================================================
@contextlib.contextmanager
def gpu_turn() -> Iterator[None]:
    """This process's turn on the GPU: one at a time across the check's processes (the
    lock file the parent names), so no timed section overlaps another's GPU work."""
    path = os.environ.get(LOCK_ENV)
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _llm(model: str, ktc: Any, hybrid: bool) -> Any:
    from vllm import LLM

    extra: dict[str, Any] = {}
    if hybrid:  # FlashInfer's GDN prefill is Hopper's default; the Triton one always runs
        extra["additional_config"] = {"gdn_prefill_backend": "triton"}
    return LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=PROMPT_LEN + 64,
        max_num_seqs=4,
        seed=SEED,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        kv_cache_memory_bytes=KV_CACHE_BYTES["hybrid" if hybrid else "dense"],
        enable_prefix_caching=True,
        kv_transfer_config=ktc,
        **extra,
    )


def _host_kv_bytes() -> int:
    return int(os.environ.get(HOST_KV_ENV) or HOST_KV_BYTES)


def _ktc(kind: str, store: str) -> Any:
    from vllm.config import KVTransferConfig

    if kind == "ucm":
        extra: dict[str, Any] = {
            "store": "local",
            "local_path": store,
            # the host memory vLLM's OffloadingConnector gets below: the same for both
            "local_memory_bytes": _host_kv_bytes(),
            # The load process stands for a restarted server that reads the tier warm: by
            # default the last process's close spills the tier to disk and removes it, and
            # the hit then reads the disk tier (docs/GPU.md, run 5).
            "local_memory_keep_bytes": _host_kv_bytes(),
        }
        threads = os.environ.get(THREADS_ENV)
        if threads:
            extra["dump_workers"] = extra["load_workers"] = int(threads)
        return KVTransferConfig(
            kv_connector="UCMPatchConnector",
            kv_connector_module_path="ucm_patch.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    if kind == "standin":
        from tests.support import STANDIN_CONNECTOR

        return KVTransferConfig(**STANDIN_CONNECTOR, kv_role="kv_both")
    if kind == "offloading":
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": _host_kv_bytes()},
        )
    raise ValueError(f"unknown connector kind {kind!r}")


def _generate(
    llm: Any, ids: list[int], salt: str | None = None, tokens: int = 4, turn: bool = True
) -> dict[str, Any]:
    """One request; ``turn``: take the GPU lock for it (False: the caller holds it)."""
    from vllm import SamplingParams

    request: dict[str, Any] = {"prompt_token_ids": ids}
    if salt:
        request["cache_salt"] = salt
    params = SamplingParams(
        max_tokens=tokens, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False
    )
    with gpu_turn() if turn else contextlib.nullcontext():
        t0 = time.perf_counter()
        out = llm.generate([request], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
    comp = out.outputs[0]
    return {
        "seconds": seconds,
        "tokens": list(comp.token_ids),
        "logprobs": [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)],
        "num_cached_tokens": int(out.num_cached_tokens or 0),
    }


def _ttft(llm: Any, ids: list[int], salt: str | None = None) -> dict[str, Any]:
    return _generate(llm, ids, salt, tokens=1)


def child(mode: str, model: str, store: str, hybrid: bool) -> dict[str, Any]:
    import ucm_patch  # activates (UCM_PATCH=0 switches it off), as a user's import would

    kind = {"hooks": "standin", "offload": "offloading", "plain": "none"}.get(mode, "ucm")
    llm = _llm(model, None if kind == "none" else _ktc(kind, store), hybrid)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    # a hit is whole chunks of our connector (KVLayout.unit): read it there, and handed
    # to the runs without it, so that every connector's hit is the same length
    unit = int(os.environ.get(UNIT_ENV) or block)
    if kind == "ucm":
        from ucm_patch import connector

        found = connector.active_connectors()
        unit = found[0].layout.unit if found else block
    p, q, r, shared = prompts(unit)
    _ttft(llm, prompts(unit, seed=99)[0], salt="warm-up")  # compile, capture, allocate
    out: dict[str, Any] = {"block_size": block, "unit": unit, "shared": shared}
    if mode == "hooks":
        _generate(llm, p)
        out["applied"] = [r["id"] for r in ucm_patch.report() if r["state"] == "applied"]
    elif mode == "dump":
        connector.wait_for_dumps(600)  # the warm-up's dumps are not P's
        before = connector.stats()
        with gpu_turn():  # P's prefill and its dumps: nothing else on the GPU meanwhile
            t0 = time.perf_counter()
            out["cold"] = _generate(llm, p, tokens=1, turn=False)
            if not connector.wait_for_dumps(600):
                raise RuntimeError("gpu_check: the dumps of P did not finish in 600 s")
            out["dump_seconds"] = time.perf_counter() - t0
        after = connector.stats()
        out["dump_bytes"] = after["bytes_written"] - before["bytes_written"]
        out["dump_work_s"] = after["dump_work_s"] - before["dump_work_s"]
        out["dump_copy_s"] = after["dump_copy_s"] - before["dump_copy_s"]
        out["dump_busy_s"] = after["dump_busy_s"] - before["dump_busy_s"]
        cfg = connector.active_connectors()[0].config
        out["threads"] = {"dump": cfg.dump_workers, "load": cfg.load_workers}
        out["own_cache"] = _ttft(llm, q)  # Q's prefix from vLLM's own prefix cache
        out["recompute"] = _generate(llm, r, salt="recompute")  # R: nothing can hit
        out["recompute_ttft"] = _ttft(llm, r, salt="recompute-2")
        connector.wait_for_dumps(600)
    elif mode == "load":
        conn = connector.active_connectors()[0]
        _quiet_store(connector, conn.store)  # the tier warmer done, nothing in flight
        before = connector.stats()
        out["hit_ttft"] = _ttft(llm, r)  # first request: the prefix comes from the store
        after = connector.stats()
        out["load_s"] = {  # where the hit's time went (connector counters)
            k.split("_")[-2]: after[k] - before[k]
            for k in ("lookup_s", "load_read_s", "load_copy_s", "load_stall_s")
        }
        out["load_layerwise"] = after["loads_layerwise"] - before["loads_layerwise"]
        out["hit_pages"] = after["loaded_pages"] - before["loaded_pages"]
        out["hit_bytes"] = out["hit_pages"] * max(conn.layout.row_page_bytes)  # dense: all equal
        out["hit"] = _generate(llm, r)  # the loaded blocks, now in vLLM's own cache
        # each measured apart: one that fails is reported, the hit above still stands
        try:
            out["steady"] = _steady_hits(llm, connector, conn.store, r[:shared], STEADY_SAMPLES)
        except Exception as exc:
            out["steady_error"] = repr(exc)
        try:
            out["h2d"] = _h2d_reference(out["hit_bytes"])
        except Exception as exc:
            out["h2d_error"] = repr(exc)
    elif mode == "plain":  # no connector: vLLM as users run it without one
        recompute, own = [], []
        _ttft(llm, p)  # P's prefix into vLLM's own prefix cache
        import random

        rng = random.Random(5)
        for i in range(STEADY_SAMPLES):
            recompute.append(_ttft(llm, r, salt=f"plain-{i}")["seconds"])
            tail = [rng.randrange(4, 100000) for _ in range(PROMPT_LEN - shared)]
            own.append(_ttft(llm, q[:shared] + tail)["seconds"])  # only the prefix hits
        out["recompute_s"], out["own_cache_s"] = sorted(recompute), sorted(own)
    elif mode == "offload":
        _ttft(llm, p)
        for _ in range(2):  # let finished requests' offloads complete and free
            _ttft(llm, [5, 6, 7])
        if not llm.reset_prefix_cache():
            raise RuntimeError("gpu_check: reset_prefix_cache failed (blocks still held)")
        out["hit_ttft"] = _ttft(llm, q)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return out


def _quiet_store(connector: Any, store: Any) -> None:
    """Before a timed hit: this process's dumps drained, its memory tier's warmer done
    (it allocates the tier in the background at start) and the reserve refilled."""
    connector.wait_for_dumps(600)
    memory = getattr(store, "memory", None)
    if memory is not None:
        memory.wait_warm(300)
        memory.cleaner.wait_idle(120)


def _steady_hits(llm: Any, connector: Any, store: Any, prefix: list[int], n: int) -> dict[str, Any]:
    """``n`` more hits of the same prefix in this process, each on a quiet store, each
    with a tail of its own (a tail already stored would lengthen the hit) and vLLM's own
    prefix cache reset first (so the prefix comes from the store again): TTFT median,
    spread, and the hit length of each."""
    import random

    rng = random.Random(7)
    times, hits = [], []
    for _ in range(n):
        _quiet_store(connector, store)
        for _step in range(3):  # finished requests' blocks are freed a step later
            _ttft(llm, [5, 6, 7])
        if not llm.reset_prefix_cache():
            raise RuntimeError("gpu_check: reset_prefix_cache failed (blocks still held)")
        tail = [rng.randrange(4, 100000) for _ in range(PROMPT_LEN - len(prefix))]
        got = _ttft(llm, prefix + tail)
        times.append(got["seconds"])
        hits.append(got["num_cached_tokens"])
    times.sort()
    return {"seconds": times, "median_s": times[len(times) // 2], "hit_tokens": hits}


def _h2d_reference(nbytes: int) -> dict[str, float]:
    """The machine's host-to-device bandwidth for the hit's bytes: from a pinned tensor,
    and from a /dev/shm mapping registered with CUDA (cudaHostRegister: what the memory
    tier's segments would be), one copy each after a warm-up; GB/s."""
    import mmap

    import torch

    out: dict[str, float] = {}
    if not torch.cuda.is_available():  # a dry run on CPU vLLM (--tiny)
        return out
    nbytes = max(nbytes, 1 << 20)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(src: Any) -> float:
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t0) / 1e9

    out["pinned_gbps"] = timed(torch.empty(nbytes, dtype=torch.uint8).pin_memory())
    path = f"/dev/shm/gpu-check-h2d-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        host = torch.frombuffer(m, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)) == 0:
            try:
                out["registered_shm_gbps"] = timed(host)
            finally:
                cudart.cudaHostUnregister(host.data_ptr())
        out["pageable_shm_gbps"] = timed(host)
        del host
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return out


# ======================================================================================
# parent
# ======================================================================================
class Session:
    """One check: its directories, the deadline, and the runs finished so far (rewritten
    to ``--json`` after each, so a check cut off by the machine's limit still reports)."""

    def __init__(
        self,
        workdir: Path,
        logs: Path | None,
        json_out: Path | None,
        deadline: float | None,
        tiny: bool = False,
    ) -> None:
        self.workdir = workdir
        self.tiny = tiny
        self.logs = logs
        self.json_out = json_out
        self.deadline = deadline
        self.lock_path = workdir / "gpu.lock"
        self.runs: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def remaining(self) -> float:
        return 1800.0 if self.deadline is None else self.deadline - time.monotonic()

    def record(self, name: str, key: str, result: dict[str, Any]) -> None:
        with self._lock:
            self.runs.setdefault(name, {})[key] = result
            if self.json_out is not None:
                cols = [judge(n, model_of(n), r) for n, r in self.runs.items()]
                self.json_out.write_text(json.dumps({"columns": cols, "runs": self.runs}, indent=1))


def model_of(column: str) -> dict[str, Any]:
    """The model config of a table column (``dense``, or ``dense, 8 threads``)."""
    return MODELS[column.split(",")[0]]


def child_env(session: Session, chain: str, env: dict[str, str]) -> dict[str, str]:
    """The child's environment: the repository after what is already on ``PYTHONPATH``
    (an installed ucm_patch must win over the source tree's top-level folders; the tree
    gives ``tests.support``), vLLM in this process (the connector's stats and dumps are
    read in it), this chain's own compile cache, and the GPU lock."""
    path = os.pathsep.join([*filter(None, [os.environ.get("PYTHONPATH")]), str(REPO)])
    return {
        **os.environ,
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": path,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(session.workdir / f"vllm-cache-{chain}"),
        LOCK_ENV: str(session.lock_path),
        **({HOST_KV_ENV: str(TINY_HOST_KV_BYTES)} if session.tiny else {}),
        **env,
    }


def run_child(
    session: Session,
    chain: str,
    mode: str,
    model: Path,
    store: Path,
    hybrid: bool,
    env: dict[str, str],
) -> dict[str, Any]:
    left = session.remaining()
    if left < 30:
        return {"error": f"not run: the check's deadline leaves {left:.0f} s"}
    out = session.workdir / f"{model.name}-{mode}-{chain}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "child", mode, str(model), str(store), str(int(hybrid))]
    print(f"[gpu-check] start {model.name} {mode} {env or ''}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [*cmd, str(out)],
            env=child_env(session, chain, env),
            capture_output=True,
            text=True,
            timeout=left,
        )
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        parts = [
            p.decode(errors="replace") if isinstance(p, bytes) else p or ""
            for p in (exc.stdout, exc.stderr)
        ]
        output = "".join(parts) + f"\n{KILLED}"
        rc = -9
    print(
        f"[gpu-check] end {model.name} {mode}: rc {rc}, {time.monotonic() - t0:.0f} s", flush=True
    )
    if session.logs is not None:
        session.logs.mkdir(parents=True, exist_ok=True)
        (session.logs / f"{model.name}-{chain}-{mode}.log").write_text(output)
    if rc != 0 or not out.exists():
        return {"error": output[-3000:]}
    result = json.loads(out.read_text())
    result["process_s"] = time.monotonic() - t0
    refusal = [ln for ln in output.splitlines() if REFUSAL in ln]
    if refusal:
        result["refused"] = refusal[0].split(REFUSAL, 1)[1].strip(" :.")
    return result


def hook_counts(record: Path, layers: list[str]) -> dict[str, int]:
    """Waits and saves the counting connector recorded (JSON lines) on ``layers``."""
    calls = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    want = set(layers)
    waits = sum(1 for c in calls if c["call"] == "wait_for_layer_load" and c.get("layer") in want)
    saves = sum(1 for c in calls if c["call"] == "save_kv_layer" and c.get("layer") in want)
    return {"waits": waits, "saves": saves}


def hooks_ok(kinds: dict[str, list[str]], patched: dict[str, Any], plain: dict[str, Any]) -> bool:
    """Every layer kind gets waits and saves with ucm_patch (one of each per step); GDN
    layers get none without it (vLLM makes none for them)."""
    if "counts" not in patched or "counts" not in plain:
        return False
    for kind, layers in kinds.items():
        got = patched["counts"][kind]
        if layers and not (got["waits"] > 0 and got["waits"] == got["saves"]):
            return False
    return not kinds["gdn"] or plain["counts"]["gdn"]["waits"] == 0


def failure(run: dict[str, Any]) -> str:
    """A failed run's cell: its output's last line (one line, no table pipes)."""
    lines = [ln.strip() for ln in run.get("error", "").splitlines() if ln.strip()]
    last = lines[-1] if lines else "failed"
    if last == KILLED:
        return "killed at the deadline"
    return "error: " + last.replace("|", "/")[-160:]


def dump_bandwidth(dump: dict[str, Any]) -> dict[str, Any]:
    """P's KV production against the dump path's bandwidth (module docstring, item 4)."""
    nbytes, prefill_s, work_s = dump["dump_bytes"], dump["cold"]["seconds"], dump["dump_work_s"]
    busy_s = dump.get("dump_busy_s") or work_s  # runs before dump_busy_s: the worker sum
    produce = nbytes / prefill_s if prefill_s else 0.0
    capacity = nbytes / busy_s if busy_s else 0.0
    out: dict[str, Any] = {
        "dump_gb": nbytes / 1e9,
        "kv_produced_gbps": produce / 1e9,
        "dump_gbps": capacity / 1e9,
        "dump_vs_production": capacity / produce if produce else 0.0,
        "dump_tail_ms": 1000 * (dump["dump_seconds"] - prefill_s),
    }
    if "dump_copy_s" in dump and work_s:  # where the workers' time went: device copies
        out["dump_copy_share"] = dump["dump_copy_s"] / work_s  # (the rest: store puts)
    if "threads" in dump:
        out["threads"] = dump["threads"]
    return out


def judge(name: str, config: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """One model's column of the table, and whether the checks with a right answer hold."""
    kinds = layer_kinds(config)
    col: dict[str, Any] = {"model": name}
    ok = True
    if "," not in name:  # a ``--threads`` column checks the connector only
        for label in ("patched", "plain"):
            hooks = runs.get(f"hooks_{label}", {})
            col[f"hooks_{label}"] = (
                hooks["counts"] if "counts" in hooks else failure(hooks) if hooks else "not run"
            )
        ok = hooks_ok(kinds, runs.get("hooks_patched", {}), runs.get("hooks_plain", {}))
    dump, load, off = runs.get("dump", {}), runs.get("load", {}), runs.get("offload", {})
    if "error" in dump or "error" in load:
        col["hit"] = failure(dump if "error" in dump else load)
        ok = False
    elif not (dump and load):  # not run (yet): the deadline, or a report mid-check
        col["hit"] = "not run"
        ok = False
    elif dump.get("refused"):  # the connector's own start-up refusal (older vLLM)
        col["hit"] = f"refused at start: {dump['refused']}"
        ok &= load["hit_ttft"]["num_cached_tokens"] == 0 and dump["dump_bytes"] == 0
    else:
        unit = load.get("unit", load["block_size"])
        want = load["shared"] // unit * unit
        ref, hit = dump["recompute"], load["hit"]
        diff = max(
            (abs(a - b) for a, b in zip(ref["logprobs"], hit["logprobs"], strict=False)),
            default=0.0,
        )
        col["hit"] = f"{load['hit_ttft']['num_cached_tokens']}/{want} tokens"
        col["same_tokens"] = ref["tokens"] == hit["tokens"]
        col["max_logprob_diff"] = diff
        ok &= load["hit_ttft"]["num_cached_tokens"] == want and col["same_tokens"]
        col["ttft_ms"] = {
            "recompute": 1000 * dump["recompute_ttft"]["seconds"],
            "vllm_prefix_cache": 1000 * dump["own_cache"]["seconds"],
            "ucm_hit": 1000 * load["hit_ttft"]["seconds"],
            "offloading_connector": 1000 * off["hit_ttft"]["seconds"]
            if "hit_ttft" in off
            else None,
        }
        if "num_cached_tokens" in off.get("hit_ttft", {}):  # the same hit length for all
            col["offloading_hit_tokens"] = off["hit_ttft"]["num_cached_tokens"]
            ok &= col["offloading_hit_tokens"] == want
        plain = runs.get("plain", {})
        if "recompute_s" in plain:  # medians in a process without a connector
            col["plain_ttft_ms"] = {
                f"{k} median": 1000 * plain[f"{k}_s"][len(plain[f"{k}_s"]) // 2]
                for k in ("recompute", "own_cache")
            } | {
                f"{k} spread": 1000 * (plain[f"{k}_s"][-1] - plain[f"{k}_s"][0])
                for k in ("recompute", "own_cache")
            }
        if "load_s" in load:  # the load threads' seconds (summed), the forward's stall
            col["load_ms"] = {k: 1000 * v for k, v in load["load_s"].items()}
        steady = load.get("steady")
        if steady:  # later hits in the same process, each on a quiet store
            times = steady["seconds"]
            col["steady_hit_ms"] = {
                "median": 1000 * steady["median_s"],
                "min": 1000 * times[0],
                "max": 1000 * times[-1],
                "n": len(times),
            }
            col["steady_hit_tokens"] = sorted(set(steady["hit_tokens"]))
            ok &= set(steady["hit_tokens"]) == {want}
        for part in ("steady_error", "h2d_error"):
            if part in load:
                col[part] = load[part]
        if "h2d" in load:  # the machine's reference bandwidths for the hit's bytes
            col["hit_gb"] = load["hit_bytes"] / 1e9
            col["h2d_gbps"] = load["h2d"]
            spent = load.get("load_s", {})
            busy = spent.get("read", 0.0) + spent.get("copy", 0.0)
            if busy:  # the load threads' summed seconds: a lower bound on their bandwidth
                col["load_threads_gbps"] = load["hit_bytes"] / busy / 1e9
        col.update(dump_bandwidth(dump))
    col["ok"] = ok
    return col


def render(cols: list[dict[str, Any]]) -> str:
    rows = [("check", [c["model"] for c in cols])]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}"
        if isinstance(value, dict):
            return ", ".join(f"{k} {cell(v)}" for k, v in value.items())
        return str(value)

    for key in (
        "hooks_patched",
        "hooks_plain",
        "hit",
        "same_tokens",
        "max_logprob_diff",
        "ttft_ms",
        "plain_ttft_ms",
        "offloading_hit_tokens",
        "load_ms",
        "steady_hit_ms",
        "steady_hit_tokens",
        "hit_gb",
        "h2d_gbps",
        "load_threads_gbps",
        "steady_error",
        "h2d_error",
        "dump_gb",
        "kv_produced_gbps",
        "dump_gbps",
        "dump_vs_production",
        "dump_tail_ms",
        "dump_copy_share",
        "threads",
        "ok",
    ):
        rows.append((key, [cell(c.get(key, "-")) for c in cols]))
    lines = ["| " + " | ".join([rows[0][0], *rows[0][1]]) + " |", "|" + "---|" * (len(cols) + 1)]
    lines += ["| " + " | ".join([k, *vals]) + " |" for k, vals in rows[1:]]
    return "\n".join(lines)


def hooks_chain(session: Session, name: str) -> None:
    """The counting connector with ucm_patch, then with ``UCM_PATCH=0``."""
    model = write_model(session.workdir, name, session.tiny)
    kinds = layer_kinds(MODELS[name])
    for label, env in (("patched", {}), ("plain", {"UCM_PATCH": "0"})):
        record = session.workdir / f"{name}-{label}.jsonl"
        record.unlink(missing_ok=True)
        env = {**env, "UCM_TEST_RECORD": str(record)}
        result = run_child(
            session,
            f"{name}-hooks",
            "hooks",
            model,
            session.workdir / "unused",
            name == "hybrid",
            env,
        )
        if "error" not in result:
            result["counts"] = {kind: hook_counts(record, v) for kind, v in kinds.items()}
        session.record(name, f"hooks_{label}", result)


def _remove_memory_tier(store: Path) -> None:
    """The memory tier the chain's store kept (``local_memory_keep_bytes``: the load run
    reads it warm) is removed once its runs are done: nothing is left in /dev/shm."""
    import shutil

    from ucm_patch.hooks.stores.local import default_memory_path

    shutil.rmtree(default_memory_path(store), ignore_errors=True)


def connector_chain(session: Session, name: str, threads: int | None = None) -> None:
    """Process A dumps, process B (same hash seed) loads; then vLLM's OffloadingConnector
    (not for a ``threads`` column: the same connector with that many dump and load
    threads, its own store)."""
    model = write_model(session.workdir, name, session.tiny)
    column = name if threads is None else f"{name}, {threads} threads"
    chain = f"{name}-ucm" if threads is None else f"{name}-ucm-t{threads}"
    store = session.workdir / f"{chain}-store"
    hybrid = name == "hybrid"
    env = {} if threads is None else {THREADS_ENV: str(threads)}
    for mode in ("dump", "load"):
        result = run_child(session, chain, mode, model, store, hybrid, env)
        session.record(column, mode, result)
    if threads is not None or result.get("refused"):
        _remove_memory_tier(store)
        return  # a refused model has no hit to set the peer's against
    _remove_memory_tier(store)  # kept for the load run (a warm restart); not after it
    same = {UNIT_ENV: str(result["unit"])} if "unit" in result else {}
    unused = session.workdir / "unused"
    for mode in ("plain", "offload"):  # no connector; vLLM's OffloadingConnector
        session.record(name, mode, run_child(session, chain, mode, model, unused, hybrid, same))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        mode, model, store, hybrid, out = argv[1:]
        Path(out).write_text(json.dumps(child(mode, model, store, hybrid == "1")))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="the table as JSON, rewritten after each run")
    ap.add_argument("--logs", default=None, help="a folder for every child's whole output")
    ap.add_argument("--models", default="dense,hybrid")
    ap.add_argument("--jobs", type=int, default=1, help="chains run side by side")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no run after this")
    ap.add_argument("--tiny", action="store_true", help="narrow models: a dry run on CPU vLLM")
    ap.add_argument(
        "--threads",
        default="",
        help="comma list: a dense column per count, its connector with that many dump and "
        "load threads (the default column uses copy_threads())",
    )
    args = ap.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown model {unknown[0]!r} (known: {', '.join(MODELS)})")
    try:
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--threads: expected a comma list of thread counts, got {args.threads!r}")
    if any(t < 1 for t in threads):
        ap.error(f"--threads: every count must be >= 1, got {args.threads!r}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ucm-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    session = Session(
        workdir,
        Path(args.logs) if args.logs else None,
        Path(args.json) if args.json else None,
        deadline,
        args.tiny,
    )
    # the connector chains first: they carry the checks a user's hit depends on
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(connector_chain, session, n) for n in names]
        futures += [pool.submit(connector_chain, session, "dense", t) for t in threads]
        futures += [pool.submit(hooks_chain, session, n) for n in names]
        for future in futures:
            future.result()
    columns = [*names, *(f"dense, {t} threads" for t in threads)]
    cols = [judge(c, model_of(c), session.runs.get(c, {})) for c in columns]
    print(render(cols))
    return 0 if all(c["ok"] for c in cols) else 1


if __name__ == "__main__":
    sys.exit(main())
