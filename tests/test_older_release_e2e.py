"""The connector e2e on older vLLM releases, in ``make test`` (issue #26).

Each release runs in the runtime matrix's venv (``scripts/runtime_matrix.py``), built once
and cached outside the checkout (``~/.cache/ucm_patch/matrix``, or
``UCM_PATCH_MATRIX_DIR``); a fresh clone reinstalls only itself into it. The checks are
``make matrix``'s own (``check_e2e``): dumped in one process, loaded in a fresh one.

* **0.22.1** (what GPU users with torch 2.11 get), tiny Qwen3: the hit covers the prefix's
  full blocks with the tokens and logprobs of a recomputation; and, since 0.22.1 seeds
  NONE_HASH randomly per process, a run without ``PYTHONHASHSEED`` prints the connector's
  warning naming it. Its CPU build cannot run a hybrid model with prefix caching at all
  (the mamba block copy is a Triton kernel; Triton has no CPU backend), with or without
  a connector.
* **0.26.0**, the oldest release whose CPU build runs the tiny 3:1 Qwen3-Next: it has no
  state offers, so the connector refuses hybrid hits at start (one WARNING), stores
  nothing, and vLLM's output is unchanged.
* **0.29.0**, the oldest release with state offers (``kv_connector_block_state``, 0.29's
  dict form): the hybrid hit ends on a stored GDN state, with a recomputation's output.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support import load_script

pytestmark = pytest.mark.vllm

rm = load_script("runtime_matrix")


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], object]:
    """``release(version)``: the matrix's ``Run`` for that version (venv built or reused)."""
    runs: dict[str, object] = {}

    def get(version: str) -> object:
        if version not in runs:
            rm.build_venv(version, rebuild=False)
            preload = rm.preload(version)
            env = rm.child_env({"LD_PRELOAD": preload} if preload else None)
            runs[version] = rm.Run(version, tmp_path_factory.mktemp(f"vllm-{version}"), env)
        return runs[version]

    return get


def test_0_22_dense_hits_across_processes_and_warns_without_a_hash_seed(release) -> None:
    run = release("0.22.1")
    assert rm.random_block_hash_seed("0.22.1")  # why the seed matters on this release
    out = rm.check_e2e(run)
    assert out["cached_tokens"] == out["expected_hit_tokens"] > 0, out
    assert out["same_tokens"] and out["max_logprob_diff"] < 1e-3, out
    assert out["stored_files"] > 0 and out["pythonhashseed"], out
    assert out["seed_warning"], out
    assert "logged_error" not in out, out["logged_error"]
    assert out["ok"], out


def test_0_26_hybrid_is_refused_at_start_and_stores_nothing(release) -> None:
    run = release("0.26.0")
    assert not rm.offers_block_state("0.26.0")
    out = rm.check_e2e(run, rm.GDN_MODEL, "e2e_hybrid")
    assert out.get("refused", "").startswith("hybrid prefix hits need vLLM >= 0.29"), out
    assert out["cached_tokens"] == 0 and out["stored_files"] == 0, out
    assert out["same_tokens"], out
    assert "logged_error" not in out, out["logged_error"]
    assert out["ok"], out


def test_0_29_hybrid_hits_on_a_stored_gdn_state(release) -> None:
    run = release("0.29.0")
    assert rm.offers_block_state("0.29.0")
    out = rm.check_e2e(run, rm.GDN_MODEL, "e2e_hybrid")
    assert "refused" not in out, out
    assert out["cached_tokens"] == out["expected_hit_tokens"] > 0, out
    assert out["same_tokens"] and out["stored_files"] > 0, out
    assert "logged_error" not in out, out["logged_error"]
    assert out["ok"], out
