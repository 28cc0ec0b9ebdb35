"""Train a small code-completion target (and its BPE tokenizer) on permissively licensed Python sources.

``--corpus stdlib`` (default) is the ``.py`` files of this interpreter's standard library (Python Software
Foundation License); ``--corpus stdlib+packages`` adds the ``.py`` files of every installed distribution whose
metadata declares a permissive licence (``dflash_compile.training.corpus``: tests, vendored, generated,
non-UTF-8 and duplicate files left out). A fixed share of the files (``--held-out``, chosen by a hash of the
seed and the file) is held out for the held-out loss. The corpus manifest (package, version, licence, files,
bytes, tokens) is written to ``OUT/corpus_manifest.json``. Nothing is downloaded.

    python examples/train_target.py --out dflash_compile/assets/tiny_pair/target --seed 0

(the defaults are the shipped target's architecture; README, "Training", has the exact commands, seeds and
wall times of the shipped pair) writes an HF ``Qwen3ForCausalLM`` (``save_pretrained``, fp16 safetensors by default) and a byte-level BPE
tokenizer (``AutoTokenizer.from_pretrained`` loads it) to ``--out``. ``--tokenizer DIR`` reuses an existing
tokenizer (e.g. to train a smaller assistant model for HF assisted generation with the same vocabulary).
Training is fp32 on CPU; the model is cast only when saved.

Long runs: ``--checkpoint-every N`` writes ``OUT/checkpoints/step_*.pt`` (model, optimizer, step, generator and
RNG states, loss history; loadable with ``torch.load(weights_only=True)``) and refreshes the saved model in
``OUT``; ``--max-minutes`` stops with a checkpoint; ``--resume`` continues from the latest checkpoint exactly
(same batches, same weights as an uninterrupted run), with every setting taken from the checkpoint except
``--max-minutes``, ``--stop-at``, ``--checkpoint-every`` and, if given, ``--steps`` (which re-spans the cosine).
"""

from __future__ import annotations

import argparse
import json
import copy
import hashlib
import math
import random
import sys
import time
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]


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


_CKPT_DIR = "checkpoints"
# Settings a resumed run may change; every other one comes from the checkpoint.
_RESUME_OVERRIDES = ("max_minutes", "stop_at", "checkpoint_every", "steps")


