"""Version-dependent vLLM accessors, resolved once when a wrapper is made.

Every function here runs at patch-apply time (inside a record's ``make_wrapper``), never
per call: each returns a small callable specialised for the installed vLLM, so the hot
path does no feature detection, no imports and no ``hasattr`` probing.

What differs between versions:

* ``ForwardContext.virtual_engine`` exists up to 0.18 and a layer's ``kv_cache`` is a
  per-pipeline-stage list indexed by it; from 0.19 ``kv_cache`` is used directly. For a
  GDN layer the cache is ``[conv_state, ssm_state]``, so indexing it with ``[0]`` on 0.19+
  would silently hand out ``conv_state`` alone.
* From 0.20 an op's ``layer_name`` argument may be an opaque ``LayerName`` object;
  ``vllm.utils.torch_utils._resolve_layer_name`` turns it back into the string.
"""

from __future__ import annotations

from collections.abc import Callable

from ucm_patch.hooks import layerwise
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any


# One implementation, in the hook API; named here too because the wrappers' version facts
# are read from this module.
forward_context_getter = layerwise.forward_context_getter
forward_context_holder = layerwise.forward_context_holder


def has_virtual_engine() -> bool:
    """True when ``ForwardContext`` still carries ``virtual_engine`` (vLLM <= 0.18)."""
    import dataclasses

    from vllm.forward_context import ForwardContext

    if dataclasses.is_dataclass(ForwardContext):
        return any(f.name == "virtual_engine" for f in dataclasses.fields(ForwardContext))
    return "virtual_engine" in getattr(ForwardContext, "__annotations__", {})


def _identity_name(layer_name: Any) -> str:
    return layer_name


def layer_name_resolver() -> Callable[[Any], str]:
    """The function that turns an op's ``layer_name`` argument into the layer's prefix.

    ``_resolve_layer_name`` (vLLM 0.20+) when present, else the identity: before 0.20 the
    argument is always a plain ``str``.
    """
    try:
        from vllm.utils.torch_utils import _resolve_layer_name
    except ImportError:
        return _identity_name
    return _resolve_layer_name


class _NoLayerName:
    """Matches no object's class: the stand-in for ``LayerName`` before vLLM 0.20."""


def layer_name_class() -> type:
    """``vllm.utils.torch_utils.LayerName`` (0.20+: how the dispatcher passes an op's
    ``layer_name``), else a class nothing is an instance of. Lets a per-layer wrapper
    unwrap the common case inline instead of calling :func:`layer_name_resolver`'s result."""
    try:
        from vllm.utils.torch_utils import LayerName
    except ImportError:
        return _NoLayerName
    return LayerName


def platform_dispatch_key() -> str:
    """Dispatch key vLLM registers its custom-op kernels under (``CPU``, ``CUDA`` ...).

    Named by op-kernel records as ``dispatch_key``; called by the registry at apply time.
    """
    from vllm.platforms import current_platform

    return current_platform.dispatch_key


DISPATCH_KEY = "ucm_patch.patches.vllm._vllm_compat:platform_dispatch_key"
