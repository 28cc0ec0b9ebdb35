"""One screen that shows what DFlash does: the same prompt through HF ``generate`` (greedy) and through the
compiled DFlash step, side by side.

    python examples/demo.py                      # the chat pair (SmolLM2-135M-Instruct), backend dflash: `make demo`
    python examples/demo.py --prompt "How do I make a good cup of tea?" --max-new-tokens 96
    python examples/demo.py --backend eager      # no compile
    python examples/demo.py --target TARGET_DIR --draft DRAFT_DIR [--raw]

A target whose tokenizer has a chat template gets the prompt as a user turn in it (``--raw``: as plain text).

Prints the completion once, tokens/s of each (median of ``--runs`` rounds, the two methods interleaved, after
an untimed warm-up run; one CPU thread by default), the speed-up, whether the two outputs are identical, the
acceptance length and how often each draft position was accepted. The first run compiles the step graph
(``spec.precompile``, a progress bar says how long) and saves it in the compile cache under ``build/dflash-cache``
in the repository (``DFLASH_COMPILE_CACHE_DIR`` overrides); later runs load it in about a second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The compiled step graphs (and the Inductor cache they load from) stay in the repository's ignored build dir.
CACHE_DIR = os.environ.get("DFLASH_COMPILE_CACHE_DIR") or os.path.join(REPO, "build", "dflash-cache")

import torch  # noqa: E402

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper  # noqa: E402
from dflash_compile.runtime.generation import DFlashStats  # noqa: E402

# One of the held-out chat prompts (dflash_compile/assets/chat_prompts.json): the drafter never trained on it.
DEFAULT_PROMPT = "Explain how photosynthesis works in simple terms."
BAR_WIDTH = 30


def _load(target_dir: str | None, draft_dir: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if target_dir is None:
        from dflash_compile.assets import default_pair_paths

        target_dir, draft_dir = (str(p) for p in default_pair_paths())
        where = "the shipped default pair (SmolLM2-135M-Instruct and its DFlash drafter)"
    else:
        where = f"{target_dir} + {draft_dir}"
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(target_dir)
    params = sum(p.numel() for p in target.parameters()) / 1e6
    print(f"{where}: target {type(target).__name__} {params:.2f}M parameters, drafter "
          f"{sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M, block size {draft.block_size}")
    return target, draft, tok


def _interleaved(fns: dict, runs: int) -> dict:
    """``{name: (median wall time, last result)}`` of ``runs`` rounds, each round calling every function once in
    turn, so that a load change on a shared machine hits all of them alike."""
    times, results = {name: [] for name in fns}, {}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), results[name]) for name in fns}


def _histogram(stats: DFlashStats) -> list[str]:
    """One line per draft position: the share of steps in which it was accepted, as a bar."""
    steps = max(1, stats.num_drafts)
    lines = []
    for i, n in enumerate(stats.num_accepted_tokens_per_pos, start=1):
        share = n / steps
        lines.append(f"  draft {i}: {'#' * round(share * BAR_WIDTH):<{BAR_WIDTH}} {share:5.0%}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="HF causal LM directory (with its tokenizer); default: the shipped pair")
    p.add_argument("--draft", help="DFlash drafter directory")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, not in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--backend", default="dflash", choices=("dflash", "eager"),
                   help="dflash: the compiled step (default); eager: no compile")
    p.add_argument("--runs", type=int, default=3, help="timed rounds, each running both methods (median reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: a model this small runs fastest on one core, and a second thread's "
                        "synchronisation costs more than it gives on a shared machine)")
    args = p.parse_args(argv)
    if bool(args.target) != bool(args.draft):
        p.error("--target and --draft go together")
    if args.runs < 1 or args.max_new_tokens < 1 or args.threads < 1:
        p.error("--runs, --max-new-tokens and --threads must be at least 1")
    torch.set_num_threads(args.threads)

    target, draft, tok = _load(args.target, args.draft)
    chat = bool(getattr(tok, "chat_template", None)) and not args.raw
    text = (tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                    add_generation_prompt=True) if chat else args.prompt)
    ids = torch.tensor([tok(text, add_special_tokens=not chat).input_ids])
    n = args.max_new_tokens
    hf_kwargs = dict(max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id,
                     attention_mask=torch.ones_like(ids))

    capacity = ids.shape[1] + n + 2 * draft.block_size
    # A fixed K = block - 1 drafts at every step, so the demo shows each draft position's acceptance, from one step
    # graph. speculation="auto", the default, chooses K per step from the measured step costs and acceptance, with
    # two graphs at batch 1 (plain, and one for every K); with this drafter it decodes plainly on this CPU, faster
    # but with nothing to show here (docs/benchmarks.md).
    spec = DFlashSpecWrapper(target, draft, draft.block_size - 1, max_batch_size=1, max_seq_len=capacity)
    if args.backend == "dflash":
        spec.compile(backend="dflash", cache_dir=CACHE_DIR)
        print(f"the DFlash step with backend 'dflash', compile cache {os.path.relpath(CACHE_DIR)} (first run: "
              f"compiled and saved there; later runs load it):", flush=True)
        spec.precompile(batch_sizes=[1])  # one graph for batch 1, every context length
    gen_kwargs = dict(max_new_tokens=n, pad_token_id=tok.pad_token_id, return_dict_in_generate=True)
    with torch.no_grad():
        spec.generate(ids, **gen_kwargs)  # warm-up
        target.generate(ids, **hf_kwargs)  # warm-up
        timed = _interleaved({"hf": lambda: target.generate(ids, **hf_kwargs),
                              "dflash": lambda: spec.generate(ids, **gen_kwargs)}, args.runs)
    spec.close()
    (hf_time, hf_out), (dflash_time, out) = timed["hf"], timed["dflash"]
    hf_tokens = hf_out[0, ids.shape[1]:].tolist()
    dflash_tokens = out.sequences[0, out.prompt_width:out.prompt_width + out.num_new_tokens[0]].tolist()
    stats = out.per_request[0]

    rule = "-" * 72
    if chat:
        print(f"\n{rule}\nuser: {args.prompt}\nassistant: ", end="")
        print(tok.decode(dflash_tokens, skip_special_tokens=True), end="")
    else:
        print(f"\n{rule}\n{args.prompt}", end="")
        print(tok.decode(dflash_tokens), end="")
    print(f"\n{rule}")
    hf_rate, dflash_rate = len(hf_tokens) / hf_time, len(dflash_tokens) / dflash_time
    label = "DFlash, compiled (backend dflash)" if args.backend == "dflash" else "DFlash, eager"
    print(f"{'HF generate, greedy':<34} {hf_rate:7.1f} tokens/s")
    print(f"{label:<34} {dflash_rate:7.1f} tokens/s   speed-up {dflash_rate / hf_rate:.2f}x")
    print(f"({len(dflash_tokens)} new tokens, median of {args.runs} interleaved runs after a warm-up, batch size 1, "
          f"{torch.get_num_threads()} CPU thread{'s' if torch.get_num_threads() > 1 else ''})")
    identical = dflash_tokens == hf_tokens
    print(f"identical output: {'yes' if identical else 'NO'}")
    print(f"acceptance length {stats.acceptance_length:.2f} tokens per target forward "
          f"({stats.num_drafts} steps, block size {spec.block_size}); draft positions accepted:")
    print("\n".join(_histogram(stats)))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
