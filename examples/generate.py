"""Generate with DFlash speculative decoding.

    python examples/generate.py --target TARGET_DIR --draft DRAFT_DIR --prompt "def fib(n):"

Without --target/--draft it builds a tiny randomly initialised Qwen3 target and drafter (no download) and
says so: the output is then meaningless tokens, but the whole pipeline runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper


def _random_pair(block_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    )
    target = Qwen3ForCausalLM(config).eval()
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=block_size, seed=0)
    return target, draft, None


def _load_pair(target_dir: str, draft_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    return target, draft, AutoTokenizer.from_pretrained(target_dir)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="HF causal LM directory (with its tokenizer)")
    p.add_argument("--draft", help="DFlash drafter directory (config.json + safetensors)")
    p.add_argument("--prompt", default="def fib(n):")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=8, help="block size of the random demo drafter")
    args = p.parse_args(argv)
    if bool(args.target) != bool(args.draft):
        p.error("--target and --draft go together")

    if args.target:
        target, draft, tok = _load_pair(args.target, args.draft)
        input_ids = tok(args.prompt, return_tensors="pt").input_ids
    else:
        print("NOTE: no --target/--draft given: using a tiny RANDOMLY INITIALISED target and drafter "
              "(meaningless tokens, low acceptance); the prompt text is ignored.")
        target, draft, tok = _random_pair(args.block_size)
        input_ids = torch.tensor([[1, 2, 3, 4, 5]])

    spec = DFlashSpecWrapper(target, draft)
    start = time.perf_counter()
    out = spec.generate(input_ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    elapsed = time.perf_counter() - start
    new = out.sequences[0, input_ids.shape[1]:]
    print(tok.decode(out.sequences[0]) if tok else f"tokens: {out.sequences[0].tolist()}")
    print(f"\n{len(new)} new tokens in {elapsed:.2f}s ({len(new) / elapsed:.1f} tokens/s), "
          f"finish reason: {out.finish_reasons[0]}")
    print(f"acceptance length {out.acceptance_length:.2f} over {out.num_drafts} drafts "
          f"(block size {spec.block_size})")
    print("accepted per draft position:", out.num_accepted_tokens_per_pos)


if __name__ == "__main__":
    main()
