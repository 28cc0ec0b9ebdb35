"""HumanEval prompts: our DFlash (eager, compiled) against every peer a user would pick, greedy.

    python benchmarks/bench_humaneval.py [--target DIR --draft DIR] [--num-prompts 8] [--max-new 128] \\
        [--repeats 3] [--methods hf_greedy,dflash_compiled,...] [--batch-sizes 1,8] \\
        [--assistant build/assistant] [--out benchmarks/results]

Methods (``--methods``, default all):

- ``hf_greedy``: ``target.generate`` (dynamic cache, eager).
- ``hf_compiled``: HF's own compile path, ``generate(cache_implementation="static", max_cache_len=N,
  compile_config=CompileConfig(fullgraph=True))`` with ``_compile_all_devices`` set (HF otherwise compiles
  only on cuda/xpu/neuron/tpu). ``N`` is one fixed length for every call (the longest prompt plus
  ``--max-new``, rounded up to 128) so the decode graph is not recompiled per prompt; the report counts the
  graphs compiled during the warm-up (per call) and during the timed runs (should be 0).
- ``hf_prompt_lookup``: prompt lookup decoding, ``prompt_lookup_num_tokens=--lookup-tokens``.
- ``hf_dflash``: transformers' native DFlash (``assistant_model=A, speculation_type="dflash"``) with ``A``
  our drafter rebuilt as ``MuseGlimmerAssistantModel`` (``dflash_compile.models.hf_format.transformers_assistant``).
- ``hf_assisted``: classic assisted generation with a small assistant on the target's tokenizer (only when
  ``--assistant`` holds one), trained with

      python examples/train_target.py --out build/assistant --tokenizer dflash_compile/assets/tiny_pair/target \\
          --hidden 96 --intermediate 256 --layers 2 --heads 2 --kv-heads 1 --steps 600 --seed 0

- ``dflash_eager`` / ``dflash_compiled``: ``DFlashSpecWrapper``, eager and ``compile(backend="dflash",
  fullgraph=True)``.
- ``dflash_compiled_k{K}`` for each ``K`` in ``--ks`` (e.g. ``--ks 1,3,5``): compiled, verifying only the first
  ``K`` of the drafter's ``block_size - 1`` drafts per step (``num_speculative_tokens=K``, vLLM's knob).

Batch size ``b`` runs the first ``--num-prompts`` HumanEval prompts in left-padded groups of ``b`` (the last
group may be smaller); tokens/s = all new tokens (up to and including eos) / all time. HF's speculative
methods support batch 1 only: at larger batches they are tried once and the error HF raises is reported.
Per batch size, every method first gets one full untimed warm-up pass (compiles included); then ``--repeats``
rounds each time one pass of every method in turn (so a drift in the machine's speed hits all methods alike),
and each figure is the median over the rounds. Every method's output is checked token for token against
``target.generate`` greedy at batch 1. Acceptance length = 1 + accepted drafts / draft steps (ours: from the
output object; HF's speculative methods: counted on the warm-up pass by wrapping the candidate generator,
same definition, drafts compared with the target's argmax before HF trims them at eos / max length).

Writes ``bench_humaneval.{json,md,png}`` under ``--out``.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / "build" / "inductor-cache"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig  # noqa: E402
from transformers.generation.utils import GenerationMixin  # noqa: E402

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper  # noqa: E402
from dflash_compile.models.hf_format import transformers_assistant  # noqa: E402
from pairs import resolve_pair  # noqa: E402  (benchmarks/pairs.py)

METHODS = ("hf_greedy", "hf_compiled", "hf_prompt_lookup", "hf_dflash", "hf_assisted", "dflash_eager",
           "dflash_compiled")
BS1_ONLY = ("hf_prompt_lookup", "hf_dflash", "hf_assisted")  # HF's assisted decoding loop is batch-1 only


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts, by task number."""
    from dflash_compile.training.loops import humaneval_prompts as prompts

    return prompts(0, n - 1)


