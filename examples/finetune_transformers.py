"""Train (or fine-tune) a Hugging Face transformers MoE model with moeblaze's experts.

    python examples/finetune_transformers.py                          # a small Qwen3-MoE from its config
    python examples/finetune_transformers.py --model-type olmoe --set hidden_size=256 --set num_experts=16
    python examples/finetune_transformers.py --model-type deepseek_v3               # MLA, groups, shared expert
    python examples/finetune_transformers.py --model-path /path/to/Qwen3-30B-A3B --device cuda --precision bf16

Built from a config (no hub access), the model is byte-level (vocab_size 256) and trains on the same text
as ``moeblaze train`` (``moeblaze.training.data``: the standard library's ``.py`` files, or ``--data PATH``). With
``--model-path`` the weights and tokenizer are loaded from that folder and the text is tokenized with it.
Either way the routed experts run on moeblaze (``experts_implementation="moeblaze"``); transformers'
router and its load-balancing loss (``output_router_logits=True``) are kept as they are.
"""

from __future__ import annotations

import argparse
import ast
import math
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import moeblaze.integrations.transformers  # registers experts_implementation="moeblaze"
from moeblaze.training.data import eval_windows, get_batch, load_corpus

# A small shape that trains on a laptop CPU (Qwen3-MoE / OLMoE / Mixtral / GPT-OSS field names); --set overrides
# any field.
SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             moe_intermediate_size=128, intermediate_size=256, num_experts=8, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=1024, vocab_size=256, tie_word_embeddings=False)
# Families that name their MoE fields otherwise: every layer an MoE layer, 8 routed experts, their attention
# dimensions small and consistent (DeepSeek-V3's multi-head latent attention has its own head sizes).
FAMILY = {
    "deepseek_v3": dict(n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0,
                        q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                        head_dim=16, num_key_value_heads=4),
    "glm4_moe": dict(n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0),
}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-type", default="qwen3_moe", help="a transformers model_type (built from its config)")
    p.add_argument("--model-path", help="load config, weights and tokenizer from this folder instead")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--experts", default="moeblaze", help="experts_implementation (moeblaze, grouped_mm, eager)")
    p.add_argument("--data", help="text file or folder (default: the standard library's .py files)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS),
                   help="the model's parameter dtype (bf16: parameters and optimizer state in bf16)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _value(text: str):
    """A ``--set`` value: a Python literal (2048, 1e-6, True, [1, 2]) or else the string itself (silu)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, AutoTokenizer | None]:
    """The model (experts on ``args.experts``, router logits on for the aux loss) and its tokenizer (None: bytes)."""
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    dtype = PRECISIONS[args.precision]
    if args.model_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype, experts_implementation=args.experts,
                                                     **overrides)
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    else:
        config = AutoConfig.for_model(args.model_type, **{**SMALL, **FAMILY.get(args.model_type, {}), **overrides})
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=args.experts)
        tokenizer = None
    if not any(hasattr(m, "has_gate") for m in model.modules()):  # transformers' fused experts modules
        raise SystemExit(f"{type(model).__name__} has no transformers experts module (no MoE layers with this "
                         f"configuration): nothing would run on {args.experts}")
    if args.experts == "moeblaze":
        moeblaze.integrations.transformers.prepare(model)  # an experts module moeblaze cannot run fails now
    return model, tokenizer


def load_tokens(args: argparse.Namespace, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation token arrays: the corpus bytes, or its text tokenized by ``tokenizer``."""
    corpus = load_corpus(args.data, min_bytes=args.seq_len + 2)
    print(f"data: {corpus.source}: {len(corpus.train):,} train / {len(corpus.val):,} validation bytes")
    if tokenizer is None:
        return corpus.train, corpus.val
    tok = lambda a: np.asarray(tokenizer(a.tobytes().decode("utf-8", "replace"))["input_ids"], dtype=np.int64)
    train, val = tok(corpus.train), tok(corpus.val)
    for name, tokens in (("train", train), ("validation", val)):
        # transformers 5.17 loads a folder without tokenizer files as an empty tokenizer that maps text to no tokens
        if len(tokens) < args.seq_len + 2:
            raise SystemExit(f"--model-path {args.model_path}: its tokenizer made {len(tokens):,} tokens of the "
                             f"{name} text, fewer than --seq-len + 2 = {args.seq_len + 2} (does the folder hold "
                             f"the tokenizer's files?)")
    return train, val


@torch.no_grad()
def evaluate(model, val: np.ndarray, args) -> float:
    """Mean next-token loss (nats) over fixed validation windows (aux loss not included)."""
    model.eval()
    losses = [model(input_ids=x.to(args.device), labels=x.to(args.device)).loss.item()
              for x, _ in eval_windows(val, args.eval_tokens, args.seq_len, args.batch_size)]
    model.train()
    return sum(losses) / len(losses)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    model, tokenizer = build_model(args)
    model.to(args.device).train()
    model.config.output_router_logits = True  # transformers adds router_aux_loss_coef * its aux loss to .loss
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n_params / 1e6:.2f}M parameters, experts_implementation="
          f"{model.config._experts_implementation}, {args.precision} on {args.device}")
    train, val = load_tokens(args, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    losses, t0, tokens = [], time.perf_counter(), 0
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # warm-up, cosine
        for group in opt.param_groups:
            group["lr"] = lr
        x, _ = get_batch(train, step, args.batch_size, args.seq_len, args.seed)
        x = x.to(args.device)
        loss = model(input_ids=x, labels=x).loss  # labels are shifted inside transformers
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        tokens += x.numel()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            dt = time.perf_counter() - t0
            print(f"step {step + 1:5d}  loss {losses[-1]:.4f}  lr {lr:.2e}  {tokens / dt:,.0f} tokens/s")
    val_loss = evaluate(model, val, args)
    unit = "bits/byte" if tokenizer is None else "bits/token"
    print(f"validation loss {val_loss:.4f} nats = {val_loss / math.log(2):.3f} {unit}")
    return losses


if __name__ == "__main__":
    main()
