"""Keep vLLM's ``@eager_break_during_capture`` outermost when wrapping what it decorates.

vLLM 0.28+ decorates ops and layer methods that must not be captured into a breakable CUDA
graph (``vllm/compilation/breakable_cudagraph.py``): during capture the decorator ends the
graph segment, runs the function eagerly and records it for replay. Its docstring asks to
be the *outermost* decorator of anything with host-side side effects, naming
``maybe_transfer_kv_layer``'s ``wait_for_layer_load`` / ``save_kv_layer``: inside the
captured segment they would run once at capture and never on replay. A ucm_patch wrapper
set around the decorated object would be exactly that. So the installer wraps the function
the decorator holds and decorates the wrapper again with vLLM's own decorator
(:func:`split`), and an overridden op kernel gets the same treatment.

Read at apply time only; vLLM's module is looked up in ``sys.modules`` (a decorated object
exists only once it has been imported), never imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

MODULE = "vllm.compilation.breakable_cudagraph"
DECORATOR = "eager_break_during_capture"
_WRAPPER_QUALNAME = f"{DECORATOR}.<locals>.wrapper"


def is_capture_break(obj: Any) -> bool:
    """Whether ``obj`` is the function ``eager_break_during_capture`` returned."""
    code = getattr(obj, "__code__", None)
    return (
        code is not None
        and getattr(code, "co_qualname", "") == _WRAPPER_QUALNAME
        and code.co_filename.replace("\\", "/").endswith("compilation/breakable_cudagraph.py")
        and callable(getattr(obj, "__wrapped__", None))
    )


def split(obj: Any) -> tuple[Any, Callable[[Any], Any] | None]:
    """``(inner, redecorate)``: what to wrap and how to put the decorator back on top.

    ``redecorate`` is None (wrap ``obj`` itself) unless ``obj`` is a capture break of the
    vLLM module that is loaded now.
    """
    if not is_capture_break(obj):
        return obj, None
    decorator = getattr(sys.modules.get(MODULE), DECORATOR, None)
    if decorator is None:
        return obj, None
    return obj.__wrapped__, decorator
