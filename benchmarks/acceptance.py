"""Acceptance length of a DFlash pair on HumanEval prompts, the held-out chat prompts and the drafter's own
training data.

    python benchmarks/acceptance.py [--target DIR --draft DIR | --pair-revision REV] [--first 0 --last 39] \\
        [--max-new 128] [--chat N] [--data build/dflash_data/dflash_data_KEY.pt --data-rows 64] [--json OUT.json]

A target whose tokenizer has a chat template gets each HumanEval task as a chat request ("Complete the following
Python function", benchmarks/bench_humaneval.py's ``benchmark_prompts``), and ``--chat N`` adds the first ``N``
held-out chat prompts (dflash_compile/assets/chat_prompts.json).

Greedy, batch 1 (each prompt alone, so nothing depends on padding), ``--max-new`` new tokens (stopping at
eos). Reports the acceptance length (1 + accepted drafts / steps, summed over the prompts), the share of steps
in which each draft position was accepted, and each prompt's own acceptance length. ``--data`` also measures
on the first ``--data-rows`` prompts of a drafter dataset cache (``training/data.py``): the drafter's own
distribution, for comparison. Every output is checked token for token against ``target.generate``.
Acceptance lengths do not depend on the machine; nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def measure(spec, target, prompts: list[list[int]], max_new: int, desc: str) -> dict:
    from tqdm import tqdm

    from dflash_compile.runtime.generation import DFlashStats

    per_prompt, stats = [], []
    for ids in tqdm(prompts, desc=desc, mininterval=10):
        x = torch.tensor([ids])
        out = spec.generate(x, max_new_tokens=max_new, return_dict_in_generate=True)
        ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new)
        n = min(out.sequences.shape[1], ref.shape[1])
        if not torch.equal(out.sequences[:, :n], ref[:, :n]):
            raise SystemExit(f"{desc}: DFlash output differs from target.generate on prompt {len(stats)}: a bug")
        stats.append(out.per_request[0])
        per_prompt.append(round(out.per_request[0].acceptance_length, 3))
    total = DFlashStats.total(stats, spec.num_speculative_tokens)
    return {
        "prompts": len(prompts),
        "acceptance_length": round(total.acceptance_length, 3),
        "steps": total.num_drafts,
        "accepted_per_position": [round(n / max(1, total.num_drafts), 3) for n in total.num_accepted_tokens_per_pos],
        "per_prompt": per_prompt,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--pair-revision", default=None, help="the default pair at this git revision (benchmarks/pairs.py)")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--last", type=int, default=39)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--rstrip", action="store_true",
                   help="strip the prompts' trailing newline (README, \"Training\": a bare newline token means "
                        "column 0)")
    p.add_argument("--chat", type=int, default=0, help="also the first N held-out chat prompts (a chat target)")
    p.add_argument("--data", default=None, help="a drafter dataset cache (.pt) to measure on as well")
    p.add_argument("--data-rows", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
    from dflash_compile.training.data import DraftDataset
    from dflash_compile.training.loops import humaneval_prompts
    from pairs import resolve_pair

    target_dir, draft_dir = resolve_pair(args.target, args.draft, args.pair_revision)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=1)
    report = {"target": str(target_dir), "draft": str(draft_dir), "block_size": spec.block_size,
              "max_new": args.max_new}
    with torch.no_grad():
        chat = bool(getattr(tok, "chat_template", None))
        if chat:
            from bench_humaneval import benchmark_prompts

            texts = benchmark_prompts("humaneval", args.last + 1, tok, True)[args.first:]
            enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731  (the template has them)
        else:
            texts = humaneval_prompts(args.first, args.last, rstrip=args.rstrip)
            enc = lambda t: tok(t)["input_ids"]  # noqa: E731
        report["humaneval"] = dict(measure(spec, target, [enc(t) for t in texts], args.max_new, "HumanEval"),
                                   first=args.first, last=args.last, rstrip=args.rstrip, chat_template=chat)
        if args.chat:
            from bench_humaneval import benchmark_prompts

            texts = benchmark_prompts("chat", args.chat, tok, True)
            report["chat"] = dict(measure(spec, target, [enc(t) for t in texts], args.max_new, "chat"))
        if args.data:
            ds = DraftDataset.load(args.data)
            rows = ds.tokens[: args.data_rows, : ds.prompt_len].tolist()
            report["own_data"] = dict(measure(spec, target, rows, args.max_new, "own data"), path=args.data)
    spec.close()
    report["wall_s"] = round(time.time() - t0, 1)
    for name in ("humaneval", "chat", "own_data"):
        if name in report:
            r = report[name]
            print(f"{name}: acceptance length {r['acceptance_length']:.2f} over {r['prompts']} prompts "
                  f"({r['steps']} steps, block size {spec.block_size}); per position {r['accepted_per_position']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
