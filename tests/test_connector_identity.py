"""The key fingerprint covers the weights and every setting that changes KV bytes.

Before, the identity was the model's name/path string (plus dtypes): a checkpoint
rewritten in place at the same path served KV computed with the old weights. Each test
changes one thing and checks the fingerprint (or the identity) moves, or that it stays
when nothing that matters changed (another process, a copy under a namespace).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import REPO, repo_pythonpath
from tests.support.connector_harness import kv_cache_config, vllm_config
from ucm_patch.connector.config import CHUNK_TOKENS
from ucm_patch.connector.identity import SAMPLE_BYTES, model_identity, weight_identity
from ucm_patch.connector.layout import KVLayout


def checkpoint(root: Path, seed: int = 1) -> Path:
    """A fake local checkpoint: config, an index and two weight shards of random bytes."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"rope_theta": 10000}))
    (root / "model.safetensors.index.json").write_text("{}")
    for i in range(2):
        (root / f"model-0000{i}.safetensors").write_bytes(_bytes(seed + i))
    (root / "tokenizer.json").write_text("{}")  # not a weight file: ignored
    return root


def _bytes(seed: int, n: int = 5 * SAMPLE_BYTES) -> bytes:
    return random.Random(seed).randbytes(n)


def config(model: str, **changes: Any) -> SimpleNamespace:
    cfg = vllm_config(model=model)
    hf = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=4096, rope_scaling=None)
    cfg.model_config.hf_config = hf
    cfg.model_config.revision = None
    cfg.model_config.quantization = None
    for dotted, value in changes.items():
        obj = cfg
        *path, attr = dotted.split("__")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, attr, value)
    return cfg


def fingerprint(cfg: SimpleNamespace, namespace: str | None = None) -> str:
    return KVLayout.from_vllm(cfg, kv_cache_config(), namespace, CHUNK_TOKENS).fingerprint


def test_weights_rewritten_in_place_change_the_fingerprint(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    before = fingerprint(config(str(model)))
    shard = model / "model-00001.safetensors"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte in the middle sample, same size
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime
    assert fingerprint(config(str(model))) != before
    os.utime(shard)  # a new mtime alone (same bytes as now) also counts without namespace
    now = fingerprint(config(str(model)))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fingerprint(config(str(model))) != now


def test_namespace_shares_copies_but_not_other_weights(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)  # same bytes, other path, other mtimes
    os.utime(b / "model-00000.safetensors", ns=(1, 1))
    assert fingerprint(config(str(a))) != fingerprint(config(str(b)))
    assert fingerprint(config(str(a)), "shared") == fingerprint(config(str(b)), "shared")
    other = checkpoint(tmp_path / "c", seed=7)
    assert fingerprint(config(str(other)), "shared") != fingerprint(config(str(a)), "shared")


@pytest.mark.parametrize(
    "change",
    [
        {"model_config__revision": "v2"},
        {"model_config__dtype": "float16"},
        {"model_config__quantization": "fp8"},
        {"model_config__hf_config__quantization_config": {"quant_method": "awq", "bits": 4}},
        {"model_config__hf_config__rope_theta": 500000.0},
        {"model_config__hf_config__rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"model_config__hf_config__max_position_embeddings": 8192},
        {"cache_config__cache_dtype": "fp8"},
        {"cache_config__block_size": 8},
        {"parallel_config__tensor_parallel_size": 2},
    ],
    ids=lambda change: next(iter(change)).rsplit("__", 1)[-1],
)
def test_each_setting_changes_the_fingerprint(tmp_path: Path, change: dict[str, Any]) -> None:
    model = str(checkpoint(tmp_path / "m"))
    if "cache_config__block_size" in change:
        # the group's block size must stay a multiple of the hash block size
        base = config(model, cache_config__hash_block_size=4)
        changed = config(model, cache_config__hash_block_size=4, **change)
    else:
        base, changed = config(model), config(model, **change)
    assert fingerprint(base) != fingerprint(changed)


def test_pipeline_parallel_size_is_part_of_the_identity(tmp_path: Path) -> None:
    """PP > 1 is refused by the layout today; the identity still carries it."""
    model = str(checkpoint(tmp_path / "m"))
    one = model_identity(config(model), None)
    two = model_identity(config(model, parallel_config__pipeline_parallel_size=2), None)
    assert one["pp"] == 1 and two["pp"] == 2


def test_hub_id_is_identified_by_id_and_revision() -> None:
    assert weight_identity("org/not-a-local-path", with_mtime=True) is None
    cfg = config("org/not-a-local-path", model_config__revision="abc123")
    ident = model_identity(cfg, None)
    assert ident["weights"] is None and ident["revision"] == "abc123"


def test_same_config_same_fingerprint_in_another_process(tmp_path: Path) -> None:
    model = str(checkpoint(tmp_path / "m"))
    code = (
        "import sys\n"
        "from tests.test_connector_identity import config, fingerprint\n"
        "print(fingerprint(config(sys.argv[1])))\n"
    )
    env = dict(os.environ, PYTHONPATH=repo_pythonpath())
    out = subprocess.run(
        [sys.executable, "-c", code, model],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert out.stdout.strip().splitlines()[-1] == fingerprint(config(model))
