"""``ascend_hook_bindings``: vLLM's connector gates on every by-name binding of the hook functions.

Why: vLLM-Ascend's ``wait_for_kv_layer_from_connector(layer_name)`` and
``maybe_save_kv_layer_to_connector(layer_name, kv_cache_layer)`` (``attention/utils.py``)
call the connector whenever a KV-transfer group and attention metadata exist. vLLM's
``maybe_transfer_kv_layer`` decorator, which hooks the very same steps for the layers vLLM
handles, also skips them when ``not connector.has_connector_metadata()``; connectors rely
on that (UCM's connectors assert their metadata is bound, and UCM patched exactly this gate
into vLLM-Ascend 0.11). Without it an MLA / SFA / DSA layer gets wait/save calls in steps
where an attention or GDN layer of the same model gets none.

Where: the functions are imported *by name* into every consumer (``from
vllm_ascend.attention.utils import maybe_save_kv_layer_to_connector``), so patching the
defining module changes nothing; each consumer's binding is wrapped, looked up at call time
by the consumer. ``scripts/verify_ascend_targets.py`` checks, for every covered version,
that the set of by-name bindings in the real source equals the set of records in range
(a new consumer upstream fails the check) and that nothing calls them through the module.

=============  ============================================================================
vLLM-Ascend    consumers binding the hooks by name
=============  ============================================================================
0.11           ``attention.attention_v1``, ``attention.mla_v1``
0.13 - 0.16    ``attention.mla_v1``, ``attention.sfa_v1``
0.17 - 0.18    + GDN: ``patch.worker.patch_qwen3_next``, ``patch.worker.patch_qwen3_5`` (save)
0.19 - 0.22    ``mla_v1``, ``sfa_v1``, GDN ``ops.gdn``, ``_310p.ops.fla.gdn_310`` (save)
0.23 - 0.25    + ``attention.dsa_v1``, ``attention.context_parallel.dsa_cp``
=============  ============================================================================

The wrapper only adds the gate; the call, its arguments (vLLM-Ascend passes the whole
metadata dict to ``save_kv_layer``) and the ``("", [])`` GDN counting call are left as they
are (``gdn_layerwise`` handles the latter).
"""

from __future__ import annotations

from collections.abc import Callable

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm_ascend import source_names as c
from ucm_patch.records import PatchRecord, records_from_rows
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper

NAME = "ascend_hook_bindings"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = (
    "vLLM's has_connector_metadata() gate on every module's by-name binding of "
    "vLLM-Ascend's wait/save hook functions."
)

WHY = (
    "vLLM-Ascend's wait/save hook functions skip the connector only when there is no "
    "KV-transfer group or no attention metadata; vLLM's maybe_transfer_kv_layer also skips "
    "it when the connector has no metadata for the step. The wrapper adds that gate, on the "
    "binding each consumer imported by name."
)
REMOVAL = (
    "Delete when vllm_ascend/attention/utils.py gates on connector.has_connector_metadata() "
    "(not the case up to 0.25.1rc1)."
)
WAIT_PARAMS = c.WAIT_PARAMS
SAVE_PARAMS = c.SAVE_PARAMS


def make_gate() -> Wrapper:
    """Wrapper for a ``wait_for_kv_layer_from_connector`` / ``maybe_save_...`` binding."""
    has_metadata = layerwise.has_metadata_check()
    active_connector = layerwise.connector_getter()

    def connector_metadata_gate(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        connector = active_connector()
        if connector is not None and not has_metadata(connector):
            return None
        return wrapped(*args, **kwargs)

    return connector_metadata_gate


_ATTN = "vllm_ascend.attention"
# (module, hook name, requires, upstream) for every by-name binding, per the source check.
_BINDINGS: tuple[tuple[str, str, str, str], ...] = (
    (f"{_ATTN}.attention_v1", c.WAIT, ">=0.11,<0.12", "unified_ascend_attention_with_output"),
    (f"{_ATTN}.attention_v1", c.SAVE, ">=0.11,<0.12", "unified_ascend_attention_with_output"),
    (f"{_ATTN}.mla_v1", c.WAIT, ">=0.11,<0.26", "AscendMLAImpl (_mla_preprocess / forward)"),
    (f"{_ATTN}.mla_v1", c.SAVE, ">=0.11,<0.26", "AscendMLAImpl.forward"),
    (f"{_ATTN}.sfa_v1", c.WAIT, ">=0.13,<0.26", "AscendSFAImpl.forward"),
    (f"{_ATTN}.sfa_v1", c.SAVE, ">=0.13,<0.26", "AscendSFAImpl.forward"),
    ("vllm_ascend.patch.worker.patch_qwen3_next", c.SAVE, ">=0.17,<0.19", "GDN forward"),
    ("vllm_ascend.patch.worker.patch_qwen3_5", c.SAVE, ">=0.17,<0.19", "Qwen3.5 GDN"),
    ("vllm_ascend.ops.gdn", c.SAVE, ">=0.19,<0.26", "AscendGatedDeltaNetAttention.forward"),
    ("vllm_ascend._310p.ops.fla.gdn_310", c.SAVE, ">=0.19,<0.26", "310P GDN"),
    (f"{_ATTN}.dsa_v1", c.WAIT, ">=0.23,<0.26", "AscendDSAImpl.forward"),
    (f"{_ATTN}.dsa_v1", c.SAVE, ">=0.23,<0.26", "AscendDSAImpl.forward"),
    (f"{_ATTN}.context_parallel.dsa_cp", c.WAIT, ">=0.23,<0.26", "DSA context parallel forward"),
    (f"{_ATTN}.context_parallel.dsa_cp", c.SAVE, ">=0.23,<0.26", "DSA context parallel forward"),
)

_SHORT = {
    "vllm_ascend.patch.worker.patch_qwen3_next": "qwen3_next",
    "vllm_ascend.patch.worker.patch_qwen3_5": "qwen3_5",
    "vllm_ascend.ops.gdn": "gdn",
    "vllm_ascend._310p.ops.fla.gdn_310": "gdn_310",
    f"{_ATTN}.context_parallel.dsa_cp": "dsa_cp",
}


def _era(module: str, hook: str, requires: str) -> str:
    first = requires.split(",")[0].lstrip(">=")
    short = _SHORT.get(module, module.rsplit(".", 1)[-1].removesuffix("_v1"))
    return f"ascend-{first}-{short}-{'wait' if hook == c.WAIT else 'save'}"


RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm-ascend",
    "era target requires upstream expect",
    (
        (
            _era(module, hook, requires),
            f"{module}:{hook}",
            requires,
            f"vLLM-Ascend {requires}: {module} imports {hook} by name from "
            f"vllm_ascend.attention.utils and calls it from {caller}.",
            (
                c.binding(module, hook),
                c.signature(f"{c.UTILS}:{hook}", WAIT_PARAMS if hook == c.WAIT else SAVE_PARAMS),
            ),
        )
        for module, hook, requires, caller in _BINDINGS
    ),
    make_wrapper=make_gate,
    why=WHY,
    removal=REMOVAL,
)
