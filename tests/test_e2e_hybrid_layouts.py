"""Hybrid layouts as deployed: a prefix dumped by one vLLM process hits in a fresh one.

Real vLLM CPU 0.32, three tiny untied Qwen3-Next layouts (scripts/make_tiny_model.py):
``GA`` (one mamba group), ``GGGA GGGA`` (the released checkpoints' 3:1 ratio, several
mamba groups) and ``GAGGA`` (uneven). For each, three interpreters in a row:

* ``dump``: computes ``R1`` (``PREFIX`` + a tail) with the connector, dumping every full
  attention block and the GDN/Mamba states vLLM offers at block boundaries;
* ``load``: a fresh process on the same store computes ``R2`` (``PREFIX`` + another tail);
* ``plain``: the same request without the connector: once in one pass (``r_recomputed``,
  under a salt: the same tokens), then on the hit's exact oracle (``r``: vLLM's own prefix
  cache seeded with the expected hit's prefix computed as ``dump`` computed it, so the
  same KV and state bits and the same split of the prefill; ``oracle_seed`` in
  tests/support/connector_child.py): the same tokens and logprobs, bit for bit. A
  recomputation in one pass splits the prefill elsewhere, and in bf16 no fixed tolerance
  on its logprobs holds on every CPU.

Nothing about sizes is typed in: the block size, the hit unit, the groups and their rows
come from the run's own vLLM config (the children report them), and the expected hit is
the longest boundary inside the prefix where *every* mamba group's state was stored. The
suite passes whatever block size vLLM picks on this CPU, and once more with a forced
``block_size`` of twice vLLM's own (vLLM 0.32 exposes ``--block-size`` for hybrid models:
it only rounds a too-small value up to fit the mamba page).

Mamba copy order (vLLM's "align" mode copies the boundary state into the running block
before the forward): ``test_mamba_copy_order_*`` shows, on real vLLM, that the copy runs
before ``start_load_kv`` on vLLM 0.32, that a state loaded synchronously in the step is
therefore lost, and that the connector's asynchronous state loads are correct both in this
order and in vLLM-Ascend >= 0.21's (copy inside the connector context, after
``start_load_kv``), so no copy-order patch is needed for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_child import (
    assert_same_as_oracle,
    prompt,
    run_child,
    run_children,
    seed_step,
    whole_units,
)

PREFIX = prompt(3, 3000)
R1 = [*PREFIX, 5, 6, 7]
R2 = [*PREFIX, 8, 9, 10, 11]

pytestmark = pytest.mark.vllm

HYBRID = ("tiny_qwen3_next", "tiny_qwen3_next_3to1", "tiny_qwen3_next_mixed")


def gen(name: str, ids: list[int]) -> dict[str, Any]:
    return {"op": "gen", "name": name, "prompt": ids}


def spec(model: Path, extra: dict[str, Any] | None, ids: list[int], **opts: Any) -> dict:
    return {"model": str(model), "hybrid": True, "extra": extra, "steps": [gen("r", ids)], **opts}


def local(tmp: Path) -> dict[str, Any]:
    return {"store": "local", "local_path": str(tmp / "store"), "load_mode": "async"}


def three_runs(
    model: Path, tmp: Path, extra: dict[str, Any], r1: list[int], r2: list[int], **opts: Any
) -> dict:
    runs = run_children(
        [
            ("dump", spec(model, extra, r1, **opts)),
            ("load", spec(model, extra, r2, mamba_copy="record", **opts)),
        ],
        tmp,
    )
    shared = next((i for i, (a, b) in enumerate(zip(r1, r2, strict=False)) if a != b), len(r1))
    hit = expected_hit(runs["dump"], shared, len(r2))
    recomputed = {**gen("r_recomputed", r2), "salt": "recompute"}
    plain = spec(model, None, r2, **opts)
    plain["steps"] = [recomputed, seed_step("seed", r1, hit=hit), gen("r", r2)]
    return runs | {"plain": run_child(plain, tmp, "plain")}


# ---------------------------------------------------------------------------------------
# Expected numbers, from what the runs report about their own vLLM config
# ---------------------------------------------------------------------------------------
def groups(run: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [g for g in run["layout"]["groups"] if g["kind"] == kind]


def expected_hit(dump: dict[str, Any], prefix_len: int, prompt_len: int) -> int:
    """The longest boundary inside the shared prefix where every mamba group's state was
    stored, on the hit unit, leaving one prompt token to compute (0: none)."""
    unit = dump["layout"]["unit"]
    stored = [set(dump["state_boundaries"].get(str(g["index"]), ())) for g in groups(dump, "mamba")]
    common = set.intersection(*stored) if stored else set()
    fits = [b for b in common if b <= prefix_len and b < prompt_len and b % unit == 0]
    return max(fits, default=0)


def expected_pages(load: dict[str, Any], hit: int) -> int:
    """Pages a hit of ``hit`` tokens loads: every attention block's rows, one state per
    mamba group row."""
    att = sum(hit // g["block_size"] * g["rows"] for g in groups(load, "attention"))
    return att + sum(g["rows"] for g in groups(load, "mamba"))


def check_hit(runs: dict[str, Any], prefix_len: int, prompt_len: int) -> int:
    dump, load, plain = runs["dump"], runs["load"], runs["plain"]
    hit = expected_hit(dump, prefix_len, prompt_len)
    assert hit > 0, dump["state_boundaries"]
    r = load["r"]
    assert r["num_cached_tokens"] == hit
    assert r["stats"]["hit_tokens"] == hit
    assert r["stats"]["loads_async"] == 1 and r["stats"]["loads_layerwise"] == 0
    assert r["stats"]["loaded_pages"] == expected_pages(load, hit)
    assert r["stats"]["load_failed_requests"] == r["stats"]["load_errors"] == 0
    assert plain["r_recomputed"]["num_cached_tokens"] == 0
    assert r["tokens"] == plain["r_recomputed"]["tokens"]
    assert plain["seed"]["num_cached_tokens"] == 0
    assert_same_as_oracle(r, plain["r"])
    return hit


def layer_types(model: Path) -> list[str]:
    return json.loads((model / "config.json").read_text())["layer_types"]


# ---------------------------------------------------------------------------------------
# Runs (each model's three processes run once per session)
# ---------------------------------------------------------------------------------------
_RUNS: dict[str, dict[str, Any]] = {}


def layout_runs(name: str, request: pytest.FixtureRequest, tmp_factory: Any) -> dict[str, Any]:
    if name not in _RUNS:
        model = request.getfixturevalue(name)
        tmp = tmp_factory.mktemp(name)
        _RUNS[name] = three_runs(model, tmp, local(tmp), R1, R2) | {"model": model, "tmp": tmp}
    return _RUNS[name]


@pytest.fixture(scope="module", params=HYBRID)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return layout_runs(request.param, request, tmp_path_factory)


def test_layout_covers_every_layer_of_the_checkpoint(runs: dict[str, Any]) -> None:
    types = layer_types(runs["model"])
    dump = runs["dump"]
    mamba = [layer for g in groups(dump, "mamba") for layer in g["layers"]]
    attention = [layer for g in groups(dump, "attention") for layer in g["layers"]]
    assert len(mamba) == types.count("linear_attention")
    assert len(attention) == types.count("full_attention")
    assert len(set(mamba + attention)) == len(types)
    # vLLM puts as many layers in a mamba group as in the attention group: the released
    # 3:1 layout needs several mamba groups, the case a single shared state mark missed.
    per_group = len(groups(dump, "attention")[0]["layers"])
    assert len(groups(dump, "mamba")) == -(-len(mamba) // per_group)


def test_every_mamba_group_stores_each_boundary(runs: dict[str, Any]) -> None:
    dump = runs["dump"]
    block = dump["vllm"]["block_size"]
    assert dump["vllm"]["mamba_cache_mode"] == "align"
    stored = {
        g["index"]: dump["state_boundaries"].get(str(g["index"])) for g in groups(dump, "mamba")
    }
    first = next(iter(stored.values()))
    assert first, stored
    assert all(b == first for b in stored.values()), stored
    assert all(b % block == 0 for b in first)
    assert dump["r"]["stats"]["dumps_failed"] == dump["r"]["stats"]["dumps_skipped"] == 0


def test_fresh_process_hits_longest_stored_boundary(runs: dict[str, Any]) -> None:
    check_hit(runs, len(PREFIX), len(R2))


def test_mamba_copy_order_vllm_copies_before_start_load_kv(runs: dict[str, Any]) -> None:
    """vLLM 0.32 order: preprocess copy, the connector context (a step's sync loads), the
    forward. The async-loaded state was in place before the copy: the outputs above match."""
    order = [tuple(e) for e in runs["load"]["order"]]
    copies = [e for e in order if e[0] == "copy"]
    assert copies, order[-10:]
    for _kind, step in copies:
        events = [e[0] for e in order if e[1] == step]
        assert events.index("copy") < events.index("forward"), events
        assert events.index("copy") < events.index("start_load_kv"), events


# ---------------------------------------------------------------------------------------
# Mamba copy order, where it matters: states loaded inside the step
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def copy_order(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = layout_runs("tiny_qwen3_next_3to1", request, tmp_path_factory)
    extra = local(base["tmp"])
    model = base["model"]
    return base | run_children(
        [
            ("async_ascend", spec(model, extra, R2, mamba_copy="deferred")),
            ("sync_vllm", spec(model, extra, R2, mamba_copy="record", force_sync_loads=True)),
            ("sync_ascend", spec(model, extra, R2, mamba_copy="deferred", force_sync_loads=True)),
        ],
        tmp_path_factory.mktemp("copy_order"),
    )


def test_mamba_copy_order_async_loads_survive_ascend_order(copy_order: dict[str, Any]) -> None:
    r, plain = copy_order["async_ascend"]["r"], copy_order["plain"]["r"]
    assert r["num_cached_tokens"] == copy_order["load"]["r"]["num_cached_tokens"] > 0
    assert (r["tokens"], r["logprobs"]) == (plain["tokens"], plain["logprobs"])


def test_mamba_copy_order_sync_load_is_lost_to_vllm_order(copy_order: dict[str, Any]) -> None:
    """Why hybrid models never load states inside the step (``load_mode`` 'layerwise' is
    refused for them): vLLM 0.32 copies the boundary block before ``start_load_kv`` fills
    it, so the forward starts from a stale state. In vLLM-Ascend's order it would work."""
    sync, plain = copy_order["sync_vllm"]["r"], copy_order["plain"]["r"]
    assert sync["stats"]["loads_async"] == 0 and sync["num_cached_tokens"] > 0
    assert sync["logprobs"] != plain["logprobs"]
    ascend = copy_order["sync_ascend"]["r"]
    assert (ascend["tokens"], ascend["logprobs"]) == (plain["tokens"], plain["logprobs"])


# ---------------------------------------------------------------------------------------
# A forced block size: no size in this file is typed in
# ---------------------------------------------------------------------------------------
def test_forced_block_size_still_hits(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = layout_runs("tiny_qwen3_next_3to1", request, tmp_path_factory)
    natural = base["dump"]["vllm"]["block_size"]
    forced = 2 * natural
    prefix = prompt(7, 2 * forced + 46)
    tmp = tmp_path_factory.mktemp("forced_block")
    runs = three_runs(
        base["model"],
        tmp,
        local(tmp),
        [*prefix, 5, 6, 7],
        [*prefix, 8, 9, 10, 11],
        block_size=forced,
        max_model_len=len(prefix) + 64,
    )
    assert runs["dump"]["vllm"]["block_size"] == forced
    assert runs["dump"]["layout"]["unit"] == forced
    hit = check_hit(runs, len(prefix), len(prefix) + 4)
    assert hit == 2 * forced  # two forced blocks fit the prefix: a different hit than natural


# ---------------------------------------------------------------------------------------
# The same across processes on the Mooncake store, and layerwise where vLLM allows it
# ---------------------------------------------------------------------------------------
@pytest.mark.mooncake
def test_mooncake_store_hits_across_processes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = layout_runs("tiny_qwen3_next_3to1", request, tmp_path_factory)
    extra = {
        "store": "mooncake",
        "mooncake_master": "$MOONCAKE_MASTER",
        "mooncake_global_segment_bytes": 0,  # the namespace's storage node holds the data
        "load_mode": "async",
    }
    model = base["model"]
    runs = run_children(
        [("dump", spec(model, extra, R1)), ("load", spec(model, extra, R2))],
        tmp_path_factory.mktemp("mooncake_hybrid"),
        netns=True,
    )
    check_hit(runs | {"plain": base["plain"]}, len(PREFIX), len(R2))


def test_layerwise_loads_across_processes_attention_only(
    tiny_qwen3_sharp: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """'layerwise' needs a single attention KV-cache group (vLLM 0.32 raises on block-level
    load errors with several groups, and the copy order above loses in-step state loads), so
    it runs on the attention-only model; hybrid models refuse it (test_connector_config).

    The fresh process's first load runs whole in ``start_load_kv`` (no layer has shown its
    hook yet); its second, after vLLM's own cache is reset, row by row in the forward.

    A recomputation must agree bit for bit where it computes what the hit computes: a
    process without the connector whose own prefix cache holds the hit's prefix, computed
    as the dump computed it (``oracle_seed``, tests/support/connector_child.py). One pass
    over the prompt splits the prefill elsewhere, and in bf16 the CPU's kernels then round
    differently (1.6e-3 in a logprob on an AVX-512 BF16 CPU): no fixed tolerance holds on
    every CPU; bit equality with the same computation does."""
    tmp = tmp_path_factory.mktemp("layerwise")
    extra = {"store": "local", "local_path": str(tmp / "store"), "load_mode": "layerwise"}
    r3 = [*PREFIX, 12, 13]
    two = [gen("r", R2), {"op": "release", "name": "release"}, gen("r3", r3)]

    def attention_only(extra: dict[str, Any] | None, steps: list[dict[str, Any]]) -> dict:
        return {"model": str(tiny_qwen3_sharp), "extra": extra, "steps": steps}

    runs = run_children(
        [
            ("dump", attention_only(extra, [gen("r", R1)])),
            ("load", attention_only(extra, two)),
            # r3 alone in a fresh process: the same hit, loaded whole in start_load_kv
            ("load_whole", attention_only(extra, [gen("r3", r3)])),
        ],
        tmp,
    )
    load = runs["load"]
    (group,) = load["layout"]["groups"]
    block = group["block_size"]
    assert load["vllm"]["block_size"] == block
    hit = whole_units(load, min(len(PREFIX), len(R2) - 1))  # whole chunks of blocks
    first, second = load["r"], load["r3"]
    assert load["release"] == {"released": True, "reset": True}
    for r in (first, second):
        assert hit > 0 and r["num_cached_tokens"] == hit
    assert first["stats"]["loads_sync_fallback"] == 1
    assert second["stats"]["loads_layerwise"] == 1
    assert second["stats"]["loads_async"] == 0
    assert second["stats"]["loaded_pages"] == 2 * hit // block * group["rows"]
    # Row by row in the forward wrote exactly what a whole load writes: same logprobs,
    # bit for bit (same stored KV, same split of the prefill).
    whole = runs["load_whole"]["r3"]
    assert whole["num_cached_tokens"] == hit and whole["stats"]["loads_sync_fallback"] == 1
    assert second["logprobs"] == whole["logprobs"]
    # And vLLM alone agrees, bit for bit, when its own prefix cache holds the hit's prefix
    # (seeded after each reset): the same KV bits, the same split of the prefill.
    seed_r, seed_r3 = (seed_step(f"seed_{name}", R1, hit=hit) for name in ("r", "r3"))
    steps = [seed_r, two[0], two[1], seed_r3, two[2]]
    plain = run_child(attention_only(None, steps), tmp, "plain")
    assert plain["release"]["reset"]
    for name in ("r", "r3"):
        assert plain[f"seed_{name}"]["num_cached_tokens"] == 0  # computed, not found
        assert_same_as_oracle(load[name], plain[name])  # vLLM's cache hit `hit` tokens
