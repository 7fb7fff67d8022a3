"""Build tiny random models locally (no hub access) for tests, the demo and benchmarks.

Usage: python scripts/make_tiny_model.py KIND OUTDIR [--layers N] [--hidden H] [--seed S]
KIND: qwen3 | qwen3_sharp | qwen3_small (a larger Qwen3 for benchmarks), or one of the
hybrid Qwen3-Next layouts in ``HYBRID_LAYOUTS`` (``G`` = GDN linear attention, ``A`` = full
attention):

* ``qwen3_next``: ``GA``, one GDN and one attention layer (one mamba KV-cache group);
* ``qwen3_next_3to1``: ``GGGA GGGA``, the released checkpoints' 3:1 ratio
  (``full_attention_interval=4``) with two attention layers, so vLLM's hybrid manager
  forms several mamba groups, as it does for Qwen3-Next-80B (36 GDN + 12 attention);
* ``qwen3_next_mixed``: ``GAGGA``, an uneven mix (groups of different fill).

Constraints found on vLLM CPU: attention head size
must be one the CPU backend supports (32 here); Qwen3-Next needs bf16 and linear-attention
head dims of 128. Qwen3-Next also needs ``tie_word_embeddings=False``: vLLM 0.32's
``Qwen3NextForCausalLM`` never ties ``lm_head`` to the embeddings and does not complain that
the checkpoint lacks ``lm_head.weight``, so a tied tiny model has a zero head and uniform
logits (every logprob -ln(vocab)). ``initializer_range=0.2`` makes its outputs depend
visibly on the GDN state (with 0.02 a missing state moves the logprobs by ~1e-5 only).
``qwen3_sharp`` is the tiny Qwen3 with ``initializer_range=0.2`` for the same reason: the
0.02 one repeats one token whatever the context, so wrong KV would not change its
greedy output (the stress test compares greedy outputs).

The tokenizer is a WordLevel model trained on a few sentences. Idempotent: a model
directory built by the same recipe (``RECIPE``) is left as it is; an older one is rebuilt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECIPE = 3  # bump when a change must rebuild existing models

HYBRID_LAYOUTS = {"qwen3_next": "GA", "qwen3_next_3to1": "GGGAGGGA", "qwen3_next_mixed": "GAGGA"}

CORPUS = [
    "hello world this is a tiny test",
    "the quick brown fox jumps over the lazy dog",
    "vllm runs on cpu",
    "kv cache connector save and load per layer",
]


def build(kind: str, out: Path, layers: int | None, hidden: int | None, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        CORPUS * 3,
        trainers.WordLevelTrainer(
            special_tokens=["<unk>", "<pad>", "<s>", "</s>"], vocab_size=1024
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    common: dict[str, object] = dict(
        vocab_size=1024,
        hidden_size=hidden or 128,
        intermediate_size=2 * (hidden or 128),
        num_hidden_layers=layers or 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=1,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    extra: dict[str, object] = {}
    model_type = kind
    if kind == "qwen3_small":
        model_type = "qwen3"
        common.update(
            hidden_size=hidden or 512,
            intermediate_size=4 * (hidden or 512),
            num_hidden_layers=layers or 8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=1024,
        )
    if kind == "qwen3_sharp":
        model_type = "qwen3"
        common.update(initializer_range=0.2)
    if kind in HYBRID_LAYOUTS:
        model_type = "qwen3_next"
        layout = HYBRID_LAYOUTS[kind]
        if layers is not None and layers != len(layout):
            raise SystemExit(f"--layers {layers}: {kind} has the fixed layout {layout!r}")
        # A long context lets tests force a block size of several times vLLM's own (hybrid
        # blocks are large: the attention page must hold a whole GDN state).
        common.update(num_hidden_layers=len(layout), max_position_embeddings=16384)
        extra = dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention" if c == "G" else "full_attention" for c in layout],
            tie_word_embeddings=False,
            initializer_range=0.2,
        )
        common.pop("tie_word_embeddings")
    cfg = AutoConfig.for_model(model_type, **common, **extra)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    (out / "ucm_tiny.json").write_text(json.dumps({"kind": kind, "seed": seed, "recipe": RECIPE}))


def built_by_this_recipe(out: Path) -> bool:
    stamp = out / "ucm_tiny.json"
    return stamp.exists() and json.loads(stamp.read_text()).get("recipe") == RECIPE


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["qwen3", "qwen3_sharp", "qwen3_small", *HYBRID_LAYOUTS])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if built_by_this_recipe(args.outdir):
        print(f"{args.outdir}: already built")
        return 0
    build(args.kind, args.outdir, args.layers, args.hidden, args.seed)
    print(f"{args.outdir}: built {args.kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
