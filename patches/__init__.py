"""Patch sets per library, one per feature module (installed as ``ucm_patch.patches``).

Each library subpackage exports ``PATCH_SETS``: a tuple of :class:`ucm_patch.records.PatchSet`.
Importing these modules must never import the target library: records are data, and
wrappers bind the library at apply time.
"""

from __future__ import annotations

from ucm_patch.records import PatchSet


def all_patch_sets() -> tuple[PatchSet, ...]:
    """Every patch set ucm_patch knows, vLLM first, then vLLM-Ascend."""
    from ucm_patch.patches import vllm, vllm_ascend

    return tuple(vllm.PATCH_SETS) + tuple(vllm_ascend.PATCH_SETS)
