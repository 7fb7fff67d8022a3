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
            "dump_busy_s": 0.25,
            "dump_copy_s": 0.1,
            "threads": {"dump": 4, "load": 4},
        },
        "load": {
            "block_size": 16,
            "shared": 6544,
            "hit_ttft": {"seconds": 0.15, "num_cached_tokens": hit},
            "load_s": {"lookup": 0.01, "read": 0.2, "copy": 0.05, "stall": 0.1},
            "hit": hit_run,
        },
        "offload": {"hit_ttft": {"seconds": 0.2, "num_cached_tokens": 6544}},
    }


def test_a_right_run_passes_and_each_wrong_answer_fails():
    config = gc.MODELS["hybrid"]
    assert gc.judge("hybrid", config, _runs(6544))["ok"]
    assert not gc.judge("hybrid", config, _runs(6528))["ok"]  # one block short
    assert not gc.judge("hybrid", config, _runs(6544, want_tokens=False))["ok"]
    assert not gc.judge("hybrid", config, _runs(6544, gdn_plain=3))["ok"]  # GDN hooked unpatched
    col = gc.judge("hybrid", config, _runs(6544))
    # bandwidth: bytes over the wall time any worker was at work (0.25; the workers' own
    # seconds summed are 0.4) against bytes over prefill (0.5)
    assert col["dump_vs_production"] == pytest.approx(0.5 / 0.25)
    assert col["dump_copy_share"] == pytest.approx(0.1 / 0.4)
    assert col["dump_tail_ms"] == pytest.approx(300)
    table = gc.render([col])
    assert "| ok | True |" in table and "| threads | dump 4, load 4 |" in table
    assert "| load_ms | lookup 10, read 200, copy 50, stall 100 |" in table
    older = _runs(6544)  # a record from before dump_busy_s: the workers' sum stands in
    del older["dump"]["dump_busy_s"]
    assert gc.judge("hybrid", config, older)["dump_vs_production"] == pytest.approx(0.5 / 0.4)


def test_steady_hits_plain_medians_and_the_peers_hit_length_are_judged():
    """Every timed hit is the same length: our later hits in the same process and vLLM's
    OffloadingConnector's; the runs without a connector give medians and spreads."""
    config = gc.MODELS["hybrid"]
    runs = _runs(6544)
    runs["load"]["steady"] = {
        "seconds": [0.1, 0.12, 0.2],
        "median_s": 0.12,
        "hit_tokens": [6544] * 3,
    }
    runs["plain"] = {"recompute_s": [0.4, 0.5, 0.7], "own_cache_s": [0.1, 0.11, 0.3]}
    col = gc.judge("hybrid", config, runs)
    assert col["ok"]
    assert col["steady_hit_ms"] == {"median": 120, "min": 100, "max": 200, "n": 3}
    assert col["plain_ttft_ms"]["recompute median"] == pytest.approx(500)
    assert col["plain_ttft_ms"]["own_cache spread"] == pytest.approx(200)
    runs["load"]["steady"]["hit_tokens"] = [6544, 6560, 6544]  # one hit a tail longer
    assert not gc.judge("hybrid", config, runs)["ok"]
    runs = _runs(6544)
    runs["offload"]["hit_ttft"]["num_cached_tokens"] = 6400  # the peer hit less
    assert not gc.judge("hybrid", config, runs)["ok"]


def test_a_threads_column_checks_the_connector_alone():
    """``--threads``: the same dense model with more dump / load threads, no hook runs
    and no OffloadingConnector of its own; its verdict is the hit's."""
    config = gc.model_of("dense, 8 threads")
    assert config is gc.MODELS["dense"]
    runs = _runs(6544)
    for key in ("hooks_patched", "hooks_plain", "offload"):
        del runs[key]
    col = gc.judge("dense, 8 threads", config, runs)
    assert col["ok"] and "hooks_patched" not in col
    assert col["ttft_ms"]["offloading_connector"] is None
    assert not gc.judge("dense, 8 threads", config, {**runs, "load": {}})["ok"]
    assert not gc.judge("dense", config, runs)["ok"]  # a model column needs its hook runs


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


def test_a_refused_model_runs_no_peer_and_a_threads_column_no_hooks(tmp_path, monkeypatch):
    """The chain's processes in order: after the connector's start-up refusal there is no
    hit to set vLLM's OffloadingConnector against, so it is not started (a lent GPU's
    minutes); a ``--threads`` column dumps and loads with its thread count, nothing else."""
    started: list[tuple[str, str, dict]] = []

    def run_child(session, chain, mode, model, store, hybrid, env):
        started.append((chain, mode, env))
        return {"refused": "vLLM < 0.29"} if hybrid else {"ok": 1}

    monkeypatch.setattr(gc, "run_child", run_child)
    session = gc.Session(tmp_path, None, None, None)
    gc.connector_chain(session, "hybrid")
    assert [m for _c, m, _e in started] == ["dump", "load"]
    assert set(session.runs["hybrid"]) == {"dump", "load"}
    started.clear()
    gc.connector_chain(session, "dense")
    assert [m for _c, m, _e in started] == ["dump", "load", "plain", "offload"]
    started.clear()
    gc.connector_chain(session, "dense", threads=8)
    assert started == [
        ("dense-ucm-t8", "dump", {gc.THREADS_ENV: "8"}),
        ("dense-ucm-t8", "load", {gc.THREADS_ENV: "8"}),
    ]
    assert set(session.runs["dense, 8 threads"]) == {"dump", "load"}


@pytest.mark.parametrize("bad", ["x", "4,0", "2.5"])
def test_bad_threads_are_refused_naming_the_option(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        gc.main(["--threads", bad, "--models", "dense"])
    assert exc.value.code == 2
    assert "--threads" in capsys.readouterr().err
