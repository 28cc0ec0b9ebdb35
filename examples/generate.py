"""Generate with DFlash speculative decoding (greedy or lossless speculative sampling).

    python examples/generate.py --target TARGET_DIR --draft DRAFT_DIR --prompt "def fib(n):"
    python examples/generate.py --prompts-file prompts.jsonl --temperature 0.8 --top-p 0.95 --seed 1 --batch-size 4
    python examples/generate.py --prompt "def fib(n):" --stream --backend dflash
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --backend dflash   # the target split over 2 ranks

Without --target/--draft it uses the shipped default pair (SmolLM2-135M-Instruct and its DFlash drafter) when it
is installed;
until then a tiny randomly initialised Qwen3 target and drafter (no download, no tokenizer: the prompt's UTF-8
bytes are the token ids and token ids are printed), and says so: the output is then meaningless tokens, but
the whole pipeline runs. A prompts file has one JSON object per line with a "prompt" field (or a JSON string).
Bad input (an argument out of range, a prompts file that is missing or malformed, a missing model directory) is one
line on stderr and exit status 2.

With --tp N, under torchrun with N processes (on one machine or several: torchrun's --nnodes and c10d rendezvous),
the target is loaded with transformers' tensor-parallel plan (tp_plan="auto"; needs the accelerate package) and
every rank runs the same generation; rank 0 prints. See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter

BACKENDS = ("eager", "dflash", "dflash_neuron")


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return name


def _random_pair(block_size: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_compile import DFlashDraftModel

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    )
    target = Qwen3ForCausalLM(config).eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    # no tokenizer: the last id is the mask token (the prompt's UTF-8 bytes are the token ids, all below 256)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=block_size, seed=0, mask_token_id=511)
    return target, draft, None


class _Parser(argparse.ArgumentParser):
    """``error`` is one line on stderr (no usage block) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {_one_line(message)}\n")


def _one_line(message) -> str:
    return " ".join(str(message).split())


def _check_ranges(p, args) -> None:
    checks = [
        ("--max-new-tokens", args.max_new_tokens >= 1, "an integer >= 1"),
        ("--temperature", math.isfinite(args.temperature) and args.temperature >= 0, "a number >= 0 (0: greedy)"),
        ("--top-k", args.top_k >= 0, "an integer >= 0 (0: off)"),
        ("--top-p", 0 < args.top_p <= 1, "in (0, 1] (1: off)"),
        ("--batch-size", args.batch_size >= 1, "an integer >= 1"),
        ("--block-size", args.block_size >= 2, "an integer >= 2"),
        ("--num-speculative-tokens", args.num_speculative_tokens is None or args.num_speculative_tokens >= 0,
         "an integer >= 0 (0: plain decoding)"),
        ("--tp", args.tp >= 1, "an integer >= 1"),
    ]
    for flag, ok, wanted in checks:
        if not ok:
            p.error(f"{flag} must be {wanted}, got {getattr(args, flag[2:].replace('-', '_'))}")
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path and not os.path.isdir(path):
            p.error(f"{flag} {path}: no such directory")


def _loaded(p, flag: str, load):
    """``load()``, or one line naming ``flag`` when the directory does not hold what it should."""
    try:
        return load()
    except (OSError, ValueError) as e:
        p.error(f"{flag}: cannot load it: {e}")


def _load_pair(p, target_dir: str, draft_dir: str, tp: int = 1):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_compile import DFlashDraftModel
    from dflash_compile.runtime.target_check import check_tokenizer

    split = {"tp_plan": "auto"} if tp > 1 else {}
    target = _loaded(p, "--target",
                     lambda: AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, **split).eval())
    draft = _loaded(p, "--draft", lambda: DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
                    ) if draft_dir else None
    tok = _loaded(p, "--target", lambda: AutoTokenizer.from_pretrained(target_dir))
    _loaded(p, "--target", lambda: check_tokenizer(tok, target))
    return target, draft, tok


def _load_split(target_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, tp_plan="auto").eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    return target


def _start_ranks(p, tp: int) -> None:
    """Join torchrun's process group (``init_distributed``: gloo on CPU, the collective timeout of
    ``$DFLASH_TP_TIMEOUT``); ranks other than 0 print nothing."""
    from dflash_compile.runtime.distributed import init_distributed

    try:
        rank, world = init_distributed()
    except RuntimeError as e:
        p.error(f"--tp {tp}: {e}")
    if world != tp:
        p.error(f"--tp {tp}, but torchrun started {world} processes: give --nproc-per-node (times --nnodes) = {tp}")
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process


