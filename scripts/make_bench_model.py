"""Build a random Qwen3 of benchmark size (0.1-0.5 B parameters) locally, no hub access.

Usage: python scripts/make_bench_model.py qwen3 OUTDIR [--layers 12] [--hidden 1024]
       [--intermediate 3072] [--heads 16] [--kv-heads 8] [--head-dim 128] [--vocab 1024]

Why a second builder: ``make_tiny_model.py`` fixes heads, head size and vocabulary for its
test models; the time-to-first-token benchmark needs a model whose prefill costs what a
real small model's does (Qwen3-0.6B's layer shape by default: hidden 1024, 16 query heads,
8 KV heads of 128, MLP 3072), so every dimension is an argument here. The vocabulary stays
small (the benchmarks feed token ids; the WordLevel tokenizer of ``make_tiny_model`` is
reused) so the parameter count is the layers'. Weights are random (seeded): outputs are
meaningless, compute and KV-cache sizes are real. Idempotent like ``make_tiny_model``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(out: Path, args: argparse.Namespace) -> int:
    """Write the model and tokenizer to ``out``; return the parameter count."""
    import torch
    from make_tiny_model import CORPUS
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(args.seed)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        CORPUS * 3,
        trainers.WordLevelTrainer(
            special_tokens=["<unk>", "<pad>", "<s>", "</s>"], vocab_size=args.vocab
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=8192,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=1,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    (out / "ucm_tiny.json").write_text(
        json.dumps({"kind": "qwen3_bench", "seed": args.seed, "params": params})
    )
    return params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["qwen3"])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if (args.outdir / "ucm_tiny.json").exists():
        print(f"{args.outdir}: already built")
        return 0
    params = build(args.outdir, args)
    print(f"{args.outdir}: built qwen3, {params / 1e6:.0f} M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