def benchmark_prompts(kind: str, n: int, tok, chat: bool) -> list[str]:
    """The texts a benchmark sends: ``kind`` "humaneval" (the first ``n`` tasks) or "chat" (the first ``n`` of the
    held-out chat prompts, ``dflash_compile/assets/chat_prompts.json``); with ``chat``, each as one user turn in
    the tokenizer's chat template with its generation prompt (HumanEval as "Complete the following Python
    function" with the task in a code block, the request the chat drafter's training data phrases the same way)."""
    if kind == "humaneval":
        texts = humaneval_prompts(n)
        users = [f"Complete the following Python function:\n```python\n{t.rstrip()}\n```" for t in texts]
    elif kind == "chat":
        from importlib.resources import files

        users = texts = json.loads(files("dflash_compile.assets").joinpath("chat_prompts.json").read_text())["prompts"][:n]
    else:
        raise SystemExit(f"unknown --prompts {kind!r}: humaneval or chat")
    if not chat:
        if kind == "chat":
            raise SystemExit("--prompts chat needs a tokenizer with a chat template")
        return texts
    return [tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False, add_generation_prompt=True)
            for u in users]


def _rows(seqs: torch.Tensor, prompt_width: int, eos: int) -> list[list[int]]:
    """The new tokens of every row, up to and including the first eos."""
    out = []
    for row in seqs[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
        out.append(row[:end])
    return out


# ---------------------------------------------------------------------------------------------- HF DFlash
class HFSpecCounter:
    """Counts draft steps and accepted drafts of HF's assisted-decoding loop (any candidate generator).

    Wraps the candidate generator HF builds: ``get_candidates`` remembers the drafts, and
    ``update_candidate_strategy`` (called after verification with the target's logits) counts how many lead
    drafts equal the target's argmax — before HF trims the accepted run at eos / max length, as ours counts.
    """

    def __init__(self):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = self.target_forwards = 0
        self.per_pos: list[int] = []
        self.accepted_per_step: list[int] = []

    @contextlib.contextmanager
    def active(self):
        orig = GenerationMixin._get_candidate_generator

        def build(model, *args, **kwargs):
            gen = orig(model, *args, **kwargs)
            get, update, pending = gen.get_candidates, gen.update_candidate_strategy, {}

            def get_candidates(input_ids, *a, **k):
                cand, logits = get(input_ids, *a, **k)
                pending["drafts"] = cand[:, input_ids.shape[1]:]
                return cand, logits

            def update_candidate_strategy(input_ids, scores, num_matches):
                self.target_forwards += 1
                drafts = pending.pop("drafts", None)
                if drafts is not None and drafts.shape[1] > 0:
                    n = drafts.shape[1]
                    agree = (drafts.to(scores.device) == scores[:, :n].argmax(-1))[0].long()
                    accepted = int(agree.cumprod(0).sum())
                    self.num_drafts += 1
                    self.num_draft_tokens += n
                    self.num_accepted_tokens += accepted
                    self.accepted_per_step.append(accepted)
                    self.per_pos += [0] * max(0, n - len(self.per_pos))
                    for i in range(accepted):
                        self.per_pos[i] += 1
                return update(input_ids, scores, num_matches)

            gen.get_candidates, gen.update_candidate_strategy = get_candidates, update_candidate_strategy
            return gen

        with mock.patch.object(GenerationMixin, "_get_candidate_generator", build):
            yield self

    def stats(self) -> dict:
        d = max(1, self.num_drafts)
        return {
            "acceptance_length": 1 + self.num_accepted_tokens / d,
            "num_drafts": self.num_drafts,
            "num_accepted_tokens": self.num_accepted_tokens,
            "target_forwards": self.target_forwards,
            "per_position_acceptance": [a / d for a in self.per_pos],
        }


# ---------------------------------------------------------------------------------------------- profiling
def phase_profile(target, draft, encs: list[dict], args, repeats: int = 50) -> dict:
    """Where the time of our compiled generation goes, batch 1, on ``encs`` (one prompt each).

    A fresh wrapper compiled with the ``dflash`` backend, instrumented (no profiler, after a warm-up pass):
    per step, ``total_ms`` = generate()'s wall time / steps, split into ``graph_ms`` (the compiled Inductor graph
    itself), ``dynamo_ms`` (the rest of the compiled call: guards, frame and argument handling), ``prefill_ms``
    (prefill amortised over the steps) and ``host_ms`` (the host loop: everything else).

    Phases, each compiled on its own with the same backend and timed on the inputs of the first prompt's first
    step (medians of ``repeats``; their sum exceeds one fused step a little: separate graphs, separate call
    overheads, no fusion across them): ``verify_ms``, ``accept_ms``, ``inject_ms``, ``propose_ms``; and
    ``matmul_ms``: the step's matmuls (``aten::mm``/``bmm`` under torch.profiler, in a copy compiled with
    Inductor's Python wrapper, whose extern calls the profiler sees).
    """
    from torch.profiler import ProfilerActivity, profile

    from _harness import median_ms, time_phases
    from bench_step import step_inputs
    from dflash_compile.backends import dflash_backend

    graph_s = []

    def timed_backend(gm, example_inputs):
        compiled = dflash_backend(gm, example_inputs)

        def run(*a):
            t0 = time.perf_counter()
            out = compiled(*a)
            graph_s.append(time.perf_counter() - t0)
            return out

        return run

    # Several wrappers and phase functions compiled in one process: dynamo's per-code-object limit must not bite
    # (generate() lifts it itself; the direct calls below do not go through generate()).
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, cfg.accumulated_recompile_limit)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=1)
    spec.compile(backend=timed_backend, fullgraph=True)
    clock = time_phases(spec)
    eos = target.generation_config.eos_token_id

    def generate_all():
        return sum(spec.generate(e["input_ids"], attention_mask=e["attention_mask"], max_new_tokens=args.max_new,
                                 eos_token_id=eos, return_dict_in_generate=True).num_drafts for e in encs)

    generate_all()  # warm: every context bucket these prompts reach is compiled
    runs = []
    for _ in range(3):
        clock.update(step=0.0, steps=0, prefill=0.0)
        graph_s.clear()
        t0 = time.perf_counter()
        steps = generate_all()
        total = time.perf_counter() - t0
        runs.append((total, clock["step"], sum(graph_s), clock["prefill"], steps))
    total, call_s, graph_total, admit_s, steps = sorted(runs)[1]
    ms = lambda x: 1e3 * x / steps  # noqa: E731
    out = {"steps": steps, "total_ms": ms(total), "graph_ms": ms(graph_total), "dynamo_ms": ms(call_s - graph_total),
           "prefill_ms": ms(admit_s), "host_ms": ms(total - call_s - admit_s)}

    inputs = step_inputs(spec, 1, encs[0]["input_ids"].shape[1])
    block, seq_lens, tables, active, pools, draft_pool = inputs
    out["context_pages"] = tables.shape[1]

    def verify(block, seq_lens, tables, active, pools):
        positions, ok = spec.dflash_step.positions(block, seq_lens, active)
        logits, aux, _ = spec.dflash_step.verify(block, positions, ok, seq_lens, tables, active, pools)  # no recurrent layers
        return logits, aux, positions, ok

    def inject(aux, positions, valid, tables, draft_pool):
        spec.dflash_step.inject(aux, positions, valid, tables, draft_pool)

    phases = {name: torch.compile(fn, backend="dflash", fullgraph=True, dynamic=False) for name, fn in
              {"verify": verify, "accept": spec.dflash_step.accept, "inject": inject, "propose": spec.dflash_step.propose}.items()}
    logits, aux, positions, ok = phases["verify"](block, seq_lens, tables, active, pools)
    tokens, num_accepted, bonus = phases["accept"](block, logits, positions, active)
    valid = (torch.arange(block.shape[1]) <= num_accepted[:, None]) & ok
    phase_args = {
        "verify": (block, seq_lens, tables, active, pools),
        "accept": (block, logits, positions, active),
        "inject": (aux, positions, valid, tables, draft_pool),
        "propose": (bonus, seq_lens + num_accepted + 1, tables, active, draft_pool),
    }
    for name, fn in phases.items():
        out[f"{name}_ms"] = median_ms(lambda: fn(*phase_args[name]), repeats, "cpu")[0]  # first call: the compile

    python_wrapper = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=1)
    python_wrapper.compile(backend="dflash", options={"cpp_wrapper": False})
    python_wrapper.step(*inputs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            python_wrapper.step(*inputs)
    mm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::mm", "aten::bmm"))
    out["matmul_ms"] = mm / 1e3 / repeats
    print("phases", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}, flush=True)
    return out


