"""Every KV-cache write site of vLLM 0.33 is judged for ``kv_ready_event`` (issue #16 item 5).

The sites come from scripts/data/kv_write_sites.json, found in the 0.33 source with ``ast``
by scripts/survey_kv_writes.py (``scripts/verify_targets.py --survey``). A site nobody
decided on, a decision for a site that no longer exists, or a "covered" decision whose
record does not apply to 0.33 in the verification matrix fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import load_script
from tools.verify import vllm as verify_vllm
from ucm_patch.patches.vllm import kv_ready_event

survey = load_script("survey_kv_writes")
DATA = survey.load_data()
SITES = sorted({s["site"] for s in DATA["sites"]})


def test_the_survey_is_of_the_newest_verified_release():
    newest = max(v for d, v in verify_vllm.VERSIONS if d == "vllm")
    assert newest == DATA["version"]
    assert len(SITES) > 20  # the finder found the write sites, not an empty list


@pytest.mark.parametrize("site", SITES)
def test_every_write_site_has_a_decision(site):
    assert survey.decision(site) is not None, (
        f"{site} writes the KV cache and nobody decided whether kv_ready_event covers it: "
        "add it to DECISIONS in scripts/survey_kv_writes.py"
    )


def test_no_decision_is_stale():
    stale = [key for key in survey.DECISIONS if not any(s.startswith(key) for s in SITES)]
    assert stale == []


def test_covered_sites_name_a_record_that_applies_to_the_release():
    facts = json.loads(verify_vllm.DATA.read_text())["versions"][f"vllm=={DATA['version']}"]
    records = {r.id: r for r in kv_ready_event.RECORDS}
    for site in SITES:
        category, why = survey.decision(site)
        if category != survey.COVERED:
            continue
        assert why in records, f"{site}: {why!r} is not a kv_ready_event record"
        status, reason = verify_vllm.verdict(records[why], facts)
        assert status == verify_vllm.APPLIES, (site, why, status, reason)


def test_the_docs_section_is_current():
    assert verify_vllm.read_section(survey.SECTION) == survey.survey_markdown(DATA), (
        "run python scripts/verify_targets.py --survey"
    )


def test_the_finder_sees_nested_and_attribute_calls_only_outside_bindings(tmp_path: Path):
    root = tmp_path / "vllm"
    (root / "layers").mkdir(parents=True)
    (root / "layers" / "attn.py").write_text(
        "def make():\n"
        "    class Impl:\n"
        "        def forward(self, k):\n"
        "            self.do_kv_cache_update(k)\n"
        "    return Impl\n"
        "def reshape_and_cache(x):\n"  # a definition is not a call
        "    return ops.reshape_and_cache_flash(x)\n"
        "def unrelated():\n"
        "    return ops.paged_attention(1)\n"
        "def triton_path(k):\n"
        "    triton_reshape_and_cache_flash_diffkv(k)\n"  # a relative of a primitive
        "    fused_x_qknorm_rope_kv_insert(k)\n"
    )
    (root / "_custom_ops.py").write_text("def f():\n    torch.ops._C.reshape_and_cache(1)\n")
    sites = survey.find_sites(root)
    assert [(s["site"], s["call"]) for s in sites] == [
        ("vllm.layers.attn:make.Impl.forward", "do_kv_cache_update"),
        ("vllm.layers.attn:reshape_and_cache", "reshape_and_cache_flash"),
        ("vllm.layers.attn:triton_path", "triton_reshape_and_cache_flash_diffkv"),
        ("vllm.layers.attn:triton_path", "fused_x_qknorm_rope_kv_insert"),
    ]
