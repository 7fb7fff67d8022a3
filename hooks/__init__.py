"""Layerwise hooks and the dump scheduler (installed as ``ucm_patch.hooks``).

Patches call :mod:`ucm_patch.hooks.layerwise` only. Nothing here imports vLLM or torch at
import time; they are bound lazily.
"""
