"""Call-time isolation: a wrapper that raises must not take the host down.

The registry wraps a target with ``FunctionWrapper(shim, guard)`` instead of
``FunctionWrapper(original, wrapper)``:

* ``shim`` calls the original and notes, in a per-record cell, that it started and that
  it returned (keeping its result);
* ``guard`` calls the patch's wrapper and, if that raises, uses the cell to tell *whose*
  exception it is:

  - the original started and did not return: the error is the host's own (a real
    forward failure) and propagates unchanged;
  - the original returned, then the wrapper's post-call code failed: the record is
    marked failed and the original's result is returned, so the step completes;
  - the original never started (the wrapper's pre-call code failed): the record is
    marked failed and the original is called now.

  A failed record turns into a pass-through for the rest of the process. In strict mode
  the failure is raised as :class:`~ucm_patch.errors.PatchFailed` instead.

Cost: one extra Python frame (the shim) per call, no allocation. The cell is per record
and not per thread: vLLM runs a worker's forward pass on one thread, and a layer's core
does not re-enter itself. The shim only applies to plain functions (every current target);
other callables are wrapped without a guard.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from ucm_patch.errors import PatchFailed
from ucm_patch.records import Wrapper

IDLE, RUNNING, RETURNED = 0, 1, 2


class CallCell:
    """Per-record call state shared by the shim and the guard."""

    __slots__ = ("broken", "result", "state")

    def __init__(self) -> None:
        self.state = IDLE
        self.result: Any = None
        self.broken = False


def _never() -> bool:
    return False


def guardable(original: Any) -> bool:
    """Only a real function: wrapt proxies pass ``isinstance`` checks for functions, and a
    copied, already-wrapped method called through the shim would lose its instance."""
    return type(original) is types.FunctionType


def make_shim(original: Callable[..., Any], cell: CallCell) -> Callable[..., Any]:
    """A plain function (so it binds like ``original``) that records the call's progress.

    It carries the original's signature with its annotations *evaluated*: vLLM infers a
    custom op's schema from the kernel's signature, and ``functools.wraps`` alone leaves
    string annotations that would be evaluated against this module's globals.
    """

    @functools.wraps(original)
    def shim(*args: Any, **kwargs: Any) -> Any:
        cell.state = RUNNING
        result = original(*args, **kwargs)
        cell.result = result
        cell.state = RETURNED
        return result

    import inspect  # apply time only

    try:
        shim.__signature__ = inspect.signature(original, eval_str=True)  # type: ignore[attr-defined]
    except (NameError, TypeError, SyntaxError, AttributeError):
        shim.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    return shim


def make_guard(
    wrapper: Wrapper,
    cell: CallCell,
    original: Callable[..., Any],
    on_failure: Callable[[BaseException], None],
    strict: Callable[[], bool],
    skip_when: Callable[[], bool] | None = None,
) -> Wrapper:
    """The wrapt wrapper actually installed: ``wrapper`` plus failure isolation.

    While ``skip_when()`` is true, or once the record is broken, a call goes straight to
    ``original``, past the wrapper and the shim.
    """
    idle = skip_when or _never

    def guard(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if cell.broken or idle():
            if instance is None:
                return original(*args, **kwargs)
            return original(instance, *args, **kwargs)
        cell.state = IDLE
        try:
            out = wrapper(wrapped, instance, args, kwargs)
        except Exception as exc:
            state, result = cell.state, cell.result
            cell.result = None
            if state == RUNNING:
                raise  # the original itself failed: not ours to hide
            cell.broken = True
            on_failure(exc)
            if strict():
                raise PatchFailed(f"wrapper raised at call time: {exc!r}") from exc
            if state == RETURNED:
                return result
            return wrapped(*args, **kwargs)
        cell.result = None  # do not keep the host's result alive
        return out

    return guard