# ---------------------------------------------------------------------------------------------- run
def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@torch.no_grad()
def run(args) -> dict:
    torch.manual_seed(0)
    target_dir, draft_dir = resolve_pair(args.target, args.draft, args.pair_revision)
    methods = METHODS if args.methods == "all" else tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")
    ks = sorted({int(k) for k in args.ks.split(",") if k.strip()})
    methods += tuple(f"dflash_compiled_k{k}" for k in ks)
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})

    tok = AutoTokenizer.from_pretrained(target_dir)
    tok.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    chat = {"auto": bool(getattr(tok, "chat_template", None)), "chat": True, "raw": False}[args.format]
    texts = benchmark_prompts(args.prompts, args.num_prompts, tok, chat)
    gen = dict(do_sample=False, max_new_tokens=args.max_new, eos_token_id=eos, pad_token_id=pad)
    max_prompt = max(len(tok(t)["input_ids"]) for t in texts)
    cache_len = -(-(max_prompt + args.max_new) // 128) * 128

    # The reference every method must reproduce: target.generate greedy, one prompt at a time.
    reference = []
    for t in texts:
        enc = tok([t], return_tensors="pt")
        reference += _rows(target.generate(**enc, **gen), enc["input_ids"].shape[1], eos)

    cc = CompileConfig(fullgraph=True)
    cc._compile_all_devices = True  # else HF's generate compiles only on cuda/xpu/neuron/tpu
    skip: dict[str, str] = {}
    assistant = None
    if "hf_assisted" in methods:
        if args.assistant and Path(args.assistant, "config.json").is_file():
            assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()
        else:
            skip["hf_assisted"] = f"no assistant model at {args.assistant}"
    hf_draft = transformers_assistant(draft) if "hf_dflash" in methods else None
    max_bs = max(batch_sizes)
    specs = {}
    if "dflash_eager" in methods:
        specs["dflash_eager"] = DFlashSpecWrapper(target, draft, max_batch_size=max_bs)
    if "dflash_compiled" in methods:
        specs["dflash_compiled"] = DFlashSpecWrapper(target, draft, max_batch_size=max_bs)
        specs["dflash_compiled"].compile(backend="dflash", fullgraph=True)
    for k in ks:
        specs[f"dflash_compiled_k{k}"] = DFlashSpecWrapper(target, draft, k, max_batch_size=max_bs)
        specs[f"dflash_compiled_k{k}"].compile(backend="dflash", fullgraph=True)

    def hf(**extra):
        return lambda enc: (target.generate(**enc, **gen, **extra), None)

    def ours(spec):
        def f(enc):
            out = spec.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=args.max_new,
                                eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True)
            return out.sequences, out
        return f

    fns = {
        "hf_greedy": hf(),
        "hf_compiled": hf(cache_implementation="static", max_cache_len=cache_len, compile_config=cc),
        "hf_prompt_lookup": hf(prompt_lookup_num_tokens=args.lookup_tokens),
        "hf_dflash": hf(assistant_model=hf_draft, speculation_type="dflash"),
        "hf_assisted": hf(assistant_model=assistant),
        **{name: ours(spec) for name, spec in specs.items()},
    }
    # Per batch size: one full untimed warm-up pass of every method, compiles included (instrumented for HF's
    # speculative loops); then rounds, each timing one pass of every method in turn, so a drift in the machine's
    # speed (shared machines) hits every method alike; each figure is the median over the rounds. (Batch sizes are
    # not interleaved: HF's compile path recompiles, and goes dynamic, when the batch size changes.)
    results, phases, runs = {}, None, {}
    for name in methods:
        if name in skip:
            results.update({f"{name}@bs{bs}": {"skipped": skip[name]} for bs in batch_sizes})
    for bs in batch_sizes:
        at_bs = {}
        for name in methods:
            if name in skip:
                continue
            fn = fns[name]
            key = f"{name}@bs{bs}"
            groups = [texts[i : i + bs] for i in range(0, len(texts), bs)]
            encs = [tok(g, return_tensors="pt", padding=True) for g in groups]
            if bs > 1 and name in BS1_ONLY:
                try:
                    fn(encs[0])
                    raise AssertionError(f"{name} ran at batch {bs}: drop it from BS1_ONLY")
                except (ValueError, RuntimeError, NotImplementedError) as e:  # HF's own reason
                    results[key] = {"skipped": f"HF: {type(e).__name__}: {e}"}
                    print(key, "skipped:", e, flush=True)
                    continue
            counter = HFSpecCounter()
            graphs_per_call = []
            t0 = time.perf_counter()
            with counter.active() if name.startswith("hf_") else contextlib.nullcontext():
                for enc in encs:
                    g0 = _graphs()
                    fn(enc)
                    graphs_per_call.append(_graphs() - g0)
            at_bs[key] = dict(name=name, fn=fn, encs=encs, counter=counter, graphs_per_call=graphs_per_call,
                              warmup_s=time.perf_counter() - t0, times=[])
            print(key, f"warm ({at_bs[key]['warmup_s']:.1f} s)", flush=True)
        for _ in range(args.repeats):
            for run in at_bs.values():
                g0 = _graphs()
                t0 = time.perf_counter()
                run["outs"] = [run["fn"](enc) for enc in run["encs"]]
                run["times"].append(time.perf_counter() - t0)
                run["graphs_while_timed"] = run.get("graphs_while_timed", 0) + _graphs() - g0
        runs.update(at_bs)
    for key, run in runs.items():
        name, outs, encs = run["name"], run["outs"], run["encs"]
        seconds = statistics.median(run["times"])
        rows = [r for (seq, _), enc in zip(outs, encs) for r in _rows(seq, enc["input_ids"].shape[1], eos)]
        new = sum(len(r) for r in rows)
        row = {"tok_s": new / seconds, "seconds": seconds, "times": run["times"], "new_tokens": new,
               "rows": len(rows), "identical_to_hf_greedy_bs1": sum(a == b for a, b in zip(rows, reference)),
               "warmup_s": run["warmup_s"]}
        if name == "hf_compiled" or name.startswith("dflash_compiled"):
            row["graphs_compiled_per_warmup_call"] = run["graphs_per_call"]
            row["graphs_compiled_while_timed"] = run["graphs_while_timed"]
        stats = [o for _, o in outs if o is not None]
        if stats:  # ours: from the output objects
            drafts = sum(o.num_drafts for o in stats)
            k = len(stats[0].num_accepted_tokens_per_pos)
            row["acceptance_length"] = 1 + sum(o.num_accepted_tokens for o in stats) / max(1, drafts)
            row["num_drafts"] = drafts
            row["num_accepted_tokens"] = sum(o.num_accepted_tokens for o in stats)
            row["per_position_acceptance"] = [
                sum(o.num_accepted_tokens_per_pos[i] for o in stats) / max(1, drafts) for i in range(k)
            ]
        elif run["counter"].target_forwards:  # HF speculative: counted on the warm-up pass
            row.update(run["counter"].stats())
        results[key] = row
        print(key, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                    if k not in ("per_position_acceptance", "times")}, flush=True)
    if "dflash_compiled@bs1" in runs and args.phases:
        phases = phase_profile(target, draft, runs["dflash_compiled@bs1"]["encs"], args)
    return {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target": shown_path(str(target_dir)),  # relative to the repo when inside it: no machine paths in results
        "draft": shown_path(str(draft_dir)),
        "num_prompts": len(texts),
        "max_new_tokens": args.max_new,
        "repeats": args.repeats,
        "batch_sizes": batch_sizes,
        "methods": list(methods),
        "prompts": args.prompts,
        "chat_template": chat,
        "hf_compiled_max_cache_len": cache_len,
        "results": results,
        "phases": phases,
    }


