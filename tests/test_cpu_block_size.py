"""``cpu_block_size``: a hybrid model's aligned block size survives the engine-core handshake.

On real vLLM CPU: the tiny 3:1 Qwen3-Next's config is built as the OpenAI server builds it,
aligned as vLLM's executor aligns it (``update_block_size_for_backend``: 640 or 1152 tokens,
by this CPU), then ``vllm_config.__post_init__()`` runs again as ``EngineCoreProc`` does
after its handshake. Without the patch vLLM resets ``cache_config.block_size`` to its CPU
default while ``mamba_block_size`` (what the KV-cache groups get) keeps the aligned size;
with it both stay equal. The expected sizes come from vLLM itself, never typed in.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ucm_patch.patches.vllm.cpu_block_size import aligned_block_size, make_keep_aligned_wrapper

HANDSHAKE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
import ucm_patch  # activates (or not: UCM_PATCH=0) as a user's import would

args = EngineArgs(model=sys.argv[1], dtype="bfloat16", max_model_len=2048,
                  enable_prefix_caching=True, skip_tokenizer_init=True)
cfg = args.create_engine_config()
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
# what the executor does (update_block_size_for_backend) with the backend its model has
type(current_platform)._align_hybrid_block_size(cfg, CPUAttentionBackend)
aligned = (cfg.cache_config.block_size, cfg.cache_config.mamba_block_size)
cfg.__post_init__()                                    # what the handshake does
print(json.dumps({"aligned": aligned, "after": cfg.cache_config.block_size,
                  "mamba_after": cfg.cache_config.mamba_block_size}))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("patched", [True, False])
def test_handshake_keeps_the_aligned_hybrid_block_size(run_py, tiny_qwen3_next_3to1, patched):
    env = {} if patched else {"UCM_PATCH": "0"}
    proc = run_py(HANDSHAKE, env=env, args=(str(tiny_qwen3_next_3to1),))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    block, mamba = out["aligned"]
    assert block == mamba and block > 128  # vLLM aligned it (to the mamba page)
    assert out["mamba_after"] == mamba
    if patched:
        assert out["after"] == block
    else:  # vLLM's own behaviour, which the record exists for
        assert out["after"] != block


def _config(block: int | None, mamba: int | None, **cache: object) -> SimpleNamespace:
    fields = {"block_size": block, "mamba_block_size": mamba, "mamba_cache_mode": "align"}
    fields.update({"user_specified_block_size": False, **cache})
    return SimpleNamespace(
        cache_config=SimpleNamespace(**fields), model_config=SimpleNamespace(is_hybrid=True)
    )


def _reset_to_128(vllm_config: SimpleNamespace) -> str:
    if not vllm_config.cache_config.user_specified_block_size:
        vllm_config.cache_config.block_size = 128
    return "result"


@pytest.mark.parametrize(
    ("config", "after"),
    [
        (_config(640, 640), 640),  # the handshake: aligned size put back
        (_config(None, None), 128),  # first call: nothing aligned yet
        (_config(640, 640, user_specified_block_size=True), 640),  # the user's own size
        (_config(640, None), 128),  # no align mode: vLLM decides
        (_config(640, 640, mamba_cache_mode="all"), 128),
        (_config(256, 640), 128),  # sizes disagree: not the alignment's result
    ],
)
def test_wrapper_restores_only_an_aligned_size(config, after):
    wrapper = make_keep_aligned_wrapper()
    assert wrapper(_reset_to_128, None, (config,), {}) == "result"
    assert config.cache_config.block_size == after


def test_non_hybrid_model_is_left_to_vllm():
    config = _config(640, 640)
    config.model_config.is_hybrid = False
    assert aligned_block_size(config) is None
    make_keep_aligned_wrapper()(_reset_to_128, None, (), {"vllm_config": config})
    assert config.cache_config.block_size == 128
