"""Call-time isolation: a wrapper that raises must not take the host down.

The registry installs, for a plain-function target, an exact-signature trampoline
(:mod:`ucm_patch.trampoline`) that calls ``enabled()`` and then ``guard``; for any other
callable, ``FunctionWrapper(original, guard, enabled=...)``. Both evaluate:

* ``enabled`` (:func:`make_enabled`): falsy while the record's ``skip_when()`` holds (no
  KV connector active) or once the record is broken; the call then goes to the original
  directly. That is the idle path. For ``layerwise.idle`` it is a C-level
  ``functools.partial(getattr, ...)``, so no Python frame of ours runs at all.
* ``guard`` calls the patch's wrapper with a ``shim`` in place of the original: the shim
  calls the original and notes, in a per-record cell, that it started and that it
  returned (keeping its result). If the wrapper raises, the cell tells *whose* exception
  it is:

  - the original started and did not return: the error is the host's own (a real
    forward failure) and propagates unchanged;
  - the original returned, then the wrapper's post-call code failed: the record is
    marked failed and the original's result is returned, so the step completes;
  - the original never started (the wrapper's pre-call code failed): the record is
    marked failed and the original is called now.

  A failed record turns into a pass-through for the rest of the process. In strict mode
  the failure is raised as :class:`~ucm_patch.errors.PatchFailed` instead.

Cost on the active path: the shim's frame, and the ``args`` tuple the wrapper contract
needs (from CPython's small-tuple free list); no bound method is allocated (a method's
instance is parked in the cell for the call instead of binding the shim). A trampoline
runs the guard's logic inline (:func:`make_recover` is the shared ``except`` branch).
The cell is per record and not per thread: vLLM runs a worker's forward pass on one
thread, and a layer's core does not re-enter itself. The guard only applies to plain
functions (every current target); other callables are wrapped without one. ``wrapped``
is not used: a pass-through calls ``original`` with the instance the installer passed
(the trampoline passes the unbound original, wrapt a bound one).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping

from ucm_patch.errors import PatchFailed
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper

IDLE, RUNNING, RETURNED = 0, 1, 2

#: Set on an exception raised by the host's own code that a wrapper runs instead of the
#: original (:func:`host_raised`).
HOST_ERROR = "_ucm_patch_host_error"


def host_raised(exc: BaseException) -> BaseException:
    """Mark ``exc`` as the host's own error although the original never ran: a wrapper
    that runs a copy of the host's code (compiled from its source with one line changed)
    re-raises what that code raised as it is, and the guard propagates it unchanged, as
    it does the original's own error; without the mark it would call the original again
    after the copy had changed the host's state halfway."""
    try:
        setattr(exc, HOST_ERROR, True)
    except AttributeError:  # an exception type without a __dict__: counted as ours
        pass
    return exc


class CallCell:
    """Per-record call state shared by the shim and the guard."""

    __slots__ = ("broken", "instance", "result", "state")

    def __init__(self) -> None:
        self.state = IDLE
        self.result: Any = None
        self.broken = False
        self.instance: Any = None  # the bound instance while a method call is guarded


def guardable(original: Any) -> bool:
    """Only a real function: wrapt proxies pass ``isinstance`` checks for functions, and a
    copied, already-wrapped method called through the shim would lose its instance."""
    return type(original) is types.FunctionType


def make_shim(
    original: Callable[..., Any], cell: CallCell, method: bool = False
) -> Callable[..., Any]:
    """A callable standing in for ``original`` that records the call's progress.

    ``method``: the shim stands for ``original`` bound to ``cell.instance`` (set by the
    guard for the duration of the call), so no bound method is allocated per call.
    """

    if method:

        @functools.wraps(original)
        def shim(*args: Any, **kwargs: Any) -> Any:
            cell.state = RUNNING
            result = original(cell.instance, *args, **kwargs)
            cell.result = result
            cell.state = RETURNED
            return result

    else:

        @functools.wraps(original)
        def shim(*args: Any, **kwargs: Any) -> Any:
            cell.state = RUNNING
            result = original(*args, **kwargs)
            cell.result = result
            cell.state = RETURNED
            return result

    return shim


def make_enabled(cell: CallCell, skip_when: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """wrapt's ``enabled`` for a guarded record: False sends the call straight to the
    original. None (no check at all) when the record has no ``skip_when``: the guard then
    handles a broken record itself."""
    if skip_when is None:
        return None
    # A predicate may offer a frame-free equivalent (layerwise.idle does): a broken record
    # is then caught by the guard itself instead of here.
    factory = getattr(skip_when, "enabled_callable", None)
    fast = factory() if factory is not None else None
    if fast is not None:
        return fast

    def enabled() -> bool:
        return not (cell.broken or skip_when())

    return enabled


def make_recover(
    cell: CallCell,
    original: Callable[..., Any],
    on_failure: Callable[[BaseException], None],
    strict: Callable[[], bool],
) -> Callable[[Exception, Any, tuple[Any, ...], Mapping[str, Any]], Any]:
    """The guard's ``except`` branch, shared by :func:`make_guard` and the trampolines.

    Call it from inside the ``except`` block that caught ``exc`` (its bare ``raise``
    re-raises the exception being handled, traceback intact). The cell says whose
    exception it is; see the module docstring for the three cases.
    """

    call_original = original_caller(original)

    def recover(
        exc: Exception, instance: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> Any:
        state, result = cell.state, cell.result
        cell.result = cell.instance = None
        if state == RUNNING or getattr(exc, HOST_ERROR, False):
            raise  # the original itself failed (or the host's code a wrapper ran): not ours
        cell.broken = True
        on_failure(exc)
        if strict():
            raise PatchFailed(f"wrapper raised at call time: {exc!r}") from exc
        if state == RETURNED:
            return result
        return call_original(instance, args, kwargs)

    return recover


def original_caller(
    original: Callable[..., Any],
) -> Callable[[Any, tuple[Any, ...], Mapping[str, Any]], Any]:
    """Call ``original`` the way a wrapper call arrived: ``(instance, args, kwargs)`` with
    the instance, when there is one, in front (the trampoline hands the guard the unbound
    original, wrapt a bound one: this serves both)."""

    def call_original(instance: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        if instance is None:
            return original(*args, **kwargs)
        return original(instance, *args, **kwargs)

    return call_original


def make_guard(
    wrapper: Wrapper,
    cell: CallCell,
    original: Callable[..., Any],
    on_failure: Callable[[BaseException], None],
    strict: Callable[[], bool],
) -> Wrapper:
    """The wrapt wrapper actually installed: ``wrapper`` plus failure isolation.

    The patch's wrapper gets a shim in place of the original, bound as wrapt binds
    ``wrapped``. Once the record is broken a call goes straight to the original.
    """
    function_shim = make_shim(original, cell)
    method_shim = make_shim(original, cell, method=True)
    recover = make_recover(cell, original, on_failure, strict)
    call_original = original_caller(original)

    def guard(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> Any:
        if cell.broken:
            return call_original(instance, args, kwargs)
        if instance is None:
            tracked = function_shim
        else:
            tracked = method_shim
            cell.instance = instance
        cell.state = IDLE
        try:
            out = wrapper(tracked, instance, args, kwargs)
        except Exception as exc:
            return recover(exc, instance, args, kwargs)
        cell.result = cell.instance = None  # do not keep the host's objects alive
        return out

    return guard
