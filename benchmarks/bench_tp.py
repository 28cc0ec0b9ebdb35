"""Tensor-parallel generation on CPU: one process against two gloo ranks, greedy, at one batch size.

    python benchmarks/bench_tp.py [--layers 8] [--batch 1] [--prompts 2] [--prompt-len 64] [--max-new 64] \\
        [--repeats 3] [--configs 1x1,1x2,2x1] [--out benchmarks/results] [--name bench_tp]

At batch 1 a step reads every weight for one token and is bound by memory bandwidth; ``--batch 16 --prompts 16``
(``--name bench_tp_b16``) makes each step do 16 (plain) or 128 (K = 7 verify) rows of work per weight read, which is
bound by arithmetic, where splitting the work over two cores can pay.

The target is a randomly initialised Qwen3 built from a config (seeded; by default hidden 1024, 8 layers, 16 heads,
8 KV heads, head_dim 64, MLP 3072, vocabulary 32000, untied LM head: 166 M parameters, fp32; 8 layers rather than 12
keep a cold run, compiles included, near ten minutes on two cores), saved once with
``save_pretrained`` under ``build/bench_tp/target`` and loaded from there by every configuration. Its drafter is
``DFlashDraftModel.from_target(target, num_layers=1, block_size=8, target_layer_ids=[1, layers // 2, layers - 2],
seed=0)``, random too; one per wrapper (under tensor parallelism a wrapper splits its drafter over the ranks in
place, and a drafter already split fails the next wrapper's check that every rank holds the same weights). Its
acceptance length is measured and reported; a random drafter accepts little (expect ~1: nearly every draft
rejected), so the speculative rows show what a step costs, not what a trained pair gains.

Configurations (ranks x intra-op threads per rank): ``1x1`` and ``1x2`` run the worker as one plain process (the
target loaded without ``tp_plan``, no process group); ``2x1`` runs it under ``torchrun --nproc-per-node 2``, the
target loaded with ``tp_plan="auto"`` (its weights DTensors split over the two ranks, collectives over gloo) after
``init_distributed()``. The launcher (this script without ``--worker``) runs each configuration as a subprocess
with ``OMP_NUM_THREADS`` set to its thread count, reads the JSON its (rank-0) worker writes, and writes
``bench_tp.{json,md}`` under ``--out``.

Methods, in every configuration: ``hf_greedy`` (``target.generate(do_sample=False)``, eager), ``dflash_k0`` (the
wrapper with ``num_speculative_tokens=0``: plain decoding through our compiled step) and ``dflash_k7``
(``speculation="fixed"``, ``num_speculative_tokens=7``). Both wrappers are compiled with ``backend="dflash"``
(graphs saved in ``build/bench_tp/cache/<config>``, so a rerun loads them; the 2-rank configuration's are never
saved, see docs/distributed.md) and precompiled for ``--batch`` before anything is timed. Each method runs the
``--prompts`` random prompts (all of one length, so no padding) in batches of ``--batch``, one batch after another
(``--max-new`` new tokens each, no eos); one untimed warm-up round, then ``--repeats`` rounds each running every method once in turn;
each figure is the median round. Ranks start every round together (a barrier) and rank 0 times it.

Identity: every output of every configuration, warm-up and timed rounds, is compared token for token with the
``1x1`` configuration's ``hf_greedy`` output for the same prompt (``identical`` per configuration and method).

Collectives: the worker wraps ``dflash_compile.backends._inductor`` (monkeypatched in the worker process only) to
count the functional collectives (all-reduce, all-gather...) in each step graph as it is handed to Inductor, i.e.
per step; an all-reduce of an embedding lookup (the embedding is split by vocabulary rows) is counted apart, and
``all-reduces per target layer`` is the graph's other all-reduces, less a split drafter's (two per drafter layer),
over the target's decoder layers; the speculative step's collectives beyond the plain step's are shown too. A graph
loaded from the compile cache is not traced again: its counts are kept beside the cache
(``build/bench_tp/collectives.json``, keyed by the cache entry) when it is compiled. The scheduler's host
agreements (small integer all-gathers on a gloo group of their own, ``TensorParallel.gather``) are counted per
step while the warm-up round runs.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / "build" / "inductor-cache"))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402

WORK = REPO / "build" / "bench_tp"
CONFIGS = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1)}  # name: (ranks, threads per rank)
METHODS = ("hf_greedy", "dflash_k0", "dflash_k7")
SPECS = {"dflash_k0": 0, "dflash_k7": 7}  # method: num_speculative_tokens
REFERENCE = ("1x1", "hf_greedy")


# ---------------------------------------------------------------------------------------------- the target
def target_config(args):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=None, pad_token_id=None, bos_token_id=None,
    )


def ensure_target(args) -> int:
    """Build the random target into ``--target-dir`` unless a checkpoint of the same config is there; its
    parameter count."""
    from transformers import AutoConfig, Qwen3ForCausalLM

    path = Path(args.target_dir)
    config = target_config(args)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        saved = AutoConfig.from_pretrained(path)
        if all(getattr(saved, f) == getattr(config, f) for f in fields):
            print(f"target: reusing {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", flush=True)
            with torch.device("meta"):
                return sum(p.numel() for p in Qwen3ForCausalLM(saved).parameters())
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    print(f"target: built and saved to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", flush=True)
    return sum(p.numel() for p in model.parameters())


def make_prompts(args) -> list[list[int]]:
    """``--prompts`` random prompts of ``--prompt-len`` tokens (the last id, the drafter's mask token, left out)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, args.vocab - 1, (args.prompts, args.prompt_len), generator=g).tolist()


# ---------------------------------------------------------------------------------------------- collectives
class CollectiveCounter:
    """Counts the functional collectives in every graph the ``dflash`` backend hands to Inductor (by wrapping
    ``dflash_compile.backends._inductor`` in this process), and the scheduler's host all-gathers."""

    def __init__(self):
        from dflash_compile import backends
        from dflash_compile.runtime.distributed import TensorParallel

        self.graphs: list[dict] = []
        self.host_gathers = 0
        plain_inductor, plain_gather = backends._inductor, TensorParallel.gather

        def counted_inductor(gm, example_inputs, options):
            ops = Counter(self.kind(n) for n in gm.graph.nodes
                          if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                          and n.target.namespace == "_c10d_functional"
                          and not n.target.__name__.startswith("wait_tensor"))
            self.graphs.append(dict(sorted(ops.items())))
            return plain_inductor(gm, example_inputs, options)

        def counted_gather(tp, values):
            self.host_gathers += 1
            return plain_gather(tp, values)

        backends._inductor = counted_inductor
        TensorParallel.gather = counted_gather

    @staticmethod
    def kind(node) -> str:
        """The collective's name; an all-reduce of an embedding lookup (a vocabulary-split embedding sums the
        ranks' rows) is told apart from the decoder layers' (attention and MLP output projections)."""
        name = node.target.__name__.split(".")[0]
        if name.startswith("all_reduce"):
            seen, todo = set(), [(node.args[0], 0)]
            while todo:  # the producers a few ops up
                n, depth = todo.pop()
                if not isinstance(n, torch.fx.Node) or n in seen or depth > 3:
                    continue
                seen.add(n)
                if n.op == "call_function" and "embedding" in str(n.target):
                    return f"{name} (embedding)"
                todo += [(a, depth + 1) for a in n.all_input_nodes]
        return name


def step_collectives(spec, counter: CollectiveCounter, before: int, events_before: int, store: Path) -> dict:
    """The collectives of the step graphs ``spec.precompile`` just made ready: counted where compiled (and kept in
    ``store``), read back from ``store`` where loaded from the compile cache."""
    steps = spec.compiled_steps  # the wrapper's CompiledSteps: which key was compiled or loaded, and its cache folder
    kept = json.loads(store.read_text()) if store.is_file() else {}
    fresh = iter(counter.graphs[before:])
    out = {}
    for key, how, _ in steps.events[events_before:]:
        entry = f"{steps.folder().name}/{key.filename}"
        if how == "compiled":
            kept[entry] = out[str(key)] = next(fresh)
        else:
            out[str(key)] = kept.get(entry)  # None: loaded from a cache this benchmark did not fill
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    return out


# ---------------------------------------------------------------------------------------------- the worker
def worker(args) -> None:
    from transformers import AutoModelForCausalLM

    from dflash_compile import DFlashDraftModel, DFlashSpecWrapper

    torch.set_num_threads(args.threads)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        from dflash_compile.runtime.distributed import init_distributed

        rank, world = init_distributed()
    else:
        rank, world = 0, 1

    def barrier():
        if distributed:
            dist.barrier()

    counter = CollectiveCounter()
    t0 = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32,
                                                  **({"tp_plan": "auto"} if distributed else {})).eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = None
    layers = target.config.num_hidden_layers
    ids = args.target_layer_ids or [1, layers // 2, layers - 2]
    load_s = time.perf_counter() - t0
    cache_len = -(-(args.prompt_len + args.max_new + 8) // 64) * 64
    specs, compile_info = {}, {}
    for m, k in SPECS.items():
        # a fresh drafter (the same seeded weights) for each wrapper: a tensor-parallel wrapper splits its drafter
        draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=8, target_layer_ids=ids, seed=0)
        spec = DFlashSpecWrapper(target, draft, num_speculative_tokens=k, speculation="fixed",
                                 max_batch_size=args.batch, max_seq_len=cache_len)
        if distributed and spec.tp is None:
            raise RuntimeError("the target was loaded with tp_plan='auto' but the wrapper sees no DTensor weights")
        # one cache per configuration: a graph saved at one thread count is refused by its guards at another
        # (torch's global-state guard on the intra-op thread count) and compiled again
        spec.compile(backend="dflash", cache_dir=Path(args.cache_dir) / args.config)
        before, events_before = len(counter.graphs), len(spec.compiled_steps.events)
        t1 = time.perf_counter()
        report = spec.precompile(batch_sizes=[args.batch], progress=False)
        compile_info[m] = {"graphs": {k_: list(v) for k_, v in report.items()},
                           "seconds": round(time.perf_counter() - t1, 1),
                           "drafter_split_over": list(getattr(draft, "split_over", None) or []) or None}
        specs[m] = spec
        if rank == 0:  # the other ranks' graphs are the same but for their shards
            compile_info[m]["collectives"] = step_collectives(spec, counter, before, events_before,
                                                              Path(args.collectives_store))
            print(f"[{args.config}] {m}: {report}", flush=True)
    barrier()

    prompts = make_prompts(args)
    runs = {m: {"seconds": [], "outputs": [], "info": {}} for m in METHODS}

    def run(m):
        rows, steps, accepted, drafts, gathers = [], 0, 0, 0, counter.host_gathers
        for b in range(0, len(prompts), args.batch):
            x = torch.tensor(prompts[b:b + args.batch])
            if m == "hf_greedy":
                seq = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=args.max_new)
                rows += seq[:, x.shape[1]:].tolist()
            else:
                out = specs[m].generate(x, max_new_tokens=args.max_new, return_dict_in_generate=True)
                rows += out.sequences[:, x.shape[1]:].tolist()
                steps += sum(r.num_steps for r in out.per_request)
                accepted += out.num_accepted_tokens
                drafts += out.num_drafts
        info = {}
        if m != "hf_greedy":
            info = {"steps": steps, "acceptance_length": 1 + accepted / drafts if drafts else None,
                    "host_all_gathers_per_step": (counter.host_gathers - gathers) / steps if distributed else 0}
        return rows, info

    load_before = [round(x, 2) for x in os.getloadavg()]
    with torch.no_grad():
        for rnd in range(args.repeats + 1):  # round 0: the untimed warm-up
            took = {}
            for m in METHODS:
                barrier()
                start = time.perf_counter()
                rows, info = run(m)
                took[m] = time.perf_counter() - start
                runs[m]["outputs"].append(rows)
                if rnd == 0:
                    runs[m]["info"] = info
                else:
                    runs[m]["seconds"].append(took[m])
            if rank == 0:
                print(f"[{args.config}] {'warm-up' if rnd == 0 else f'round {rnd}'}: "
                      + ", ".join(f"{m} {s:.2f} s" for m, s in took.items()), flush=True)
    barrier()
    for spec in specs.values():
        spec.close()
    if rank != 0:
        return
    tokens = args.prompts * args.max_new
    rows = {}
    for m, r in runs.items():
        s = statistics.median(r["seconds"])
        stable = all(o == r["outputs"][0] for o in r["outputs"])
        rows[m] = {"tokens": tokens, "seconds": s, "tok_s": tokens / s, "runs": r["seconds"],
                   "outputs": r["outputs"][0], "same_every_round": stable, **r["info"]}
        if m in compile_info:
            rows[m]["compile"] = compile_info[m]
    result = {"config": args.config, "batch": args.batch, "ranks": world, "threads_per_rank": args.threads,
              "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "tensor_parallel": distributed, "target_layers": layers, "draft_layers": 1, "draft_target_layer_ids": ids,
              "load_seconds": round(load_s, 1), "methods": rows}
    result["load_average"] = {"before_warm_up": load_before, "after_timed": [round(x, 2) for x in os.getloadavg()]}
    Path(args.worker_out).write_text(json.dumps(result) + "\n")


