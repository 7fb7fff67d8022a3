"""Which Python function each custom op's kernel actually is: a ledger of registrations.

torch keeps a Python kernel inside the C++ dispatcher and never hands it back (the
dispatcher only exposes a boxed ``_SafeKernelFunction``), so "what does
``torch.ops.vllm.qwen_gdn_attention_core`` run?" cannot be answered after the fact. The
module attribute of the same name is only a guess: vLLM registers
``op_func=<expression>``, and upstream may register a decorated copy
(``maybe_transfer_kv_layer(f)``) while the module keeps the plain function.

So, while ucm_patch is active, :func:`watch` wraps ``torch.library.Library.impl`` (the call
every ``direct_register_custom_op`` of vLLM and vLLM-Ascend ends in) and notes
``"namespace::op" -> function`` for each kernel registered from then on. The wrapper only
records; it never changes what is registered and never raises into the caller. Native-hook
detection (:mod:`ucm_patch.native`) reads the ledger at apply time; a kernel registered
before activation is not in it, and detection falls back to the module attribute.

Wrapped on the class, once per process, when ``torch.library`` is imported (a post-import
hook: ``import ucm_patch`` imports no torch). Registration is start-up work, never a hot path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ucm_patch import importhooks
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

_lock = threading.Lock()
_kernels: dict[str, Callable[..., Any]] = {}  # "ns::op" -> the last kernel registered
_watching = False
# Registrations the ledger could not note ("op: ExcType: message"), for ucm-patch status
# and tests: native detection then falls back to the op's module attribute.
missed: list[str] = []


def registered(op: str) -> Callable[..., Any] | None:
    """The Python function last registered as a kernel of ``op`` while watching, or None."""
    with _lock:
        return _kernels.get(op)


def note(op: str, fn: Callable[..., Any]) -> None:
    """Record ``fn`` as ``op``'s kernel (the watcher calls this; tests may too)."""
    with _lock:
        _kernels[op] = fn


def watch() -> None:
    """Start recording kernel registrations (idempotent; waits for ``torch.library``)."""
    global _watching
    with _lock:
        if _watching:
            return
        _watching = True
    importhooks.when_imported("torch.library", _wrap_impl)


def _wrap_impl(module: Any) -> None:
    library = getattr(module, "Library", None)
    impl = getattr(library, "impl", None)
    if impl is None or getattr(impl, "_ucm_patch_ledger", False):
        return

    def impl_noting_kernel(self: Any, op_name: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        result = impl(self, op_name, fn, *args, **kwargs)
        try:  # bookkeeping only
            name = op_name if isinstance(op_name, str) else getattr(op_name, "_name", "")
            short = name.split("::")[-1].split(".")[0]
            if short and callable(fn):
                note(f"{self.ns}::{short}", fn)
        except Exception as exc:  # a registration must never fail because of the ledger
            with _lock:
                if len(missed) < 100:
                    missed.append(f"{op_name!r}: {type(exc).__name__}: {exc}")
        return result

    impl_noting_kernel._ucm_patch_ledger = True  # type: ignore[attr-defined]
    impl_noting_kernel.__wrapped__ = impl  # type: ignore[attr-defined]
    impl_noting_kernel.__doc__ = impl.__doc__
    library.impl = impl_noting_kernel


def reset_for_tests() -> None:
    with _lock:
        _kernels.clear()
