"""``TYPE_CHECKING`` for every ucm_patch module, without importing :mod:`typing`.

``import ucm_patch`` runs in every vLLM process before vLLM does, so it imports as little as
it can; :mod:`typing` alone is a measurable share of that start-up. Type checkers treat any
name spelled ``TYPE_CHECKING`` as the constant of the same name in :mod:`typing`, so::

    from ucm_patch.typing_guard import TYPE_CHECKING

    if TYPE_CHECKING:
        from collections.abc import Callable

keeps annotation-only imports out of the run time, and this is the one place that says why.
"""

TYPE_CHECKING = False