def _default_pair_dirs():
    """``(target_dir, draft_dir)`` of the shipped default pair, or None while it is not there."""
    from dflash_compile.assets import default_pair_paths

    try:
        return tuple(str(d) for d in default_pair_paths())
    except FileNotFoundError:
        return None


def _read_prompts(p, args) -> list[str]:
    """The prompts; a prompts file that cannot be read or holds a malformed line is ``p.error`` (with its line)."""
    if not args.prompts_file:
        if not args.prompt:
            p.error("--prompt is empty")
        return [args.prompt]
    name = args.prompts_file
    try:
        with open(name, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        p.error(f"--prompts-file {name}: cannot read it: {e.strerror or e}")
    except UnicodeDecodeError as e:
        p.error(f"--prompts-file {name}: not UTF-8 text: {e}")
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            p.error(f"--prompts-file {name}:{n}: not JSON: {e.msg} (column {e.colno})")
        if isinstance(item, dict):
            if "prompt" not in item:
                p.error(f'--prompts-file {name}:{n}: no "prompt" field')
            item = item["prompt"]
        if not isinstance(item, str):
            p.error(f'--prompts-file {name}:{n}: expected {{"prompt": "..."}} or a JSON string, got '
                    f"{type(item).__name__}")
        if not item:
            p.error(f"--prompts-file {name}:{n}: the prompt is empty")
        prompts.append(item)
    if not prompts:
        p.error(f"--prompts-file {name}: no prompts in it")
    return prompts


def _generate(p, flag, spec, inputs, max_new_tokens, pad, **kwargs):
    """``spec.generate``; a prompt the pair cannot take (too long, tokens outside the vocabulary) is ``p.error``
    (generate validates its arguments before any model work)."""
    try:
        return spec.generate(inputs, max_new_tokens=max_new_tokens, pad_token_id=pad, return_dict_in_generate=True,
                             **kwargs)
    except ValueError as e:
        p.error(f"{flag}: {e}")


class _IdStreamer:
    """Streams token ids (the random pair has no tokenizer)."""

    def __init__(self):
        self.prompt = True

    def put(self, value):
        if self.prompt:
            self.prompt = False
            return
        print(" ".join(map(str, value.flatten().tolist())), end=" ", flush=True)

    def end(self):
        print(flush=True)


def main(argv=None) -> None:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="HF causal LM directory (with its tokenizer)")
    p.add_argument("--draft", help="DFlash drafter directory (config.json + safetensors)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="def fib(n):")
    src.add_argument("--prompts-file", help="JSONL: one {\"prompt\": ...} per line")
    p.add_argument("--raw", action="store_true",
                   help="send prompts as plain text even when the tokenizer has a chat template (default: one user "
                        "turn each in it)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--backend", default="eager", help=f"one of {', '.join(BACKENDS)}")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted (one prompt at a time)")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together")
    p.add_argument("--block-size", type=int, default=8, help="block size of the random demo drafter (>= 2)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="K, the drafts every step verifies (0: plain decoding); default: chosen per step (auto)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: run under `torchrun --nproc-per-node N` (or --nnodes) with --tp N")
    p.add_argument("--speculative-config", default=None,
                   help='vLLM-style JSON, e.g. \'{"method": "dflash", "model": DRAFTER_DIR, "num_speculative_tokens": 4}\' '
                        "(the drafter comes from it; --draft is not needed)")
    args = p.parse_args(argv)
    if bool(args.target) != bool(args.draft) and not (args.target and args.speculative_config):
        p.error("--target and --draft go together (or --target with --speculative-config)")
    try:
        check_backend(args.backend)
    except ValueError as e:
        p.error(f"--backend: {e}")
    _check_ranges(p, args)
    prompts = _read_prompts(p, args)
    # Imported once the arguments are checked: a bad one is reported at once, not after loading torch.
    from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
    from dflash_compile.runtime.generation import DFlashStats

    if args.tp > 1:
        _start_ranks(p, args.tp)

    if not args.target and _default_pair_dirs():
        args.target, args.draft = _default_pair_dirs()
        print(f"using the shipped default pair ({args.target}, {args.draft})")
    if args.target:
        target, draft, tok = _load_pair(p, args.target, args.draft, args.tp)
        if getattr(tok, "chat_template", None) and not args.raw:  # a chat model: each prompt is one user turn
            prompts = [tok.apply_chat_template([{"role": "user", "content": x}], tokenize=False,
                                               add_generation_prompt=True) for x in prompts]
            inputs = [tok(x, add_special_tokens=False).input_ids for x in prompts]
        else:
            inputs = [tok(x).input_ids for x in prompts]
    else:
        print("NOTE: no --target/--draft given and no default pair shipped yet: using a tiny RANDOMLY INITIALISED "
              "random pair (target + drafter; meaningless tokens, low acceptance; no tokenizer: prompt bytes are "
              "the token ids, token ids are printed).")
        target, draft, tok = _random_pair(args.block_size)
        if args.tp > 1:  # the same seeded target on every rank, reloaded with the tensor-parallel plan
            with tempfile.TemporaryDirectory() as d:
                # every rank writes its own copy (save_pretrained writes on rank 0 only once a group exists)
                from safetensors.torch import save_file

                target.config.to_json_file(os.path.join(d, "config.json"))
                save_file({k: v.detach().clone().contiguous() for k, v in target.state_dict().items()},
                          os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
                target = _load_split(d)
            draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=args.block_size, seed=0,
                                                 mask_token_id=511)
        inputs = [list(x.encode("utf-8")) for x in prompts]

    sampling = dict(do_sample=args.temperature > 0)
    if args.temperature > 0:
        sampling.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.speculative_config:
        try:
            spec = DFlashSpecWrapper.from_speculative_config(target, args.speculative_config,
                                                             max_batch_size=args.batch_size)
        except (ValueError, OSError) as e:
            p.error(f"--speculative-config: {e}")
    else:
        block = draft.block_size
        if args.num_speculative_tokens is not None and args.num_speculative_tokens > block - 1:
            p.error(f"--num-speculative-tokens must be in [0, {block - 1}] for a drafter of block size {block}, "
                    f"got {args.num_speculative_tokens}")
        try:
            spec = DFlashSpecWrapper(target, draft, args.num_speculative_tokens, max_batch_size=args.batch_size)
        except ValueError as e:
            p.error(f"{'--target/--draft' if args.target else '--block-size'}: {e}")
    if args.backend != "eager":
        spec.compile(backend=args.backend, fullgraph=True)
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.generation_config.eos_token_id if isinstance(target.generation_config.eos_token_id, int) else 0

    source = "--prompts-file" if args.prompts_file else "--prompt"
    start = time.perf_counter()
    if args.stream:  # HF streamers take batch size 1: one prompt at a time
        outs = []
        for ids in inputs:
            if tok is not None:
                from transformers import TextStreamer

                streamer = TextStreamer(tok, skip_prompt=False)
            else:
                streamer = _IdStreamer()
            outs.append(_generate(p, source, spec, [ids], args.max_new_tokens, pad, streamer=streamer, **sampling))
    else:
        outs = [_generate(p, source, spec, inputs, args.max_new_tokens, pad, **sampling)]
    elapsed = time.perf_counter() - start

    rows = [(o, i) for o in outs for i in range(o.sequences.shape[0])]
    for k, (o, i) in enumerate(rows):
        if args.stream:
            print(f"--- [{k}] finish reason: {o.finish_reasons[i]}")
            continue
        seq = o.sequences[i].tolist()
        seq = seq[: len(seq) - (o.sequences.shape[1] - o.prompt_width - o.num_new_tokens[i])]  # drop end padding
        text = tok.decode(seq, skip_special_tokens=True) if tok else f"tokens: {seq}"
        print(f"--- [{k}] finish reason: {o.finish_reasons[i]}\n{text}")
    total = DFlashStats.total([o.per_request[i] for o, i in rows], spec.num_speculative_tokens)
    generated = sum(o.num_new_tokens[i] for o, i in rows)
    mode = (f"sampling T={args.temperature} top_k={args.top_k} top_p={args.top_p} seed={args.seed}"
            if args.temperature > 0 else "greedy")
    print(f"\n{generated} new tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tokens/s), "
          f"backend {args.backend}, {mode}")
    shares = ", ".join(f"K={k}: {n}" for k, n in sorted(Counter(total.step_ks).items()))
    print(f"acceptance length {total.acceptance_length:.2f} over {total.num_drafts} drafts "
          f"(block size {spec.block_size}; speculation {spec.policy.describe()}; steps per K: {shares})")
    print("accepted per draft position:", total.num_accepted_tokens_per_pos)
    spec.close()
    if args.tp > 1:  # every rank done before the group (and rank 0's rendezvous store) goes: a rank that exits with
        import torch.distributed as dist  # its gloo group alive can abort at interpreter exit

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