# ---------------------------------------------------------------------------------------------- the launcher
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, gloo"


def worker_args(args) -> list[str]:
    keep = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "seed", "batch", "prompts",
            "prompt_len", "max_new", "repeats", "target_dir", "cache_dir", "collectives_store")
    out = []
    for k in keep:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.target_layer_ids:
        out += ["--target-layer-ids", ",".join(map(str, args.target_layer_ids))]
    return out


def launch(args) -> dict:
    t_all = time.perf_counter()
    params = ensure_target(args)
    print(f"target parameters: {params / 1e6:.1f} M", flush=True)
    results = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "worker"},
               "target_params": params, "configs": {}, "wall_seconds": {}}
    for name in args.configs:
        ranks, threads = CONFIGS[name]
        out = (WORK / f"worker-{args.name}-{name}.json").relative_to(REPO)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        cmd = [str(Path(__file__).resolve().relative_to(REPO)), "--worker", "--config", name, "--threads", str(threads),
               "--worker-out", str(out), *worker_args(args)]
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   *cmd]
        else:
            cmd = [sys.executable, *cmd]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        env.setdefault("DFLASH_TP_TIMEOUT", "300")  # first compiles on a busy 2-core machine: ranks may drift
        shown = " ".join(["python", *cmd[1:]])
        print(f"== {name}: {ranks} rank(s) x {threads} thread(s): OMP_NUM_THREADS={threads} {shown}", flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True)
        results["wall_seconds"][name] = round(time.perf_counter() - t0, 1)
        results["configs"][name] = json.loads(out.read_text())
    reference = results["configs"].get(REFERENCE[0], {}).get("methods", {}).get(REFERENCE[1], {}).get("outputs")
    for name, c in results["configs"].items():
        for m, r in c["methods"].items():
            r["identical"] = None if reference is None else (r["outputs"] == reference and r["same_every_round"])
            r["identical_prompts"] = None if reference is None else sum(
                a == b for a, b in zip(r["outputs"], reference))
        c["identical"] = None if reference is None else all(r["identical"] for r in c["methods"].values())
    results["wall_seconds"]["total"] = round(time.perf_counter() - t_all, 1)
    return results


