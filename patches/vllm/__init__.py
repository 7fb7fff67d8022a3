"""Patch sets for vllm (one module per feature; each lists its records per era)."""

from __future__ import annotations

from ucm_patch.records import PatchSet

PATCH_SETS: tuple[PatchSet, ...] = ()
