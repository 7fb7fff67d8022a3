"""ucm_patch: layerwise KV-connector calls for every vLLM / vLLM-Ascend layer, at run time.

``import ucm_patch`` before vLLM starts activates the enabled patches lazily: each is
applied when its target module is imported (at once if it already is). It imports
neither vLLM nor torch itself. ``UCM_PATCH=0`` switches the package off; see the README
for toggles and ``ucm-patch status`` for what happened.
"""

from __future__ import annotations

from ucm_patch.activation import activate, enabled_by_env, registry, report, revert
from ucm_patch.errors import ConfigError, PatchFailed, UCMPatchError

__all__ = [
    "ConfigError",
    "PatchFailed",
    "UCMPatchError",
    "activate",
    "registry",
    "report",
    "revert",
]
__version__ = "0.1.0"

if enabled_by_env():
    activate()
