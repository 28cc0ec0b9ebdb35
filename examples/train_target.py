"""Train a small code-completion target (and its BPE tokenizer) on the Python standard library's sources.

The corpus is the ``.py`` files of this interpreter's standard library (``sysconfig.get_paths()["stdlib"]``,
Python Software Foundation License, which permits redistribution of derived works), without ``test``/``tests``/
``idlelib`` directories and ``site-packages``. Nothing is downloaded.

    python examples/train_target.py --out dflash_compile/assets/default_pair/target --seed 0

(the defaults are the shipped target's architecture; README, "Training", has the exact commands, seeds and
wall times of the shipped pair) writes an HF ``Qwen3ForCausalLM`` (``save_pretrained``, fp16 safetensors by default) and a byte-level BPE
tokenizer (``AutoTokenizer.from_pretrained`` loads it) to ``--out``. ``--tokenizer DIR`` reuses an existing
tokenizer (e.g. to train a smaller assistant model for HF assisted generation with the same vocabulary).
Training is fp32 on CPU; the model is cast only when saved.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]


def stdlib_files(root: str | None = None) -> list[Path]:
    """The standard library's ``.py`` files (sorted, so the corpus order is reproducible)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
    return sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """A byte-level BPE tokenizer saved as an HF fast tokenizer (``<|endoftext|>`` is eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", mask_token="<|mask|>"
    )
    fast.save_pretrained(out)
    return fast


def build_model(vocab_size: int, args, eos_id: int, pad_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer instead of training one")
    p.add_argument("--init", default=None, help="continue training this saved model (and reuse its tokenizer)")
    p.add_argument("--stdlib", default=None, help="corpus root (default: this interpreter's stdlib)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--max-minutes", type=float, default=None, help="stop early (cosine schedule still set by --steps)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = p.parse_args(argv)

    from tqdm import tqdm
    from transformers import AutoTokenizer

    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files(args.stdlib)
    texts = read_texts(files)
    if args.init and not args.tokenizer:
        args.tokenizer = args.init
    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        tok.save_pretrained(out)
    else:
        tok = train_tokenizer(texts, args.vocab, out)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    pad = tok.convert_tokens_to_ids("<|pad|>")
    ids: list[int] = []
    for t in texts:
        ids.extend(tok(t)["input_ids"])
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    n_val = len(data) // 50
    train, val = data[:-n_val], data[-n_val:]
    print(f"corpus: {len(files)} files, {len(data)} tokens ({time.time() - t0:.0f}s)", flush=True)

    if args.init:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32, attn_implementation="sdpa").train()
    else:
        model = build_model(len(tok), args, eos, pad).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95)
    )
    g = torch.Generator().manual_seed(args.seed)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def batch(src, n):
        starts = torch.randint(0, len(src) - args.seq_len - 1, (n,), generator=g)
        return torch.stack([src[s : s + args.seq_len] for s in starts])

    bar = tqdm(range(args.steps), desc="target", mininterval=5)
    step = 0
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = batch(train, args.batch)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if args.max_minutes and time.time() - t0 > 60 * args.max_minutes:
            print(f"stopping at step {step + 1}: --max-minutes {args.max_minutes} reached", flush=True)
            break
    model.eval()
    with torch.no_grad():
        gv = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, len(val) - args.seq_len - 1, (16,), generator=gv)
        xv = torch.stack([val[s : s + args.seq_len] for s in starts])
        val_loss = model(input_ids=xv, labels=xv).loss.item()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = None
    model.to(getattr(torch, args.dtype)).save_pretrained(out)
    wall = time.time() - t0
    info = dict(vars(args), steps_done=step + 1, train_loss=loss.item(), val_loss=val_loss, params=n_params,
                wall_s=round(wall), python=sys.version.split()[0], torch=torch.__version__,
                corpus=f"Python {sys.version.split()[0]} stdlib sources ({len(files)} files, PSF License)")
    info_file = out / "training_info.json"
    runs = []
    if args.init and info_file.is_file():  # a continued run: keep the earlier runs' records
        prev = json.loads(info_file.read_text())
        runs = prev if isinstance(prev, list) else [prev]
    info_file.write_text(json.dumps(runs + [info], indent=2) + "\n")
    print(f"done: steps {step + 1}, train loss {loss.item():.3f}, val loss {val_loss:.3f}, wall {wall:.0f}s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