def _graph_counts(c: dict, m: str) -> dict | None:
    """Collectives of method ``m``'s step graph in config ``c`` (None where not counted)."""
    graphs = c["methods"][m].get("compile", {}).get("collectives", {})
    if len(graphs) != 1 or None in graphs.values():  # one batch bucket, one K: one step graph per wrapper
        return None
    return next(iter(graphs.values()))


def _collective_cells(c: dict, m: str) -> list[str]:
    """(collectives per step, the difference from the plain step's, all-reduces per target layer per step)."""
    counts, plain = _graph_counts(c, m), _graph_counts(c, "dflash_k0")
    if counts is None:
        return ["not counted (graph loaded from a cache this benchmark did not fill)", "", "?"]
    text = ", ".join(f"{n} {k}" for n, k in counts.items()) or "none"
    diff = "" if plain is None or m == "dflash_k0" else ", ".join(
        f"{counts.get(n, 0) - plain.get(n, 0):+d} {n}" for n in sorted(set(counts) | set(plain))
        if counts.get(n, 0) != plain.get(n, 0)) or "none"
    split = c["methods"][m]["compile"].get("drafter_split_over")
    drafter = 2 * c["draft_layers"] if split and SPECS[m] > 0 else 0  # a split drafter layer: o_proj, down_proj
    return [text, diff, f"{(counts.get('all_reduce', 0) - drafter) / c['target_layers']:g}"]


