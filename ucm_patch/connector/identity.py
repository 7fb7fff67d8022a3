"""What a stored KV page was computed from: the part of the key fingerprint that names the model.

A page is only valid for the exact weights and settings that produced it. The store key's
fingerprint (:class:`ucm_patch.connector.layout.KVLayout`) therefore covers:

* **the weights**: per weight file of a local checkpoint (``*.safetensors``, ``*.bin``,
  ``*.pt``, ``*.pth``, ``*.gguf``, their index files and ``config.json``), its name, size
  and a sampled content hash (blake2b of three :data:`SAMPLE_BYTES` slices: start, middle,
  end); without a ``namespace`` also the path and each file's modification time. A
  checkpoint rewritten in place changes its mtime and, for any real update, its sampled
  bytes, so KV computed with the old weights is a miss, never served.
  Cost at start: one ``stat`` and three small reads per weight file, in both connector
  roles (the count and the time are logged). A hub id that is not a local path is
  identified by its id and ``revision`` only (vLLM downloads a snapshot per revision).
* **the settings that change KV bytes**: revision, dtype, ``kv_cache_dtype``, the mamba
  cache dtypes, quantization (vLLM's method and the checkpoint's
  ``quantization_config``), RoPE and position settings, block size, TP / PP sizes.

``namespace`` (connector config) replaces the path and the mtimes, so instances that load
the same weights from different paths or hosts share keys; the names, sizes and sampled
content still count, so a namespace shared by mistake across different weights misses.
An in-place edit that changes no sampled byte and no size (a few tensors patched) is then
not seen: change the namespace with the weights.

Every attribute is read with a default: stand-in configs (tests) and older vLLM releases
lack some of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

# Under vLLM's logger: its handler, level and format (``INFO mm-dd hh:mm:ss [file:line]``).
logger = logging.getLogger(f"vllm.{__name__}")

#: Bytes hashed at each of the three sample points of a weight file.
SAMPLE_BYTES = 64 << 10
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
CONFIG_FILES = ("config.json",)
#: hf_config attributes that change positions or rotary embeddings, so the KV bytes.
ROPE_KEYS = (
    "rope_scaling",
    "rope_theta",
    "rope_parameters",
    "rope_type",
    "max_position_embeddings",
    "partial_rotary_factor",
    "rotary_dim",
    "position_embedding_type",
    "sliding_window",
)


def _sampled_hash(path: str, size: int) -> str:
    """blake2b over the first, middle and last :data:`SAMPLE_BYTES` of a file."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb", buffering=0) as f:
        middle = max(0, size // 2 - SAMPLE_BYTES // 2)
        for offset in sorted({0, middle, max(0, size - SAMPLE_BYTES)}):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _is_weight_file(name: str) -> bool:
    return name in CONFIG_FILES or name.endswith(WEIGHT_SUFFIXES)


def weight_identity(model: str, with_mtime: bool) -> list[list[Any]] | None:
    """``[[name, size, sampled hash(, mtime_ns)], ...]`` of a local checkpoint's weight files.

    None when ``model`` is not a local file or directory (a hub id)."""
    if os.path.isdir(model):
        paths = sorted(
            os.path.join(model, name) for name in os.listdir(model) if _is_weight_file(name)
        )
    elif os.path.isfile(model):
        paths = [model]
    else:
        return None
    files: list[list[Any]] = []
    for path in paths:
        st = os.stat(path)
        entry: list[Any] = [os.path.basename(path), st.st_size, _sampled_hash(path, st.st_size)]
        if with_mtime:
            entry.append(st.st_mtime_ns)
        files.append(entry)
    return files


def _plain(value: Any) -> Any:
    """JSON-stable form of a config value (dicts, lists, numbers, strings; else its repr)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict())
    return str(value)


def model_identity(vllm_config: Any, namespace: str | None) -> dict[str, Any]:
    """Everything about the model and its settings that changes the KV bytes (module doc)."""
    t0 = time.perf_counter()
    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    hf_config = getattr(model_config, "hf_config", None)
    model = str(model_config.model)
    weights = weight_identity(model, with_mtime=namespace is None)
    rope = {key: _plain(getattr(hf_config, key, None)) for key in ROPE_KEYS}
    identity = {
        "model": namespace or model,
        "weights": weights,
        "revision": getattr(model_config, "revision", None),
        "dtype": str(model_config.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "mamba_cache_dtype": str(getattr(cache, "mamba_cache_dtype", None)),
        "mamba_ssm_cache_dtype": str(getattr(cache, "mamba_ssm_cache_dtype", None)),
        "quantization": _plain(getattr(model_config, "quantization", None)),
        "quantization_config": _plain(getattr(hf_config, "quantization_config", None)),
        "rope": {key: value for key, value in rope.items() if value is not None},
        "block_size": int(cache.block_size),
        "tp": int(getattr(parallel, "tensor_parallel_size", 1)),
        "pp": int(getattr(parallel, "pipeline_parallel_size", 1)),
    }
    if weights is None:
        logger.info(
            "ucm connector: %r is not a local checkpoint: weights identified by id and "
            "revision %r only",
            model,
            identity["revision"],
        )
    else:
        logger.info(
            "ucm connector: weight identity of %d file(s) in %.1f ms%s",
            len(weights),
            (time.perf_counter() - t0) * 1e3,
            "" if namespace is None else f" (namespace {namespace!r}: paths and mtimes ignored)",
        )
    json.dumps(identity)  # fail here, naming nothing unserialisable later
    return identity


__all__ = ["SAMPLE_BYTES", "model_identity", "weight_identity"]
