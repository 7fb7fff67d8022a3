"""``gdn_layerwise`` on vLLM-Ascend: layerwise wait/save for GDN (Qwen3-Next / Qwen3.5) layers.

Same logical patch as :mod:`ucm_patch.patches.vllm.gdn_layerwise` (one toggle switches GDN
layerwise off everywhere), different targets: vLLM-Ascend replaces vLLM's GDN core with its
own, so vLLM's wrapper is either overwritten or never reached on an NPU.

=============  ===========================================================================
vLLM-Ascend    the GDN core that runs (wrapped here)
=============  ===========================================================================
0.11           ``models.qwen3_next.CustomQwen3NextGatedDeltaNet._forward`` (its own model
               class, registered through the model plugin; overrides vLLM's ``_forward``)
0.13 - 0.18    ``patch.worker.patch_qwen3_next`` assigns
               ``AscendQwen3Next_GatedDeltaNet._forward_core`` onto vLLM's
               ``Qwen3NextGatedDeltaNet`` during ``NPUWorker.__init__`` (after vLLM's
               plugins ran). Wrapped *through the patch module*, whose post-import hook runs
               after that assignment, so the wrapper survives it. 0.17 - 0.18 also copy
               ``AscendQwen3_5GatedDeltaNet._forward_core`` onto ``Qwen3_5GatedDeltaNet``.
0.19 - 0.25    ``ops.gdn.AscendGatedDeltaNetAttention._forward_core``: the layer *is* that
               class (``CustomOp.register_oot``); on 310P ``_310p.ops.fla.gdn_310.
               AscendGatedDeltaNetAttention310``.
0.21 - 0.25    also copied by ``patch.worker.patch_qwen3_5`` onto ``_GDN_PATCH_TARGET``
               (vLLM's ``GatedDeltaNetAttention`` with vLLM 0.21, ``QwenGatedDeltaNetAttention``
               from 0.22) and, on 310P, by ``patch.worker.patch_idex_310``.
=============  ===========================================================================

The anonymous call. From 0.17 vLLM-Ascend calls ``maybe_save_kv_layer_to_connector("", [])``
once per GDN layer (vllm-ascend PR #7022: layer counting for the Mooncake layerwise
connector). The core wrapper already saves the layer under its real name with its real
``[conv_state, ssm_state]``, so the ``-anon`` records drop exactly those ``("", [])``
calls in the GDN modules (the source check ``anonymous_only`` proves no other call goes
through those bindings): the connector sees one save per GDN layer per step. A connector
that counts layers from the anonymous call (Mooncake layerwise) must run with
``gdn_layerwise`` off. Under torch.compile the anonymous call sits in the traced
``forward`` (up to v0.25) and Dynamo inlines the original function, bypassing any wrapper;
the core wrapper itself runs eagerly inside the opaque GDN op in every mode.

Native calls. vLLM-Ascend main waits in the GDN core itself (#12711: ``_forward_core``
calls ``wait_for_kv_layer_from_connector(self.prefix)``; not in any release up to
v0.25.1rc1 nor in main at the pinned commit of the verification matrix). The core records
name their hooks, so at apply time :mod:`ucm_patch.native` reads the core (and the
``forward`` that calls it): a native wait leaves the wrapper adding the save only, a native
wait and a *named* save make the record stand down (state ``native``); the anonymous save
is never counted as one.

No double save with vLLM's own ``gdn_layerwise`` records: on an NPU host they are in range
too, but vLLM-Ascend overwrites (0.13 - 0.18, 0.21+) or overrides (0.11, 0.19 - 0.20) the
method they wrap. When both wrappers end up nested on the same method (ucm_patch activated
after vLLM-Ascend's worker patch ran, or a copy of an already wrapped method), the inner
one finds the layer inside its core (:func:`ucm_patch.hooks.layerwise.layer_bracket`) and
steps aside.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm_ascend import _ascend_compat as compat
from ucm_patch.patches.vllm_ascend import source_names as c
from ucm_patch.records import HOOKS, PatchRecord, records_from_rows
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper

NAME = "gdn_layerwise"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = (
    "gdn_layerwise on vLLM-Ascend: layerwise wait/save on the GDN core vLLM-Ascend really "
    "runs, one save per GDN layer per step (the anonymous layer-counting save dropped)."
)

WHY = (
    "vLLM-Ascend runs its own GDN core (copied onto or subclassing vLLM's GDN layer), and "
    "neither it nor vLLM calls the KV connector with the GDN layer's name and conv/SSM "
    "state, so a layerwise connector cannot load or save Qwen3-Next / Qwen3.5 linear "
    "attention layers on an NPU. The wrapper adds wait_for_layer_load before and "
    "save_kv_layer(prefix, [conv_state, ssm_state], metadata) after the core that runs."
)
WHY_ANON = (
    "vLLM-Ascend 0.17+ calls maybe_save_kv_layer_to_connector('', []) once per GDN layer "
    "(a nameless, cache-less save for layer counting). With the core wrapper saving the "
    "layer under its real name, that call would be a second save for the same layer: "
    "this filter drops exactly the ('', ...) calls of the GDN module's binding."
)
REMOVAL = (
    "Delete when vLLM-Ascend's GDN op calls wait_for_kv_layer_from_connector(self.prefix) "
    "and saves with the layer's name and cache itself (main has the wait, #12711, and moved "
    "the anonymous save into _forward_core, #11917; no release up to v0.25.1rc1 does both)."
)

CORE_PARAMS = ("self", "mixed_qkv", "b", "a", "core_attn_out")
FORWARD_011_PARAMS = ("self", "hidden_states", "output")

_MODELS = "vllm_ascend.models.qwen3_next"
_PQN = "vllm_ascend.patch.worker.patch_qwen3_next"
_PQ35 = "vllm_ascend.patch.worker.patch_qwen3_5"
_OPS = "vllm_ascend.ops.gdn"
_310 = "vllm_ascend._310p.ops.fla.gdn_310"
_IDEX = "vllm_ascend.patch.worker.patch_idex_310"
_ASCEND_CORE = f"{_OPS}:AscendGatedDeltaNetAttention._forward_core"
_ASCEND_310_CORE = f"{_310}:AscendGatedDeltaNetAttention310._forward_core"


def make_core_wrapper(kv_mode: str, hooks: tuple[str, ...] = HOOKS) -> Wrapper:
    """Wrapper for a GDN core method; the layer is the bound instance, its name ``prefix``.

    ``kv_mode`` picks the KV cache the way the era's core does (see _ascend_compat). An
    unbound copy of the method (vLLM-Ascend copies methods between classes) gets the layer
    as its first argument: the bracket takes it from there. ``hooks``: the calls to add;
    the registry passes only ``("save",)`` where the core already waits itself (vLLM-Ascend
    main, #12711), found by :mod:`ucm_patch.native` at apply time.
    """
    site = layerwise.LayerSite(
        name_attr="prefix", stage=compat.gdn_kv_stage(kv_mode), **layerwise.site_for_hooks(hooks)
    )
    return layerwise.layer_bracket(site)


def make_anonymous_filter() -> Wrapper:
    """Wrapper for a GDN module's ``maybe_save_kv_layer_to_connector`` binding.

    Drops ``("", ...)`` calls (the layer-counting save); anything else passes through.
    """
    argument = layerwise.argument

    def drop_anonymous_gdn_save(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if argument(args, kwargs, 0, "layer_name", None) == "":
            return None
        return wrapped(*args, **kwargs)

    return drop_anonymous_gdn_save


def _copy_checks(module: str, vllm_cls: str, ascend_cls: str, kv_mode: str) -> tuple[c.Check, ...]:
    """What a core vLLM-Ascend copies onto vLLM's class inside ``module`` relies on."""
    code = f"{module}:{ascend_cls}._forward_core"
    return (
        c.signature(code, CORE_PARAMS),
        c.assigned(module, f"{vllm_cls}._forward_core", f"{ascend_cls}._forward_core"),
        c.local(code, "self_kv_cache", compat.KV_CACHE_EXPR[kv_mode]),
    )


_DIRECT = compat.KV_DIRECT
_VE = compat.KV_VIRTUAL_ENGINE
_VE_018 = compat.KV_VIRTUAL_ENGINE_IF_VLLM_018
# ``supersedes``: on an NPU, vLLM-Ascend overwrites (or swaps out the class of) the method
# vLLM's own GDN record would wrap, so those records are skipped where an Ascend era is in
# range (reported as "superseded by ..." rather than a misleading "applied").
_CORE_RECORDS = records_from_rows(
    NAME,
    "vllm-ascend",
    "era target requires make_wrapper upstream expect",
    (
        (
            "ascend-0.11",
            f"{_MODELS}:CustomQwen3NextGatedDeltaNet._forward",
            ">=0.11,<0.12",
            functools.partial(make_core_wrapper, _VE),
            "vLLM-Ascend 0.11.0: its Qwen3-Next model (registered by the model plugin) uses "
            "CustomQwen3NextGatedDeltaNet, whose _forward overrides vLLM's; op "
            "vllm::gdn_attention calls it eagerly.",
            (
                c.signature(f"{_MODELS}:CustomQwen3NextGatedDeltaNet._forward", FORWARD_011_PARAMS),
                c.local(
                    f"{_MODELS}:CustomQwen3NextGatedDeltaNet._forward",
                    "self_kv_cache",
                    compat.KV_CACHE_EXPR[_VE],
                ),
            ),
            {"supersedes": ("gdn_layerwise@vllm-0.10",)},
        ),
        (
            "ascend-0.13",
            f"{_PQN}:Qwen3NextGatedDeltaNet._forward_core",
            ">=0.13,<0.18",
            functools.partial(make_core_wrapper, _VE),
            "vLLM-Ascend 0.13.0rc1-0.17: patch_qwen3_next.py assigns "
            "AscendQwen3Next_GatedDeltaNet._forward_core onto vLLM's Qwen3NextGatedDeltaNet in "
            "NPUWorker.__init__ (after general plugins); op vllm::gdn_attention_core calls it.",
            _copy_checks(_PQN, "Qwen3NextGatedDeltaNet", "AscendQwen3Next_GatedDeltaNet", _VE),
            {"supersedes": ("gdn_layerwise@vllm-0.12",)},
        ),
        (
            "ascend-0.18",
            f"{_PQN}:Qwen3NextGatedDeltaNet._forward_core",
            ">=0.18,<0.19",
            functools.partial(make_core_wrapper, _VE_018),
            "vLLM-Ascend 0.18: same copy; the core indexes the KV cache with virtual_engine only "
            'when vllm_version_is("0.18.0"), else 0.',
            _copy_checks(_PQN, "Qwen3NextGatedDeltaNet", "AscendQwen3Next_GatedDeltaNet", _VE_018),
            {"supersedes": ("gdn_layerwise@vllm-0.12",)},
        ),
        (
            "ascend-0.17-qwen3_5",
            f"{_PQ35}:Qwen3_5GatedDeltaNet._forward_core",
            ">=0.17,<0.18",
            functools.partial(make_core_wrapper, _VE),
            "vLLM-Ascend 0.17.0rc1: patch_qwen3_5.py assigns AscendQwen3_5GatedDeltaNet."
            "_forward_core onto vLLM's Qwen3_5GatedDeltaNet (Qwen3.5).",
            _copy_checks(_PQ35, "Qwen3_5GatedDeltaNet", "AscendQwen3_5GatedDeltaNet", _VE),
        ),
        (
            "ascend-0.18-qwen3_5",
            f"{_PQ35}:Qwen3_5GatedDeltaNet._forward_core",
            ">=0.18,<0.19",
            functools.partial(make_core_wrapper, _VE_018),
            "vLLM-Ascend 0.18: same Qwen3.5 copy with the 0.18 KV-cache index.",
            _copy_checks(_PQ35, "Qwen3_5GatedDeltaNet", "AscendQwen3_5GatedDeltaNet", _VE_018),
        ),
        (
            "ascend-0.19",
            _ASCEND_CORE,
            ">=0.19,<0.26",
            functools.partial(make_core_wrapper, _DIRECT),
            "vLLM-Ascend 0.19.1rc1-0.25.1rc1: ops/gdn.py AscendGatedDeltaNetAttention replaces "
            "vLLM's GatedDeltaNetAttention via CustomOp.register_oot, so instances are this "
            "class and vLLM's _forward_core is never reached.",
            (
                c.signature(_ASCEND_CORE, CORE_PARAMS),
                c.local(_ASCEND_CORE, "self_kv_cache", compat.KV_CACHE_EXPR[_DIRECT]),
            ),
            {
                "supersedes": ("gdn_layerwise@vllm-0.19", "gdn_layerwise@vllm-0.21-rocm"),
                "callers": (f"{_OPS}:AscendGatedDeltaNetAttention.forward",),
            },
        ),
        (
            "ascend-0.19-310p",
            _ASCEND_310_CORE,
            ">=0.19,<0.26",
            functools.partial(make_core_wrapper, _DIRECT),
            "vLLM-Ascend 0.19.1rc1-0.25.1rc1 on 310P: register_oot uses "
            "AscendGatedDeltaNetAttention310 (_310p/ops/fla/gdn_310.py) instead.",
            (
                c.signature(_ASCEND_310_CORE, CORE_PARAMS),
                c.local(_ASCEND_310_CORE, "self_kv_cache", compat.KV_CACHE_EXPR[_DIRECT]),
            ),
            {"callers": (f"{_310}:AscendGatedDeltaNetAttention310.forward",)},
        ),
        (
            "ascend-0.21",
            f"{_PQ35}:_GDN_PATCH_TARGET._forward_core",
            ">=0.21,<0.26",
            functools.partial(make_core_wrapper, _DIRECT),
            "vLLM-Ascend 0.21.0rc1-0.25.1rc1: patch_qwen3_5.py copies "
            "AscendGatedDeltaNetAttention's (310P: AscendGatedDeltaNetAttention310's) "
            "_forward_core onto _GDN_PATCH_TARGET = vLLM's GatedDeltaNetAttention (vLLM 0.21) "
            "or QwenGatedDeltaNetAttention (0.22+), which Qwen3.5 / Qwen3-Next instantiate.",
            (
                c.signature(_ASCEND_CORE, CORE_PARAMS),
                c.signature(_ASCEND_310_CORE, CORE_PARAMS),
                c.assigned(
                    _PQ35,
                    "_GDN_PATCH_TARGET._forward_core",
                    "AscendGatedDeltaNetAttention._forward_core",
                ),
                c.assigned(
                    _PQ35,
                    "_GDN_PATCH_TARGET._forward_core",
                    "AscendGatedDeltaNetAttention310._forward_core",
                ),
            ),
            {
                "supersedes": ("gdn_layerwise@vllm-0.22",),
                "callers": (f"{_PQ35}:_GDN_PATCH_TARGET.forward",),
            },
        ),
        (
            "ascend-0.21-310p-idex",
            f"{_IDEX}:GatedDeltaNetAttention._forward_core",
            ">=0.21,<0.22",
            functools.partial(make_core_wrapper, _DIRECT),
            "vLLM-Ascend 0.21.0rc1 on 310P: patch_idex_310.py copies "
            "AscendGatedDeltaNetAttention310._forward_core onto vLLM's GatedDeltaNetAttention "
            'when vllm_version_is("0.21.0") (absent from the module otherwise).',
            (
                c.signature(_ASCEND_310_CORE, CORE_PARAMS),
                c.assigned(
                    _IDEX,
                    "GatedDeltaNetAttention._forward_core",
                    "AscendGatedDeltaNetAttention310._forward_core",
                ),
            ),
            {"optional": True},
        ),
        (
            "ascend-0.21-310p-idex-qwen",
            f"{_IDEX}:QwenGatedDeltaNetAttention._forward_core",
            ">=0.21,<0.26",
            functools.partial(make_core_wrapper, _DIRECT),
            "vLLM-Ascend 0.21.0rc1-0.25.1rc1 on 310P: patch_idex_310.py copies "
            "AscendGatedDeltaNetAttention310._forward_core onto vLLM's QwenGatedDeltaNetAttention "
            "(0.21.0rc1: only when vLLM is not 0.21.0, so the name may be absent there).",
            (
                c.signature(_ASCEND_310_CORE, CORE_PARAMS),
                c.assigned(
                    _IDEX,
                    "QwenGatedDeltaNetAttention._forward_core",
                    "AscendGatedDeltaNetAttention310._forward_core",
                ),
            ),
            {"optional": True},
        ),
    ),
    hooks=HOOKS,
    why=WHY,
    removal=REMOVAL,
)

# (era, module, requires, upstream) of every GDN module making the anonymous save
_ANONYMOUS: tuple[tuple[str, str, str, str], ...] = (
    (
        "ascend-0.17-anon",
        _PQN,
        ">=0.17,<0.19",
        "vLLM-Ascend 0.17.0rc1-0.18 (PR #7022): AscendQwen3Next_GatedDeltaNet.forward calls "
        'maybe_save_kv_layer_to_connector("", []) after the GDN op.',
    ),
    (
        "ascend-0.17-anon-qwen3_5",
        _PQ35,
        ">=0.17,<0.19",
        "vLLM-Ascend 0.17.0rc1-0.18: the Qwen3.5 GDN (patch_qwen3_5.py) makes the same "
        "anonymous call.",
    ),
    (
        "ascend-0.19-anon",
        _OPS,
        ">=0.19,<0.26",
        "vLLM-Ascend 0.19.1rc1-0.25.1rc1: AscendGatedDeltaNetAttention.forward (ops/gdn.py; "
        "0.23.0.post1 line 137) makes the anonymous call.",
    ),
    (
        "ascend-0.19-anon-310p",
        _310,
        ">=0.19,<0.26",
        "vLLM-Ascend 0.19.1rc1-0.25.1rc1: AscendGatedDeltaNetAttention310 (gdn_310.py; "
        "0.23.0.post1 line 429) makes the anonymous call.",
    ),
)

RECORDS: tuple[PatchRecord, ...] = _CORE_RECORDS + records_from_rows(
    NAME,
    "vllm-ascend",
    "era target requires upstream expect",
    (
        (
            era,
            f"{module}:{c.SAVE}",
            requires,
            upstream,
            (
                c.binding(module, c.SAVE),
                c.signature(f"{c.UTILS}:{c.SAVE}", c.SAVE_PARAMS),
                c.anonymous_only(module, c.SAVE),
            ),
        )
        for era, module, requires, upstream in _ANONYMOUS
    ),
    make_wrapper=make_anonymous_filter,
    why=WHY_ANON,
    removal=REMOVAL,
)
