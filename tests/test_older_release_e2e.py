"""The connector e2e on older vLLM releases, in ``make test`` (issue #26).

Each release runs in the runtime matrix's venv (``scripts/runtime_matrix.py``), built once
and cached outside the checkout (``~/.cache/ucm_patch/matrix``, or
``UCM_MATRIX_DIR``); a fresh clone reinstalls only itself into it. The checks are
``make matrix``'s own (``check_e2e``): dumped in one process, loaded in a fresh one.

* **0.22.1** (what GPU users with torch 2.11 get), tiny Qwen3: the hit covers the prefix's
  full blocks with the tokens of a recomputation and the logprobs, bit for bit, of the
  exact oracle (vLLM's own prefix cache seeded with the hit's prefix as the dump computed
  it: the same KV bits and split; a recomputation in one pass splits the prefill
  elsewhere, and in bf16 no fixed tolerance holds on every CPU); and, since 0.22.1 seeds
  NONE_HASH randomly per process, a run without ``PYTHONHASHSEED`` prints the connector's
  warning naming it. Hybrid hits too, on both tiny layouts, equal to the exact oracle:
  its scheduler would kill the engine core on an async hybrid load (the align split's
  assert) and zero the load's blocks; the ``hybrid_async_load`` patch runs it with
  0.23's and 0.26's fixes. Its CPU build cannot run a hybrid model with prefix caching
  at all by itself (the mamba block copy is a Triton kernel; Triton has no CPU backend):
  the child runs that copy on the host (``matrix_child.host_mamba_block_copy``, what
  0.26's CPU runner does itself). Its worker runs in a process of its own: counters,
  ERROR lines and the raising store are set and read there (tests/support/child_probes.py).
* **0.26.0**, the oldest release whose CPU build runs the tiny 3:1 Qwen3-Next, and
  **0.28.0**, the newest without state offers: the connector finds the states by
  position, each checked against its block's hash; the hybrid hit ends on a stored GDN
  state, with a recomputation's tokens and the exact oracle's logprobs. What decides
  that at start is read from each release's own scheduler: 0.26.0's and 0.28.0's let an
  async load past the align split (each in its own form) and out of the step's zeroing,
  0.22.1's does neither and 0.25.0's only the first (both served with the
  ``hybrid_async_load`` patch, 0.25.0 on the same host mamba block copy as 0.22.1; refused,
  naming what is missing, with it switched off).
* **0.29.0**, the oldest release with state offers (``kv_connector_block_state``, 0.29's
  dict form): the hybrid hit ends on a stored GDN state, with a recomputation's tokens and
  the exact oracle's logprobs. And the oracle of the positional offers: beside every
  step, 0.29's own offers equal those the connector finds by position on 0.22 - 0.28, and
  after preemptions, where 0.29 offers a resumed request's stored boundaries again, the
  state dumps both start are equal; the same traces on 0.22.1, 0.25.0, 0.26.0 and 0.28.0
  find no block other than the state vLLM's cache holds, and store states in each.
* **A hybrid load that fails** (issue #36), on 0.22.1, 0.25.0, 0.26.0, 0.28.0, 0.29.0 and on this
  venv's vLLM (0.32): the
  stored values are damaged in their segment files between the dump and the load, or the
  store raises on every read. The lookup still offers the prefix and vLLM schedules its
  async load; the load fails, the request is recomputed, and the engine serves the next
  request: both outputs equal a fresh process's without the connector, bit for bit (the
  same prefill from token 0, the same split; on 0.22.1 the tokens, and the logprobs bit
  for bit those of a process with a stand-in connector that never hits: its CPU build
  computes a prompt a few ULPs apart once any KV connector is configured, every
  ucm_patch hook switched off too). 0.29 reports the failure only as invalid
  block ids, which its scheduler unpacked as one KV-cache group: the engine core died of a
  ValueError until the ``hybrid_load_failure`` patch (patches/vllm/hybrid_load_failure.py).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.support import REPO, load_script

pytestmark = pytest.mark.vllm

rm = load_script("runtime_matrix")
child = load_script("matrix_child")
#: The white-box oracle of the state offers (run in a matrix venv as matrix_child is).
ORACLE_CHILD = REPO / "tests" / "support" / "state_oracle_child.py"


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
    assert out["same_tokens"] and out["oracle_cached_tokens"] == out["cached_tokens"], out
    assert out["same_as_oracle"], out  # logprobs bit for bit
    assert out["stored_files"] > 0 and out["pythonhashseed"], out
    assert out["seed_warning"], out
    assert "logged_error" not in out, out["logged_error"]
    assert out["ok"], out


@pytest.mark.parametrize(
    ("version", "era", "split"),
    [
        ("0.22.1", "vllm-0.22", True),
        ("0.25.0", "vllm-0.23", False),
        ("0.26.0", None, False),
        ("0.28.0", None, False),
    ],
)
def test_the_marks_of_finding_states_by_position_are_read_from_each_releases_scheduler(
    release, version: str, era: str | None, split: bool
) -> None:
    """What the connector checks at start, in the release's own venv: 0.22.1's scheduler
    asserts on an async load in the align split and zeroes its blocks, 0.25.0's zeroes
    them (hybrid refused, naming what is missing, with the ``hybrid_async_load`` patch
    switched off; served with it, which the registry reports applied, in the era of that
    release); 0.26.0's and 0.28.0's do neither (each skips the split its own way: hybrid
    served by position, no patch needed)."""
    run = release(version)
    code = (
        "import ucm_patch; "
        "from ucm_patch.connector.vllm_support import hybrid_unsupported_reason as r; "
        "print(repr((r(), [(p['id'], p['state'], p['reason']) for p in ucm_patch.report() "
        "if p['id'].startswith('hybrid_async_load')])))"
    )

    def check(env: dict[str, str]) -> tuple[str | None, list[tuple[str, str, str]]]:
        out = subprocess.run([run.python, "-c", code], env=env, capture_output=True,
                             text=True, check=True, timeout=300)  # fmt: skip
        return ast.literal_eval(out.stdout.strip().splitlines()[-1])  # (reason, patch rows)

    reason, rows = check(run.env)
    assert reason is None, reason
    states = {i: state for i, state, _why in rows}
    if era is None:
        assert set(states.values()) == {"skipped-version"}, rows  # out of every era's range
        return
    assert states.pop(f"hybrid_async_load@{era}") == "applied", rows
    assert set(states.values()) <= {"skipped-version"}, rows  # the other era
    reason, rows = check({**run.env, "UCM_PATCH_HYBRID_ASYNC_LOAD": "0"})
    assert reason is not None and "_skip_zero_block_ids" in reason, reason
    assert ("an async load past the mamba align split" in reason) == split, reason


@pytest.mark.parametrize("version", ["0.22.1", "0.25.0", "0.26.0", "0.28.0"])
@pytest.mark.parametrize("model", ["tiny-qwen3-next-3to1", "tiny-qwen3-next-mixed"])
def test_hybrid_hits_on_a_gdn_state_found_by_position(release, version: str, model: str) -> None:
    """0.22 to 0.28 offer no states: the connector finds each one by position,
    checked against the block's hash (SchedulerSide._boundary_offers), and the hit ends
    on it with a recomputation's tokens and the exact oracle's logprobs; on the 3:1
    layout of the released checkpoints (three mamba groups) and on an uneven one
    (GAGGA). 0.22.1 and 0.25.0 serve it with the ``hybrid_async_load`` patch (0.25: its
    zeroing half only), and run a hybrid model with prefix caching at all here only with
    their mamba block copy done on the host (``matrix_child.host_mamba_block_copy``: a
    Triton kernel on their CPU builds)."""
    run = release(version)
    assert not rm.offers_block_state(version)
    out = rm.check_e2e(run, rm.GDN_MODEL.parent / model, f"e2e_hybrid_{model}")
    assert "refused" not in out, out
    # the async load's attention blocks were in vLLM's zeroing list, and none reached the
    # worker's (0.22: the hybrid_async_load patch; 0.26+: vLLM's _skip_zero_block_ids)
    zeroing = out["zeroing"]
    assert zeroing["listed"] > 0 and zeroing["zeroed"] == 0, zeroing
    assert out["cached_tokens"] == out["expected_hit_tokens"] > 0, out
    assert out["same_tokens"] and out["stored_files"] > 0, out
    assert out["oracle_cached_tokens"] == out["cached_tokens"] and out["same_as_oracle"], out
    assert "logged_error" not in out, out["logged_error"]
    assert out["ok"], out


#: The KV caches of the preemption traces, in blocks (state_oracle_child._preempted): two
#: prompts of two blocks less 4 tokens fit, their decodes crossing into a third block do
#: not. With 16 one request is preempted once; with 12 they are preempted in turn, each
#: resumed on its prefix (from the store or the local cache), and vLLM 0.29 offers the
#: resumed request's earlier boundary states again.
PREEMPT_BLOCKS = (16, 12)


@pytest.fixture(scope="module")
def state_traces(release) -> Callable[[str], dict[str, dict[str, Any]]]:
    """``state_traces(version)``: every trace of ``state_oracle_child.run_state_oracle`` run on
    that release, each in a fresh process on a store of its own (``steps``, ``chunked``
    at the block size ``steps`` reported, and ``preempt`` at each of
    :data:`PREEMPT_BLOCKS`), by name."""
    done: dict[str, dict[str, dict[str, Any]]] = {}

    def get(version: str) -> dict[str, dict[str, Any]]:
        if version in done:
            return done[version]
        run = release(version)
        model, seed = str(rm.GDN_MODEL), {"PYTHONHASHSEED": "0"}

        def trace(name: str) -> dict[str, Any]:
            store = run.work / f"oracle-store-{name.replace(':', '-')}"
            shutil.rmtree(store, ignore_errors=True)
            args = ["state-oracle", model, str(store), name]
            out = run.work / "oracle.json"
            return rm.run_child(run, f"oracle {name}", args, out, seed, child=ORACLE_CHILD)

        out = {"steps": trace("steps")}
        out["chunked"] = trace(f"chunked:{out['steps']['block_size']}")
        for blocks in PREEMPT_BLOCKS:
            out[f"preempt:{blocks}"] = trace(f"preempt:{blocks}")
        done[version] = out
        return out

    return get


def test_states_found_by_position_equal_the_states_vllm_offers(state_traces) -> None:
    """The oracle of the positional offers (vLLM 0.22 - 0.28): on 0.29, the oldest release
    that offers the states itself, every step's offers are compared with those the
    connector finds by position, over a prefill of several blocks in one step, two
    requests sharing a prefix in one step, a decode crossing a block boundary, an async
    hit from the store then a local hit on the loaded prefix, a chunked prefill of one
    block per step, and two requests whose decodes cross a block boundary in a KV cache
    too small for both (:data:`PREEMPT_BLOCKS` blocks: vLLM preempts one, frees its
    blocks and computes it again). The offers must be equal, and every trace must offer
    states; where vLLM offers a boundary again that the request already stored (after a
    preemption), the state dumps the two sets of offers start must be equal."""
    traces = state_traces("0.29.0")
    steps, chunked = traces["steps"], traces["chunked"]
    block = steps["block_size"]
    assert steps["hit"]["num_cached_tokens"] >= block, steps["hit"]  # from the store
    assert steps["again"]["num_cached_tokens"] >= block, steps["again"]  # on the loaded prefix
    for out in (steps, chunked):
        assert out["offer_differences"] == [] and out["differences"] == [], out
        assert out["offers"] == out["positional"] == out["dumps"] > 0, out
        assert "logged_error" not in out, out["logged_error"]
    # the chunked prefill of 3 blocks and a tail offers each boundary it ends on
    assert chunked["offers"] >= 3, chunked
    for blocks in PREEMPT_BLOCKS:
        preempted = traces[f"preempt:{blocks}"]
        assert preempted["preemptions"] >= 1, preempted  # the trace is what it says
        assert preempted["tokens"] == [preempted["max_tokens"]] * 2, preempted  # both done
        # vLLM offers a resumed request's boundaries again (already stored for it: no dump
        # starts); the dumps either way are the same
        assert preempted["differences"] == [], preempted["differences"]
        assert preempted["dumps"] == preempted["positional"] > 0, preempted
        assert preempted["offers"] >= preempted["positional"], preempted
        assert "logged_error" not in preempted, preempted["logged_error"]


@pytest.mark.parametrize("version", ["0.22.1", "0.25.0", "0.26.0", "0.28.0"])
def test_the_oracles_traces_on_each_release_that_finds_states_by_position(
    state_traces, version: str
) -> None:
    """The same traces on each release whose states are found by position: every block
    found is the state vLLM's own prefix cache holds for that prefix (no hash mismatch),
    every trace stores states, each on a block boundary of the block size the release
    chose (on this CPU the one 0.29 chose), the preempted requests finish, and the
    store's prefix is a hit, then a local hit. What is stored is not compared with 0.29's
    dumps one for one: the releases cache different states (0.22 - 0.28 hash the block a
    decode crosses a boundary in, so it is dumped; 0.29 offers a state it has just loaded
    from the store again, and it is dumped again)."""
    oracle, here = state_traces("0.29.0"), state_traces(version)
    assert set(here) == set(oracle)
    block = here["steps"]["block_size"]
    assert block == oracle["steps"]["block_size"]
    for name, out in here.items():
        assert "logged_error" not in out, (name, out["logged_error"])
        assert out["offers"] == 0, (name, out)  # no offers from vLLM before 0.29
        assert out["state_offer_mismatches"] == 0, (name, out)
        assert out["state_dumps"], (name, out)
        assert all(boundary % block == 0 for _p, _g, boundary in out["state_dumps"]), name
        if name.startswith("preempt:"):
            assert out["preemptions"] >= 1, (name, out)
            assert out["tokens"] == [out["max_tokens"]] * 2, (name, out)
    steps = here["steps"]
    assert steps["hit"]["num_cached_tokens"] >= block, steps["hit"]  # from the store
    assert steps["again"]["num_cached_tokens"] >= block, steps["again"]  # the loaded prefix


def test_0_29_hybrid_hits_on_a_stored_gdn_state(release) -> None:
    run = release("0.29.0")
    assert rm.offers_block_state("0.29.0")
    out = rm.check_e2e(run, rm.GDN_MODEL, "e2e_hybrid")
    assert "refused" not in out, out
    assert out["cached_tokens"] == out["expected_hit_tokens"] > 0, out
    assert out["same_tokens"] and out["stored_files"] > 0, out
    assert out["oracle_cached_tokens"] == out["cached_tokens"] and out["same_as_oracle"], out
    assert "logged_error" not in out, out["logged_error"]
    assert out["ok"], out


class _ThisVenv(rm.Run):
    """The matrix's ``Run`` on the interpreter running the tests (this checkout's vLLM)."""

    @property
    def python(self) -> str:
        return sys.executable


@pytest.fixture(scope="module")
def failed_loads(release, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], object]:
    """``failed_loads(version)``: the hybrid prefix dumped by one process; then, each in a
    fresh process on that store, a load whose store raises on read, a load of the values
    damaged in place (``kv_load_failure_policy`` "recompute", as docs/CONNECTOR.md sets
    it), and, the values stored again since damaged too, a load under vLLM's default
    policy, "fail"; and a fresh process without the connector (the reference)."""
    done: dict[str, dict[str, Any]] = {}

    def get(version: str) -> dict[str, Any]:
        if version in done:
            return done[version]
        if version == "this venv":
            run = _ThisVenv(version, tmp_path_factory.mktemp("vllm-here"), rm.child_env())
        else:
            run = release(version)
        model = str(rm.GDN_MODEL)
        store = run.work / "fail-store"
        shutil.rmtree(store, ignore_errors=True)
        seed = {"PYTHONHASHSEED": "0"}  # keys that a later process finds, on every release

        def step(name: str, args: list[str]) -> dict[str, Any]:
            return rm.run_child(run, f"fail {name}", args, run.work / f"fail-{name}.json", seed)

        def load(name: str, how: str, policy: str) -> dict[str, Any]:
            try:  # a dead engine core fails its own case, not the others
                return step(name, ["e2e-load-fail", model, str(store), how, policy])
            except rm.MatrixError as exc:
                return {"error": exc.as_dict()}

        out: dict[str, Any] = {"dump": step("dump", ["e2e-dump", model, str(store)])}
        out["raising"] = load("raising", "raising", "recompute")
        out["damaged"] = child.damage_values(str(store))
        out["stored"] = load("stored", "stored", "recompute")
        # the failed load dropped what it read and the recomputation stored it again; the
        # values it did not read are still damaged
        out["damaged_again"] = child.damage_values(str(store), skip=out["damaged"])
        out["fail_policy"] = load("fail_policy", "stored", "fail")
        out["reference"] = step("reference", ["reference", model])
        if version == "0.22.1":
            # its CPU build computes a prompt a few ULPs apart once any KV connector is
            # configured (measured with the tests' do-nothing stand-in connector and every
            # ucm_patch hook switched off): the bit-for-bit reference has one that never hits
            out["reference_with_a_connector"] = step("standin", ["reference", model, "standin"])
        done[version] = out
        return out

    return get


def _failed_load(load: dict[str, Any], how: str) -> None:
    """The lookup offered the stored prefix's whole hit units, vLLM scheduled their async
    load, and it failed: nothing was written into vLLM's blocks."""
    assert "error" not in load, load["error"]["tail"]  # the engine died
    unit = load["unit"]
    want = load["prefix_len"] // unit * unit  # block size and hit unit: vLLM's, at run time
    stats = load["stats"]
    assert want > 0 and stats["hit_requests"] == 1 and stats["hit_tokens"] == want, stats
    assert stats["loads_async"] == 1, stats  # a hybrid model loads between steps
    assert stats["load_failed_requests"] == 1 and stats["loaded_pages"] == 0, stats
    if how == "stored":
        assert stats["load_errors"] >= 1, stats  # checksum: counted per value
    else:
        assert stats["load_exceptions"] >= 1, stats


