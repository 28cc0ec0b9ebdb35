"""The same compiled generation at two revisions of this package, side by side: where a change of the step moved
its time, phase by phase.

    python benchmarks/bench_revisions.py --base REV [--head REV] [--pair tiny|chat] [--cases 8:0 8:7 1:7]
        [--rounds 3] [--max-new 128] [--name NAME]

Each revision is checked out once with ``git worktree`` under ``build/revisions/<commit>/`` (``--head`` defaults to
the working tree as it is, uncommitted changes included). A round runs one worker process per (revision, case),
the revisions alternating, so both meet the same machine; the figure of each is the median over ``--rounds``
rounds of the median of the worker's own 3 timed passes (after an untimed warm-up pass, which compiles or loads
the graph: each revision has its own compile-cache folder, the fingerprint hashes the package's sources).

A case ``B:K`` is ``B`` HumanEval prompts (raw, left-padded) through a wrapper with ``max_batch_size=B``, one batch
bucket, ``speculation="fixed"`` at ``K``, greedy, ``--max-new`` new tokens, no early stop; every pass of every
worker of a case must generate the same tokens (a hash of them is compared), or the run stops. Phases per pass:
``step`` (the compiled step calls, ms per step), ``prefill`` (admission: the target's prefill and the drafter's
first block, ms per pass) and ``host`` (the rest of the host loop, ms per step); tokens/s over the whole pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str | None) -> tuple[str, Path]:
    """``(label, source root)`` of ``rev``: a worktree made once under build/revisions/, or the working tree."""
    if rev is None:
        return "working tree", REPO
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = REPO / "build" / "revisions" / commit[:12]
    if not (path / "dflash_compile").is_dir():
        _git("worktree", "add", "--detach", "--force", str(path), commit)
    return commit[:12], path


# ---------------------------------------------------------------------------------------------- worker
def worker(args) -> None:
    sys.path.insert(0, str(Path(args.tree).resolve()))  # this revision's package before the installed one
    sys.path.insert(1, str(REPO / "benchmarks"))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dflash_compile
    from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
    from dflash_compile.assets import chat_pair_paths, tiny_pair_paths

    from _harness import time_phases
    from bench_humaneval import humaneval_prompts

    assert Path(dflash_compile.__file__).resolve().is_relative_to(Path(args.tree).resolve()), dflash_compile.__file__
    torch.set_num_threads(args.threads)
    B, K = args.batch, args.k
    t, d = tiny_pair_paths() if args.pair == "tiny" else chat_pair_paths()
    tok = AutoTokenizer.from_pretrained(t)
    tok.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(d, dtype=torch.float32)
    enc = tok.pad({"input_ids": [tok(p)["input_ids"] for p in humaneval_prompts(B)]}, return_tensors="pt")
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", num_speculative_tokens=K, max_batch_size=B,
                             batch_buckets=(B,))
    spec.compile(backend="dflash", cache_dir=REPO / "build" / "revisions" / "compile-cache")
    clock = time_phases(spec)

    def one_pass() -> dict:
        clock.update(step=0.0, steps=0, prefill=0.0)
        t0 = time.perf_counter()
        out = spec.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=args.max_new,
                            eos_token_id=None)
        total = time.perf_counter() - t0
        n = clock["steps"]
        return {"tok_s": B * (out.shape[1] - enc["input_ids"].shape[1]) / total, "step_ms": 1e3 * clock["step"] / n,
                "prefill_ms": 1e3 * clock["prefill"], "host_ms": 1e3 * (total - clock["step"] - clock["prefill"]) / n,
                "steps": n, "output": hashlib.sha256(str(out.tolist()).encode()).hexdigest()[:16]}

    one_pass()  # compiles or loads the graph
    passes = [one_pass() for _ in range(3)]
    outputs = {p.pop("output") for p in passes}
    assert len(outputs) == 1, "the passes of one worker generated different tokens"
    print(json.dumps({**{k: statistics.median(p[k] for p in passes) for k in passes[0]}, "output": outputs.pop()}),
          flush=True)


# ---------------------------------------------------------------------------------------------- driver
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the revision to compare against (a commit, branch or tag)")
    p.add_argument("--head", default=None, help="the other revision (default: the working tree as it is)")
    p.add_argument("--pair", choices=("tiny", "chat"), default="tiny")
    p.add_argument("--cases", nargs="+", default=["8:0", "8:7", "1:7"], help="BATCH:K")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", default=None, help="results file stem (default bench_revisions-<pair>)")
    p.add_argument("--overwrite", action="store_true", help="replace results of that name (refused otherwise)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.base:
        p.error("--base is required")
    out = REPO / "benchmarks" / "results" / (args.name or f"bench_revisions-{args.pair}")
    if out.with_suffix(".md").exists() and not args.overwrite:  # said now, not after the run
        p.error(f"{out.with_suffix('.md').relative_to(REPO)} exists: another --name, or --overwrite")
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases]
    trees = [checkout(args.base), checkout(args.head)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    runs: dict[tuple, list[dict]] = {}
    outputs: dict[tuple, str] = {}  # (batch, K) -> the hash of the first worker's tokens
    for r in range(args.rounds):
        for b, k in cases:
            for label, root in trees if r % 2 == 0 else trees[::-1]:
                cmd = [sys.executable, __file__, "--worker", "--tree", str(root), "--pair", args.pair,
                       "--batch", str(b), "--k", str(k), "--max-new", str(args.max_new), "--threads", str(args.threads)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{label}, batch {b}, K {k} failed:\n{done.stderr[-3000:]}")
                res = json.loads(done.stdout.strip().splitlines()[-1])
                output = outputs.setdefault((b, k), res["output"])
                if res.pop("output") != output:  # greedy and lossless: every revision must say the same tokens
                    raise SystemExit(f"{label}, batch {b}, K {k}: other tokens than the first worker of this case")
                runs.setdefault((label, b, k), []).append(res)
                print(f"round {r + 1}: {label:>12} batch {b} K {k}: " + ", ".join(f"{n} {v:.2f}" for n, v in res.items()),
                      flush=True)
    rows = []
    for b, k in cases:
        base, head = ({n: statistics.median(x[n] for x in runs[(label, b, k)]) for n in runs[(label, b, k)][0]}
                      for label, _ in trees)
        rows.append({"batch": b, "k": k, "base": base, "head": head})
    head = f" --head {args.head}" if args.head else ""
    name = f" --name {args.name}" if args.name else ""
    lines = [f"`python benchmarks/bench_revisions.py --base {args.base}{head} --pair {args.pair} --cases "
             f"{' '.join(args.cases)} --rounds {args.rounds} --max-new {args.max_new} --threads {args.threads}{name}`: "
             f"base {trees[0][0]}, head {trees[1][0]}, "
             f"{args.threads} thread(s), median of {args.rounds} rounds", "",
             "| batch | K | tok/s base | tok/s head | speed-up | step ms base | step ms head | prefill ms base | "
             "prefill ms head | host ms/step base | host ms/step head |", "|---" * 11 + "|"]
    for row in rows:
        a, h = row["base"], row["head"]
        lines.append(f"| {row['batch']} | {row['k']} | {a['tok_s']:.0f} | {h['tok_s']:.0f} | "
                     f"{h['tok_s'] / a['tok_s']:.2f}x | {a['step_ms']:.2f} | {h['step_ms']:.2f} | {a['prefill_ms']:.0f} | "
                     f"{h['prefill_ms']:.0f} | {a['host_ms']:.2f} | {h['host_ms']:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out.with_suffix(".json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if v is not None},
                                                    "trees": [t[0] for t in trees], "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
