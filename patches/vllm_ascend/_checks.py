"""What each vLLM-Ascend record relies on in the vLLM-Ascend source, as checkable data.

Every record in this package has an entry in its module's ``EXPECT`` mapping (record id ->
tuple of :class:`Check`). ``scripts/verify_ascend_targets.py`` reads the real source of a
vLLM-Ascend release or rc tag with ``ast`` (never importing it) and evaluates each check;
the behaviour tests evaluate the same checks on the stand-in packages in tests/standins/,
so a stand-in cannot drift from the source it imitates.

The wrappers take their argument positions from the same ``params`` tuples the checks
verify (see reshape_cache_event.py), so "the signature was checked" and "the wrapper
reads the right argument" are one fact, not two.

Kinds (``Check.kind``):

``signature``      ``(code, params)``: function/method ``code`` ("module:Qual.name") exists
                   and its parameter names are exactly ``params``.
``assigned``       ``(module, target, value)``: a module-level statement (possibly under
                   ``if``/``else``) ``target = value``, e.g. vLLM-Ascend copying its method
                   onto vLLM's class: the code that runs at the record's target.
``local``          ``(code, name, expr)``: inside ``code``, ``name = expr`` (the expression
                   picking the GDN layer's KV cache, which the wrapper must mirror).
``binding``        ``(module, name)``: ``module`` imports ``name`` by name from
                   ``vllm_ascend.attention.utils`` at module level.
``anonymous_only`` ``(module, name)``: every call of ``name`` in ``module`` is ``name("", [])``
                   (the GDN layer-counting call; a filter may drop exactly those).
``marks_write``    ``(code,)``: ``code`` (or a ``self.`` method it calls) writes the KV cache:
                   it records ``reshape_cache_event``, calls ``notify_kv_cache_written`` or
                   calls one of :data:`KV_WRITE_OPS`. An event recorded when ``code``
                   returns therefore follows the write.
``mlapo_no_wait``  ``(code,)``: SFA ``forward`` has a branch on ``enable_mlapo`` with no
                   ``wait_for_kv_layer_from_connector`` call while another branch has one.
"""

from __future__ import annotations

from collections import namedtuple  # not typing.NamedTuple: typing costs ~7 ms at start

UTILS = "vllm_ascend.attention.utils"
WAIT = "wait_for_kv_layer_from_connector"
SAVE = "maybe_save_kv_layer_to_connector"
NOTIFY = "notify_kv_cache_written"
HOOK_NAMES = (WAIT, SAVE, NOTIFY)
# torch_npu / vLLM-Ascend calls that write the paged KV cache (attribute or plain calls).
KV_WRITE_OPS = (
    "_npu_reshape_and_cache",
    "npu_scatter_pa_kv_cache",
    "npu_scatter_nd_update_",
    "reshape_and_cache",
)


class Check(namedtuple("Check", ("kind", "args"))):
    """One fact a record needs from the vLLM-Ascend source (see the module docstring)."""

    __slots__ = ()
    kind: str
    args: tuple[str | tuple[str, ...], ...]

    def __str__(self) -> str:
        return f"{self.kind}{self.args!r}"


def signature(code: str, params: tuple[str, ...]) -> Check:
    return Check("signature", (code, params))


def assigned(module: str, target: str, value: str) -> Check:
    return Check("assigned", (module, target, value))


def local(code: str, name: str, expr: str) -> Check:
    return Check("local", (code, name, expr))


def binding(module: str, name: str) -> Check:
    return Check("binding", (module, name))


def anonymous_only(module: str, name: str) -> Check:
    return Check("anonymous_only", (module, name))


def marks_write(code: str) -> Check:
    return Check("marks_write", (code,))


def mlapo_no_wait(code: str) -> Check:
    return Check("mlapo_no_wait", (code,))


def arg_index(params: tuple[str, ...], name: str) -> int:
    """Position of ``name`` among a method's call arguments (``params`` minus ``self``).

    Raises ValueError naming the parameter list when ``name`` is not in it.
    """
    call_params = params[1:] if params and params[0] == "self" else params
    if name not in call_params:
        raise ValueError(f"parameter {name!r} not in {params!r}")
    return call_params.index(name)