# ---------------------------------------------------------------------------------------------- report
def shown_path(path) -> str:
    """A path as a report shows it: relative to the repository when inside it (no machine's paths in results),
    else relative to the user's cache folder, else its name."""
    p = Path(path).resolve()
    for root, label in ((Path(__file__).resolve().parents[1], ""), (Path.home() / ".cache", "~/.cache/")):
        if p.is_relative_to(root):
            return label + str(p.relative_to(root))
    return p.name


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{report['prompts']}.json").write_text(json.dumps(report, indent=2) + "\n")
    r, methods, sizes = report["results"], report["methods"], report["batch_sizes"]
    n = report["num_prompts"]
    lines = [
        f"{'HumanEval' if report['prompts'] == 'humaneval' else 'Chat'} prompts ({n}"
        f"{', in the chat template' if report.get('chat_template') else ''}), greedy, up to {report['max_new_tokens']} new tokens, median of "
        f"{report['repeats']} interleaved rounds (every method once per round) after one warm-up pass of each; "
        f"{report['machine']}, torch {report['torch']}, "
        f"transformers {report['transformers']}. Target {shown_path(report['target'])}, drafter {shown_path(report['draft'])}. "
        f"Batch b: the prompts in groups of up to b. hf_compiled: static cache, "
        f"max_cache_len={report['hf_compiled_max_cache_len']}.",
        "",
        "| method | batch | tok/s | seconds | new tokens | acceptance length | identical to HF greedy | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        for bs in sizes:
            x = r.get(f"{m}@bs{bs}", {})
            if "tok_s" not in x:
                lines.append(f"| {m} | {bs} | n/a | | | | | {x.get('skipped', '')} |")
                continue
            tau = f"{x['acceptance_length']:.2f}" if "acceptance_length" in x else ""
            note = ""
            if "graphs_compiled_while_timed" in x:
                note = (f"graphs compiled per warm-up call {x['graphs_compiled_per_warmup_call']}, "
                        f"while timed {x['graphs_compiled_while_timed']}")
            lines.append(f"| {m} | {bs} | {x['tok_s']:.1f} | {x['seconds']:.3f} | {x['new_tokens']} | {tau} | "
                         f"{x['identical_to_hf_greedy_bs1']}/{x['rows']} | {note} |")
    lines += ["", "dflash_compiled vs each peer at the same batch size (tokens/s ratio, > 1: ours faster):", ""]
    for bs in sizes:
        ours = r.get(f"dflash_compiled@bs{bs}", {}).get("tok_s")
        if not ours:
            continue
        parts = [f"{m} {ours / r[f'{m}@bs{bs}']['tok_s']:.2f}x" for m in methods
                 if m != "dflash_compiled" and "tok_s" in r.get(f"{m}@bs{bs}", {})]
        lines.append(f"- batch {bs}: " + ("; ".join(parts) or "no peer measured"))
    ph = report.get("phases")
    if ph:
        step = ph["graph_ms"] + ph["dynamo_ms"]
        lines += ["", f"Where a step's time goes (dflash_compiled, batch 1, {ph['steps']} steps; ms per step):", "",
                  "| total | compiled graph | dynamo (guards, frame) | prefill (amortised) | host loop |",
                  "|---|---|---|---|---|",
                  f"| {ph['total_ms']:.3f} | {ph['graph_ms']:.3f} | {ph['dynamo_ms']:.3f} | {ph['prefill_ms']:.3f} | "
                  f"{ph['host_ms']:.3f} |",
                  "", f"Phases compiled one by one (first prompt's first step, context bucket {ph['context_pages']} "
                      "pages; ms):", "",
                  "| verify | accept | inject | propose | matmuls of the whole step |", "|---|---|---|---|---|",
                  f"| {ph['verify_ms']:.3f} | {ph['accept_ms']:.3f} | {ph['inject_ms']:.3f} | {ph['propose_ms']:.3f} | "
                  f"{ph['matmul_ms']:.3f} |"]
        ar = r.get("hf_compiled@bs1", {}).get("tok_s")
        if ar:
            lines += ["", f"One compiled step (graph + dynamo, {step:.3f} ms) = {step / (1e3 / ar):.2f}x one token of "
                          f"HF's compile path ({1e3 / ar:.3f} ms/token at batch 1)."]
    (out / f"bench_{report['prompts']}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        width = 0.8 / len(sizes)
        for j, bs in enumerate(sizes):
            off = (j - (len(sizes) - 1) / 2) * width
            ax.bar([i + off for i in range(len(methods))],
                   [r.get(f"{m}@bs{bs}", {}).get("tok_s", 0) for m in methods], width, label=f"batch {bs}")
        ax.set_xticks(list(range(len(methods))), methods, rotation=20)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"HumanEval prompts ({n}), greedy, {report['machine']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"bench_{report['prompts']}.png", dpi=100)
    except ImportError:
        print("matplotlib is not installed: no plot")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF target directory (default: the shipped pair's)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory (default: the shipped pair's)")
    p.add_argument("--pair-revision", default=None,
                   help="the default pair as it was at this git revision (benchmarks/pairs.py), e.g. an earlier pair")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompts", default="humaneval", choices=("humaneval", "chat"),
                   help="HumanEval tasks, or the held-out chat prompts (dflash_compile/assets/chat_prompts.json)")
    p.add_argument("--format", default="auto", choices=("auto", "chat", "raw"),
                   help="send each prompt in the tokenizer's chat template (auto: when it has one) or as raw text")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="all", help=f"comma list of {','.join(METHODS)} (default all)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--ks", default="", help="also run compiled with num_speculative_tokens K, for each K (comma list)")
    p.add_argument("--lookup-tokens", type=int, default=10)
    p.add_argument("--assistant", default="build/assistant")
    p.add_argument("--no-phases", dest="phases", action="store_false", help="skip the per-phase profile")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    write(run(args), Path(args.out))


if __name__ == "__main__":
    main()
