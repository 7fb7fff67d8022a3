"""The pure parts of scripts/gpu_check.py (``make gpu-check``; it needs CUDA vLLM to run).

The model configs load in this vLLM (the layer names it derives are vLLM's own), the
prompts share whole blocks, and the verdict fails on each wrong answer it exists to catch.
"""

from __future__ import annotations

import json

import pytest

from tests.support import load_script

gc = load_script("gpu_check")


def _runs(hit: int, want_tokens: bool = True, gdn_plain: int = 0) -> dict:
    counts_on = {"gdn": {"waits": 6, "saves": 6}, "attention": {"waits": 2, "saves": 2}}
    counts_off = {"gdn": {"waits": gdn_plain, "saves": 0}, "attention": {"waits": 2, "saves": 2}}
    ref = {"tokens": [1, 2, 3, 4], "logprobs": [-1.0] * 4, "seconds": 0.5}
    hit_run = {"tokens": [1, 2, 3, 4] if want_tokens else [1, 2, 3, 5], "logprobs": [-1.0] * 4}
    return {
        "hooks_patched": {"counts": counts_on},
        "hooks_plain": {"counts": counts_off},
        "dump": {
            "recompute": ref,
            "recompute_ttft": {"seconds": 0.5},
            "own_cache": {"seconds": 0.1},
            "cold": {"seconds": 0.5},
            "dump_bytes": 4 << 30,
            "dump_seconds": 0.8,
            "dump_work_s": 0.4,
        },
        "load": {
            "block_size": 16,
            "shared": 6544,
            "hit_ttft": {"seconds": 0.15, "num_cached_tokens": hit},
            "hit": hit_run,
        },
        "offload": {"hit_ttft": {"seconds": 0.2}},
    }


def test_a_right_run_passes_and_each_wrong_answer_fails():
    config = gc.MODELS["hybrid"]
    assert gc.judge("hybrid", config, _runs(6544))["ok"]
    assert not gc.judge("hybrid", config, _runs(6528))["ok"]  # one block short
    assert not gc.judge("hybrid", config, _runs(6544, want_tokens=False))["ok"]
    assert not gc.judge("hybrid", config, _runs(6544, gdn_plain=3))["ok"]  # GDN hooked unpatched
    col = gc.judge("hybrid", config, _runs(6544))
    # bandwidth: bytes over the workers' own seconds (0.4) against bytes over prefill (0.5)
    assert col["dump_vs_production"] == pytest.approx(0.5 / 0.4)
    assert col["dump_tail_ms"] == pytest.approx(300)
    assert "| ok | True |" in gc.render([col])


def test_refusal_passes_only_with_nothing_stored_and_no_hit():
    runs = _runs(0)
    runs["dump"]["refused"] = "hybrid prefix hits need vLLM >= 0.29"
    runs["dump"]["dump_bytes"] = 0
    assert gc.judge("hybrid", gc.MODELS["hybrid"], runs)["ok"]
    runs["dump"]["dump_bytes"] = 1
    assert not gc.judge("hybrid", gc.MODELS["hybrid"], runs)["ok"]


def test_prompts_share_whole_blocks():
    p, q, r, shared = gc.prompts(16)
    assert len(p) == len(q) == len(r) == gc.PROMPT_LEN and shared % 16 == 0
    assert p[:shared] == q[:shared] == r[:shared]
    # R's tail is its own: a store holding P and Q hits R's shared prefix, no more
    assert len({tuple(p[shared:]), tuple(q[shared:]), tuple(r[shared:])}) == 3
    assert r[shared] not in (p[shared], q[shared])


def test_a_failed_run_is_one_line_of_the_table():
    runs = _runs(6544)
    runs["load"] = {"error": "Traceback ...\n  File x\nRuntimeError: CUDA error: a | b\n"}
    runs["hooks_plain"] = {"error": "Capturing CUDA graphs 3/3\n" + gc.KILLED}
    col = gc.judge("hybrid", gc.MODELS["hybrid"], runs)
    assert col["hit"] == "error: RuntimeError: CUDA error: a / b" and not col["ok"]
    assert col["hooks_plain"] == "killed at the deadline"
    table = gc.render([col])
    assert all(line.count("|") == 3 for line in table.splitlines())


def test_a_partial_run_is_judged_not_run():
    runs = _runs(6544)
    del runs["load"]
    col = gc.judge("hybrid", gc.MODELS["hybrid"], runs)
    assert col["hit"] == "not run" and not col["ok"]
    runs = {"dump": {"refused": "hybrid prefix hits need vLLM >= 0.29", "dump_bytes": 0}}
    assert gc.judge("hybrid", gc.MODELS["hybrid"], runs)["hit"] == "not run"


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_written_configs_load_in_vllm(tmp_path, name):
    from transformers import AutoConfig

    path = gc.write_model(tmp_path, name)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == gc.MODELS[name]["architectures"]
    kinds = gc.layer_kinds(json.loads((path / "config.json").read_text()))
    assert len(kinds["gdn"]) + len(kinds["attention"]) == config.num_hidden_layers
    if name == "hybrid":
        assert len(kinds["gdn"]) == 3 * len(kinds["attention"])