@pytest.mark.parametrize("version", ["0.22.1", "0.25.0", "0.26.0", "0.28.0", "0.29.0", "this venv"])
@pytest.mark.parametrize("how", ["stored", "raising"])
def test_a_failed_hybrid_load_is_recomputed_and_the_engine_serves_on(
    failed_loads, version: str, how: str
) -> None:
    runs = failed_loads(version)
    load, reference = runs[how], runs["reference"]
    bits = runs.get("reference_with_a_connector", reference)
    if how == "stored":
        assert runs["damaged"], "nothing was stored to damage"
    _failed_load(load, how)
    # Recomputed from token 0, as in a process without the connector: equal bit for bit
    # (the same prefill, split the same way); then the next request, from vLLM's cache.
    for name in ("hit", "again"):
        assert load[name]["tokens"] == reference[name]["tokens"], name
        assert load[name]["logprobs"] == bits[name]["logprobs"], name
    # A broken value is a WARNING; the store's exception is one ERROR (with its
    # traceback), once per cause. Nothing else, from vLLM either, is an error.
    errors = load["errors"]
    if how == "raising":
        assert len(errors) == 1 and "store exploded" in errors[0], errors
    else:
        assert errors == [], errors
    assert "logged_error" not in load, load["logged_error"]


@pytest.mark.parametrize("version", ["0.22.1", "0.25.0", "0.26.0", "0.28.0", "0.29.0", "this venv"])
def test_under_the_fail_policy_a_failed_hybrid_load_fails_its_request_only(
    failed_loads, version: str
) -> None:
    """vLLM's default ``kv_load_failure_policy``: the request ends with an error, and the
    engine serves the next one (which finds no usable stored prefix and computes it)."""
    runs = failed_loads(version)
    load, reference = runs["fail_policy"], runs["reference"]
    assert runs["damaged_again"], "nothing was stored again to damage"
    _failed_load(load, "stored")
    assert load["hit"]["tokens"] == [] and load["hit"]["finish_reason"] == "error", load["hit"]
    # vLLM 0.29 logs the failed request at ERROR ("Failing 1 request(s) due to KV load
    # failure"), 0.32's _handle_failed_recving does not: nothing else is an error
    assert all("KV load failure" in line for line in load["errors"]), load["errors"]
    # computed from token 0 here, from vLLM's prefix cache in the reference: another
    # prefill split, so the tokens are compared, not the last bits of the logprobs
    assert load["again"]["tokens"] == reference["again"]["tokens"]