def latest_checkpoint(out) -> Path | None:
    ckpts = sorted(Path(out, _CKPT_DIR).glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return ckpts[-1] if ckpts else None


def save_checkpoint(out: Path, keep: int, **state) -> Path:
    """Only tensors, numbers and strings (``torch.load(weights_only=True)`` reads it back)."""
    d = out / _CKPT_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{state['step']:08d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    for old in sorted(d.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))[:-keep]:
        old.unlink()
    return path


def _load_token_cache(out: Path, fingerprint: str, tokenizer_hash: str | None = None) -> dict | None:
    cache = out / "corpus_tokens.pt"
    if not cache.is_file():
        return None
    c = torch.load(cache, weights_only=True)
    if c["fingerprint"] != fingerprint or (tokenizer_hash is not None and c["tokenizer"] != tokenizer_hash):
        return None
    return c


def tokenize_corpus(corpus, tok, eos: int, out: Path):
    """``(train, held_out, manifest)``: token streams (documents joined by eos) and the manifest with token
    counts, cached in ``OUT/corpus_tokens.pt`` under the corpus fingerprint and the tokenizer's hash."""
    tok_hash = hashlib.sha256(Path(out, "tokenizer.json").read_bytes()).hexdigest()[:16]
    c = _load_token_cache(out, corpus.fingerprint(), tok_hash)
    if c is not None:
        return c["train"], c["held_out"], json.loads(c["manifest"])
    dtype = torch.int16 if len(tok) <= 2**15 else torch.int32
    streams = {False: [], True: []}
    by_pkg = {rec.package: rec for rec in corpus.packages}
    docs = corpus.documents
    for i in range(0, len(docs), 256):
        chunk = docs[i : i + 256]
        for d, ids in zip(chunk, tok([d.text for d in chunk])["input_ids"]):
            streams[d.held_out].append(torch.tensor(ids + [eos], dtype=dtype))
            by_pkg[d.package].tokens += len(ids) + 1
    train, held = torch.cat(streams[False]), torch.cat(streams[True])
    manifest = corpus.manifest()
    tmp = out / "corpus_tokens.tmp"
    torch.save({"fingerprint": corpus.fingerprint(), "tokenizer": tok_hash, "train": train, "held_out": held,
                "manifest": json.dumps(manifest)}, tmp)
    tmp.replace(out / "corpus_tokens.pt")
    return train, held, manifest


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer instead of training one")
    p.add_argument("--init", default=None, help="continue training this saved model (and reuse its tokenizer)")
    p.add_argument("--corpus", default="stdlib", choices=["stdlib", "stdlib+packages", "packages"])
    p.add_argument("--stdlib", default=None, help="stdlib root (default: this interpreter's)")
    p.add_argument("--held-out", type=float, default=0.02, help="share of corpus files held out (by file)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600, help="length of the LR schedule")
    p.add_argument("--max-minutes", type=float, default=None, help="stop early, with a checkpoint")
    p.add_argument("--stop-at", type=int, default=None, help="stop at this step, with a checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints (exactly)")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows for the held-out loss")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    import transformers
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from dflash_compile.training.corpus import build_corpus, manifest_markdown

    transformers.utils.logging.disable_progress_bar()  # save_pretrained's per-shard bar, at every checkpoint
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = latest_checkpoint(out) if args.resume else None
    ckpt = torch.load(ckpt_path, weights_only=True) if ckpt_path else None
    if ckpt is not None:
        given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
        saved = json.loads(ckpt["args"])
        for k, v in saved.items():
            if k in ("max_minutes", "stop_at"):  # limits of this invocation only
                continue
            if k not in _RESUME_OVERRIDES or k not in given:
                setattr(args, k, v)
        args.resume = True
        print(f"resuming from {ckpt_path} at step {int(ckpt['step'])}", flush=True)
    elif args.resume:
        print(f"--resume: no checkpoint under {out / _CKPT_DIR}, starting from scratch", flush=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    cache = _load_token_cache(out, ckpt["corpus_fingerprint"]) if ckpt is not None else None
    if cache is not None:  # resume from the run's own token streams, whatever is installed today
        tok = AutoTokenizer.from_pretrained(out)
        train, val, manifest = cache["train"], cache["held_out"], json.loads(cache["manifest"])
    else:
        corpus = build_corpus(args.corpus, seed=args.seed, held_out_fraction=args.held_out, stdlib_root=args.stdlib)
        if ckpt is not None and ckpt["corpus_fingerprint"] != corpus.fingerprint():
            raise SystemExit(f"the corpus changed since the checkpoint ({corpus.fingerprint()} != "
                             f"{ckpt['corpus_fingerprint']}) and OUT/corpus_tokens.pt is gone: cannot resume exactly")
        if args.init and not args.tokenizer:
            args.tokenizer = args.init
        if ckpt is not None or (args.tokenizer and Path(args.tokenizer).resolve() == out.resolve()):
            tok = AutoTokenizer.from_pretrained(out)
        elif args.tokenizer:
            tok = AutoTokenizer.from_pretrained(args.tokenizer)
            tok.save_pretrained(out)
        else:
            tok = train_tokenizer([d.text for d in corpus.documents if not d.held_out], args.vocab, out)
        train, val, manifest = tokenize_corpus(corpus, tok, tok.convert_tokens_to_ids("<|endoftext|>"), out)
    (out / "corpus_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "corpus_manifest.md").write_text(manifest_markdown(manifest) + "\n")
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    pad = tok.convert_tokens_to_ids("<|pad|>")
    print(f"corpus {args.corpus}: {len(manifest['packages'])} packages, {manifest['files']} files "
          f"({manifest['held_out_files']} held out), {len(train)} train + {len(val)} held-out tokens "
          f"({time.time() - t0:.0f}s)", flush=True)

    if args.init:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32, attn_implementation="sdpa").train()
    else:
        model = build_model(len(tok), args, eos, pad).train()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = None
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95)
    )
    g = torch.Generator().manual_seed(args.seed)
    step, losses, val_history, tokens_seen = 0, [], [], 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        g.set_state(ckpt["generator"])
        torch.set_rng_state(ckpt["torch_rng"])
        step, tokens_seen = int(ckpt["step"]), int(ckpt["tokens_seen"])
        losses = ckpt["losses"].tolist()
        val_history = [tuple(r) for r in ckpt["val_history"].tolist()]
        del ckpt

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def batch(src, n):
        starts = torch.randint(0, len(src) - args.seq_len - 1, (n,), generator=g)
        return torch.stack([src[s : s + args.seq_len] for s in starts]).long()

    gv = torch.Generator().manual_seed(1234)  # the same held-out windows in every run and every evaluation
    val_starts = torch.randint(0, len(val) - args.seq_len - 1, (args.eval_windows,), generator=gv)
    val_windows = torch.stack([val[s : s + args.seq_len] for s in val_starts]).long()

    @torch.no_grad()
    def held_out_loss() -> float:
        model.eval()
        total = sum(model(input_ids=x, labels=x).loss.item() * len(x) for x in val_windows.split(16))
        model.train()
        return total / len(val_windows)

    def save_model():
        copy.deepcopy(model).to(getattr(torch, args.dtype)).save_pretrained(out)

    def checkpoint():
        save_checkpoint(
            out, args.keep_checkpoints, step=step, model=model.state_dict(), optimizer=opt.state_dict(),
            generator=g.get_state(), torch_rng=torch.get_rng_state(), tokens_seen=tokens_seen,
            losses=torch.tensor(losses, dtype=torch.float64),
            val_history=torch.tensor(val_history, dtype=torch.float64).reshape(-1, 2),
            args=json.dumps(vars(args)), corpus_fingerprint=manifest["fingerprint"], elapsed_s=time.time() - t0,
        )
        save_model()

    def recent_loss():
        tail = losses[-50:]
        return sum(tail) / max(1, len(tail))

    first_step, t_train = step, time.time()
    bar = tqdm(total=args.steps, initial=step, desc="target", mininterval=30, disable=args.no_progress)
    stopped = "steps"
    while step < args.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = batch(train, args.batch)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        losses.append(loss.item())
        tok_s = (step - first_step) * x.numel() / (time.time() - t_train)
        bar.set_postfix(loss=f"{recent_loss():.3f}", tok_s=f"{tok_s:.0f}", lr=f"{lr_at(step - 1):.1e}", refresh=False)
        bar.update(1)
        stopped = None if step < args.steps else "steps"
        if args.stop_at is not None and step >= args.stop_at and step < args.steps:
            stopped = f"--stop-at {args.stop_at}"
        elif args.max_minutes is not None and time.time() - t0 > 60 * args.max_minutes and step < args.steps:
            stopped = f"--max-minutes {args.max_minutes}"
        if stopped or (args.checkpoint_every and step % args.checkpoint_every == 0):
            val_history.append((step, held_out_loss()))
            checkpoint()
            bar.write(f"step {step}: loss {recent_loss():.3f} (mean of last 50), held-out {val_history[-1][1]:.3f}, "
                      f"{tok_s:.0f} tokens/s, {tokens_seen / 1e6:.1f}M tokens seen, {time.time() - t0:.0f}s")
            sys.stdout.flush()
        if stopped:
            break
    bar.close()
    if not val_history or val_history[-1][0] != step:  # e.g. --resume of a finished run
        val_history.append((step, held_out_loss()))
        save_model()
    wall = time.time() - t0
    if stopped != "steps":
        print(f"stopping at step {step}/{args.steps}: {stopped} (--resume to continue)", flush=True)
    info = dict(vars(args), steps_done=step, train_loss=recent_loss(), val_loss=val_history[-1][1],
                val_history=[[int(s), round(v, 4)] for s, v in val_history], params=n_params, wall_s=round(wall),
                session_steps=step - first_step, tokens_seen=tokens_seen,
                tokens_per_s=round((step - first_step) * args.batch * args.seq_len / max(1e-9, time.time() - t_train)),
                python=sys.version.split()[0], torch=torch.__version__,
                corpus={k: manifest[k] for k in ("spec", "files", "held_out_files", "bytes", "tokens", "fingerprint")}
                | {"licences": sorted({p["license"] for p in manifest["packages"]}), "manifest": "corpus_manifest.json"})
    info_file = out / "training_info.json"
    runs = []
    if (args.init or args.resume) and info_file.is_file():  # a continued run: keep the earlier runs' records
        prev = json.loads(info_file.read_text())
        runs = prev if isinstance(prev, list) else [prev]
    info_file.write_text(json.dumps(runs + [info], indent=2) + "\n")
    print(f"done: step {step}, train loss {recent_loss():.3f}, held-out loss {val_history[-1][1]:.3f}, "
          f"wall {wall:.0f}s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