def markdown(results) -> str:
    a, configs = results["args"], results["configs"]
    names = list(configs)
    lines = [f"# Tensor-parallel generation on CPU ({results['machine']})", "",
             "Command: `OMP_NUM_THREADS=1 python benchmarks/bench_tp.py"
             + (f" --batch {a['batch']} --prompts {a['prompts']}" if a.get("batch", 1) > 1 else "")
             + (f" --max-new {a['max_new']}" if a["max_new"] != 64 else "")
             + (f" --name {a['name']}" if a["name"] != "bench_tp" else "")
             + "` (the launcher sets `OMP_NUM_THREADS` per configuration).", "",
             f"Target: random Qwen3, {results['target_params'] / 1e6:.1f} M parameters, fp32 (hidden {a['hidden']}, "
             f"{a['layers']} layers, {a['heads']} heads / {a['kv_heads']} KV heads of {a['head_dim']}, MLP "
             f"{a['intermediate']}, vocabulary {a['vocab']}, untied LM head). Drafter: random (seeded), 1 layer, "
             "block 8, reading target layers " + str(next(iter(configs.values()))["draft_target_layer_ids"])
             + ". Greedy, batch "
             f"{a.get('batch', 1)}: {a['prompts']} random prompts of {a['prompt_len']} tokens, {a['max_new']} new "
             f"tokens each (no eos), in batches of {a.get('batch', 1)} one after another; tokens/s of the median of {a['repeats']} timed rounds after one untimed warm-up "
             "round. Ranks x threads: `1xN` is one plain process (no `tp_plan`, no process group); `2x1` is "
             "`torchrun --nproc-per-node 2`, the target split by `tp_plan=\"auto\"` over gloo. Ours are compiled "
             "(`backend=\"dflash\"`) and precompiled before timing; `hf_greedy` is `target.generate(do_sample=False)`, "
             "eager.", ""]
    head = ["method", *[f"{n} tok/s" for n in names]]
    ratio = [(x, y) for x, y in (("2x1", "1x1"), ("2x1", "1x2")) if x in configs and y in configs]
    head += [f"{x} / {y}" for x, y in ratio]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for m in METHODS:
        cells = [m]
        for n in names:
            r = configs[n]["methods"][m]
            mark = "" if r["identical"] in (True, None) else f" (not identical: {r['identical_prompts']}/" \
                                                              f"{a['prompts']} prompts)"
            cells.append(f"{r['tok_s']:.1f}{mark}")
        cells += [f"{configs[x]['methods'][m]['tok_s'] / configs[y]['methods'][m]['tok_s']:.2f}x" for x, y in ratio]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Identical to the 1x1 `hf_greedy` output on every prompt (every method, warm-up and timed rounds): "
              + ", ".join(f"{n} {'yes' if c['identical'] else 'NO' if c['identical'] is not None else '?'}"
                          for n, c in configs.items()) + ".", ""]
    acc = [(n, configs[n]["methods"]["dflash_k7"].get("acceptance_length")) for n in names]
    lines += ["Acceptance length of `dflash_k7`, measured (1 + accepted drafts per verifying step): "
              + ", ".join(f"{n} {v:.2f}" if v else f"{n} n/a" for n, v in acc) + ". The target and the drafter are "
              "both random, and a random drafter accepts little: each step yields about one token while paying for "
              "a verify of 8 tokens and a drafter forward, so these rows measure what a speculative step costs, not "
              "what a trained pair gains.", ""]
    tp = [n for n in names if configs[n]["tensor_parallel"]]
    if tp:
        split = {n: configs[n]["methods"]["dflash_k7"]["compile"].get("drafter_split_over") for n in tp}
        lines += ["Collectives per step of our compiled step (the functional collectives in the step graph as the "
                  "`dflash` backend hands it to Inductor, waits excluded; one graph per wrapper). The TP "
                  "plan splits the target's q/k/v, gate/up by columns and o_proj, down_proj by rows (one all-reduce "
                  "each per layer), the embedding by vocabulary rows (an all-reduce of each lookup, counted apart as "
                  "`all_reduce (embedding)`: the target's and, when it proposes, the drafter's, which borrows it) and "
                  "the LM head by columns (an all-gather of the logits, again for the target and the drafter). The "
                  "drafter was " + ", ".join(f"{'split over the ranks' if v else 'replicated'} in {n}"
                                             for n, v in split.items())
                  + " (a split drafter layer adds two all-reduces: its o_proj and down_proj). `all-reduces per target "
                  "layer` leaves out the embedding's and the drafter's.", "",
                  "| config | method | steps (warm-up round) | collectives per step | more than the plain step | "
                  "all-reduces per target layer per step | host all-gathers per step |", "|---" * 7 + "|"]
        for n in tp:
            c = configs[n]
            for m in SPECS:
                r = c["methods"][m]
                lines.append(f"| {n} | {m} | {r['steps']} | " + " | ".join(_collective_cells(c, m))
                             + f" | {r['host_all_gathers_per_step']:.2f} |")
        lines += ["", "Host all-gathers: the scheduler's agreements between ranks (a few integers each, on a gloo "
                  "group of their own: admission, the step's K), counted per step over the warm-up round. The "
                  "prefill runs eagerly (not counted). `hf_greedy` under `tp_plan` runs the same plan eagerly, one "
                  "token per forward (not counted).", ""]
    lines += ["Load average (1 min) before the warm-up round -> after the timed rounds: "
              + ", ".join(f"{n} {c['load_average']['before_warm_up'][0]:.1f} -> "
                          f"{c['load_average']['after_timed'][0]:.1f}" for n, c in configs.items())
              + " (a configuration's own processes account for up to 2 on this machine; more means something else "
              "ran at the same time).", ""]
    lines += ["Wall time per configuration (load, compile or cache load, warm-up, timed rounds): "
              + ", ".join(f"{n} {s:.0f} s" for n, s in results["wall_seconds"].items() if n != "total")
              + f"; whole benchmark {results['wall_seconds']['total']:.0f} s.", ""]
    lines += [f"Compile per configuration (`dflash_k0` / `dflash_k7` step graph at batch {a.get('batch', 1)}: "
              "compiled or loaded, "
              "seconds): " + "; ".join(
                  f"{n} " + " / ".join(f"{how} {s:.0f} s" for m in SPECS
                                       for how, s in configs[n]["methods"][m]["compile"]["graphs"].values())
                  for n in names) + "."
              + " The 2-rank configuration always compiles: tensor-parallel step graphs are not saved in the compile "
                "cache (docs/distributed.md).", ""]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="the target layers the drafter reads (default: 1, layers // 2, layers - 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1, help="rows per generate call (and the precompiled bucket)")
    p.add_argument("--prompts", type=int, default=2, help="a multiple of --batch")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"from {list(CONFIGS)}")
    p.add_argument("--target-dir", default=str((WORK / "target").relative_to(REPO)))
    p.add_argument("--cache-dir", default=str((WORK / "cache").relative_to(REPO)))
    p.add_argument("--collectives-store", default=str((WORK / "collectives.json").relative_to(REPO)))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="bench_tp", help="output files NAME.{json,md} under --out")
    p.add_argument("--config", help=argparse.SUPPRESS)  # worker: its configuration
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.chdir(REPO)  # the default paths are relative to the repository
    if args.worker:
        worker(args)
        return
    if args.batch < 1 or args.prompts % args.batch:
        raise SystemExit(f"--prompts ({args.prompts}) must be a positive multiple of --batch ({args.batch})")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    results = launch(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for c in results["configs"].values():  # the token ids stay in the worker files, not in the results
        for r in c["methods"].values():
            r.pop("outputs", None)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
