"""The e2e models are KV-sensitive: wrong KV that passes its checksum changes the output.

Every e2e suite asserts "output with a store hit equals a recomputation". That assertion
proves the loaded KV right only if the model's output depends on its KV: the default tiny
Qwen3 (``initializer_range`` 0.02) repeats one token whatever its cache holds, so it would
pass with garbage pages. This suite shows, for every model the e2e suites use, that it
would not: one vLLM process computes ``R1`` with the connector (dumping its full blocks
and, for hybrid models, the GDN/Mamba states), computes ``R2`` under another
``cache_salt`` (the reference, no hit), then every stored value is rewritten with a
changed payload inside a *valid* frame (``mutate``: the sign bit of every 16-bit word
flipped, so the numbers stay finite and the checksum still matches), and ``R2`` loads the
shared prefix from the store: no load error, a real hit, and output that differs from
the reference.

The reference is exact (issue #36): vLLM's own prefix cache, under another salt, holds the
hit's prefix computed as ``R1`` computed it (``oracle_seed`` in
tests/support/connector_child.py), so with unchanged KV the loaded ``R2`` would equal it
bit for bit, as the e2e suites require. Wrong KV must move the output beyond what rounding
could: other greedy tokens, or a logprob moved by more than the rounding of the logits
alone explains (``rounding_bound``: 4 u max|logit|, u the logits' unit roundoff, 2^-8 for
bf16, max|logit| measured in both runs), never a constant chosen on one machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_child import prompt, rounding_bound, run_child, seed_step

pytestmark = pytest.mark.vllm

# (fixture, hybrid): the models of tests/test_e2e_*.py
MODELS = (
    ("tiny_qwen3_sharp", False),
    ("tiny_qwen3_next", True),
    ("tiny_qwen3_next_3to1", True),
    ("tiny_qwen3_next_mixed", True),
)


def prompts(hybrid: bool) -> tuple[list[int], list[int], list[int]]:
    """(prefix, R1, R2): hybrid blocks are thousands of tokens (the attention page must hold
    a GDN state), so the hybrid prefix is longer."""
    prefix = prompt(3, 3000) if hybrid else prompt(1, 300)
    return prefix, [*prefix, 5, 6, 7], [*prefix, 8, 9, 10, 11]


def spec(model: Path, hybrid: bool, tmp: Path) -> dict[str, Any]:
    _prefix, r1, r2 = prompts(hybrid)
    oracle = "oracle"  # vLLM's own cache, seeded with r2's hit: the exact reference
    extra: dict[str, Any] = {"store": "local", "local_path": str(tmp / "store")}
    return {
        "model": str(model),
        "hybrid": hybrid,
        "extra": extra,
        "steps": [
            {"op": "gen", "name": "r1", "prompt": r1},
            {"op": "flush", "name": "flush1"},
            {"op": "gen", "name": "reference", "prompt": r2, "salt": "recompute"},
            {"op": "flush", "name": "flush2"},
            {"op": "gen", "name": "clean", "prompt": r2, "max_tokens": 8},  # unmutated hit
            {"op": "flush", "name": "flush3"},
            {"op": "mutate", "name": "mutate"},
            {"op": "gen", "name": "r2", "prompt": r2, "max_tokens": 8},
            seed_step("seed", r1, salt=oracle, hit_of="r2"),
            {"op": "gen", "name": "oracle", "prompt": r2, "salt": oracle, "max_tokens": 8},
        ],
    }


@pytest.fixture(scope="module", params=MODELS, ids=[m for m, _h in MODELS])
def mutated(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    name, hybrid = request.param
    model = request.getfixturevalue(name)
    tmp = tmp_path_factory.mktemp(f"mutate_{name}")
    return run_child(spec(model, hybrid, tmp), tmp, name) | {"hybrid": hybrid}


def test_mutated_values_pass_the_checksum_and_are_loaded(mutated: dict[str, Any]) -> None:
    assert mutated["mutate"]["mutated"] == mutated["mutate"]["keys"] > 0
    r2 = mutated["r2"]
    prefix, _r1, _r2 = prompts(mutated["hybrid"])
    hit = r2["num_cached_tokens"]
    assert 0 < hit <= len(prefix)
    assert hit % mutated["layout"]["unit"] == 0
    stats, before = r2["stats"], mutated["clean"]["stats"]
    assert stats["hit_tokens"] - before["hit_tokens"] == hit
    assert stats["loaded_pages"] > before["loaded_pages"]
    assert stats["load_errors"] == before["load_errors"] == 0  # the frames were valid
    assert stats["load_failed_requests"] == 0
    assert mutated["reference"]["num_cached_tokens"] == 0
    # The oracle computed its seed, then hit it in vLLM's own cache: r2's split, r1's KV.
    assert mutated["seed"]["num_cached_tokens"] == 0 and mutated["seed"]["hit"] == hit
    assert mutated["oracle"]["num_cached_tokens"] == hit


def test_right_kv_equals_the_oracle(mutated: dict[str, Any]) -> None:
    """The comparison below can pass: before the mutation, the same hit loaded from the
    store equals the oracle bit for bit (so it is the wrong KV that moves the output)."""
    clean, oracle = mutated["clean"], mutated["oracle"]
    assert mutated["flush3"]["reset"]
    assert clean["num_cached_tokens"] == mutated["r2"]["num_cached_tokens"]
    assert (clean["tokens"], clean["logprobs"]) == (oracle["tokens"], oracle["logprobs"])


def test_wrong_kv_changes_the_output(mutated: dict[str, Any]) -> None:
    """Tokens differ, or (same greedy tokens) logprobs move beyond what the rounding of the
    logits explains: the e2e suites compare both exactly, so either would fail them."""
    loaded, oracle = mutated["r2"], mutated["oracle"]
    # The oracle is the unmutated output (the first 4 tokens of a recomputation).
    assert oracle["tokens"][:4] == mutated["reference"]["tokens"]
    moved = max(abs(a - b) for a, b in zip(loaded["logprobs"], oracle["logprobs"], strict=True))
    bound = rounding_bound(loaded, oracle)
    assert loaded["tokens"] != oracle["tokens"] or moved > bound, (
        "wrong KV went unseen",
        moved,
        bound,
        loaded,
        oracle,
    )
