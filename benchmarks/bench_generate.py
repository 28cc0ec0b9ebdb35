"""Eager DFlash step time per batch bucket, and generation tokens/s against ``target.generate``.

    python benchmarks/bench_generate.py [--repeats 3] [--out benchmarks/results]

Everything is measured in one run on one machine, median of ``--repeats``. Until a trained pair ships, the
target is a randomly initialised Qwen3 of the size given, and two drafters bound it from both sides:
- ``random``: a random drafter (acceptance length ~1, the worst case: every step pays verify + draft);
- ``oracle``: the same pair with the target's LM head zeroed, so every logit ties and every draft is
  accepted (acceptance length == block size, the best case). Its target.generate row is measured on the
  zeroed target too.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench_step import step_inputs, time_step

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper


def _target(args, zero_head: bool):
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    if zero_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_times(spec, buckets, prompt_len, repeats):
    """Median eager time of one ``forward`` (verify + accept + propose) per bucket, after prefill."""
    return {b: time_step(spec, step_inputs(spec, b, prompt_len), repeats) for b in buckets}


@torch.no_grad()
def generation(target, spec, prompts, max_new, repeats):
    ids = torch.tensor(prompts)
    hf = _median_time(lambda: target.generate(ids, do_sample=False, max_new_tokens=max_new), repeats)
    res = {}
    dflash = _median_time(lambda: res.setdefault("out", spec.generate(
        ids, max_new_tokens=max_new, return_dict_in_generate=True)), repeats)
    tokens = ids.shape[0] * max_new
    return {
        "hf_generate_tok_s": tokens / hf,
        "dflash_eager_tok_s": tokens / dflash,
        "speedup": hf / dflash,
        "acceptance_length": res["out"].acceptance_length,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())

    results = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
               "args": vars(args), "rows": {}}
    for name, zero_head in (("random", False), ("oracle", True)):
        target = _target(args, zero_head)
        draft = DFlashDraftModel.from_target(target, num_layers=args.draft_layers, block_size=args.block_size, seed=0)
        spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=max(args.buckets),
                                 max_seq_len=args.prompt_len + args.max_new_tokens + 2 * args.block_size)
        params = sum(p.numel() for p in target.parameters()) / 1e6
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, args.vocab - 1, (1, args.prompt_len), generator=g).tolist()
        row = {"target_params_M": round(params, 1),
               "draft_params_M": round(sum(p.numel() for p in draft.parameters()) / 1e6, 1),
               "step_s": step_times(spec, args.buckets, args.prompt_len, args.repeats),
               "batch1": generation(target, spec, prompt, args.max_new_tokens, args.repeats)}
        results["rows"][name] = row
        print(name, json.dumps(row, indent=1))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_generate.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"Machine: {results['machine']}. Target: random Qwen3, {results['rows']['random']['target_params_M']}M "
             f"params, fp32; drafter {args.draft_layers} layers, block {args.block_size}; prompt {args.prompt_len}, "
             f"{args.max_new_tokens} new tokens; median of {args.repeats}.", "",
             "| drafter | " + " | ".join(f"step bucket {b} (ms)" for b in args.buckets)
             + " | HF generate tok/s | DFlash eager tok/s | speed-up | acceptance length |",
             "|---" * (len(args.buckets) + 5) + "|"]
    for name, row in results["rows"].items():
        g = row["batch1"]
        lines.append(f"| {name} | " + " | ".join(f"{row['step_s'][b] * 1e3:.1f}" for b in args.buckets)
                     + f" | {g['hf_generate_tok_s']:.1f} | {g['dflash_eager_tok_s']:.1f} | {g['speedup']:.2f}x"
                     f" | {g['acceptance_length']:.2f} |")
    (out / "bench_generate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
