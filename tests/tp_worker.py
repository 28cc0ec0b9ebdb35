"""One rank of a tensor-parallel run (``test_tensor_parallel.py`` starts one process per rank, torchrun's environment
set by hand so that a rank that dies is observed, not cleaned up by the launcher). Writes ``<out>/rank<r>.json``.

Modes:
- ``greedy``: a padded batch through the wrapper over the ``tp_plan`` target, eager (``speculation="auto"``: each
  rank times its own steps, so ranks must agree on every step's ``K``) then compiled with ``dflash`` (the starting
  bucket's graph, one per key, the passes' counters); every row against the single-process ``target.generate``;
  the split drafter's drafts, every step, against the whole drafter's in a single process.
- ``sample``: seeded sampling at a fixed ``K`` against the single-process wrapper with the same seed; unseeded
  sampling with ``speculation="auto"`` through a second wrapper over the same (already split) drafter, the same on
  every rank.
- ``kill``: rank 1 exits mid-generation (``os._exit`` from its streamer); rank 0 reports the error and the seconds
  it took to get it.
- ``stall``: rank 1 stops stepping but stays alive; rank 0 reports the error of the timed-out collective.
- ``streamer_raises``: rank 1's streamer raises; the request fails there and is cancelled on rank 0; both go on.
- ``odd_heads``: a drafter whose heads 2 ranks do not divide: replicated, said in the log, lossless.
- ``odd_target``: a target whose KV heads 2 ranks do not divide: the constructor's error.
- ``mismatch``: rank 1 builds its drafter from another seed; the constructor's error.
"""

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import CancelledError
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper  # noqa: E402
from dflash_compile.runtime.distributed import init_distributed  # noqa: E402
from tiny_models import VOCAB, random_prompts  # noqa: E402

PAD = VOCAB - 2
NEW = 14


def _load(path, tp: bool):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **({"tp_plan": "auto"} if tp else {}))
    model.generation_config.eos_token_id = None
    return model.eval()


def _drafter(target, seed=0):
    n = target.config.get_text_config().num_hidden_layers
    return DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, n - 1], seed=seed)


def _wrapper(target, seed=0, **kw):
    return DFlashSpecWrapper(target, _drafter(target, seed), **{**dict(max_batch_size=4, max_seq_len=96, page_size=8),
                                                              **kw})


def _split_blocks(split, whole) -> int:
    """How many of the target's attention and MLP blocks the plan split over the ranks (each ends in one
    all-reduce): a block is split when this rank holds fewer of its weights than the single-process model.
    transformers' plans differ by version (5.25 replicates Qwen3-MoE's experts where 5.24 split them)."""
    def sizes(model):
        out = {}
        for name, p in model.named_parameters():
            m = re.search(r"layers\.(\d+)\.(self_attn|mlp)\.", name)
            if m:
                out[m.groups()] = out.get(m.groups(), 0) + _local(p).numel()
        return out
    mine, full = sizes(split), sizes(whole)
    return sum(mine[k] < full[k] for k in full)


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _rows(out, prompts):
    L = out.shape[1] - NEW
    return [row[L:].tolist() for row in out]


def greedy(args, rank):
    target, single = _load(args.dir, True), _load(args.dir, False)
    prompts = random_prompts([5, 17, 30], seed=1)
    ref = [single.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW)[0, len(p):].tolist()
           for p in prompts]
    result = {"reference": ref}
    spec = _wrapper(target)  # speculation="auto"
    out = spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True)
    result["eager"] = _rows(out.sequences, prompts)
    result["eager_step_ks"] = out.step_ks if hasattr(out, "step_ks") else None
    spec.close()
    spec = _wrapper(target, num_speculative_tokens=3)
    # the graph of the bucket the batch starts at; the steps after rows finish run eagerly (the smaller buckets'
    # graphs are the same code at another batch size, and each costs a compile on both ranks)
    spec.compile("dflash", cache_dir=args.out / f"cache{rank}", on_miss="eager")
    counters.clear()
    spec.precompile([len(prompts)], progress=False)
    out = spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD)
    result["compiled"] = _rows(out, prompts)
    result["passes"] = dict(counters["dflash"])
    result["target_layers"] = target.config.get_text_config().num_hidden_layers
    result["split_blocks"] = _split_blocks(target, single)
    result["events"] = [(str(k), how) for k, how, _ in spec.compiled_steps.events]
    result["split"] = spec.draft.split_over
    # the split drafter proposes what the whole one does in a single process (greedy drafts are exact up to the
    # rounding of the all-reduced partial sums: the random tiny models here have no near ties)
    out = spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD, output_drafts=True,
                        return_dict_in_generate=True)
    result["drafts"] = out.drafts
    single_spec = _wrapper(single, num_speculative_tokens=3)
    result["single_drafts"] = single_spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD, output_drafts=True,
                                                   return_dict_in_generate=True).drafts
    return result


def sample(args, rank):
    target, single = _load(args.dir, True), _load(args.dir, False)
    prompts = random_prompts([6, 11], seed=2)
    kw = dict(max_new_tokens=NEW, pad_token_id=PAD, do_sample=True, temperature=1.3, top_k=20)
    # sampled tokens are keyed by (seed, position): the same over two ranks at K = 3 as in one process at K = 1
    draft = _drafter(target)
    geometry = dict(max_batch_size=4, max_seq_len=96, page_size=8)
    seeded = _rows(DFlashSpecWrapper(target, draft, 3, **geometry).generate(prompts, seed=7, **kw), prompts)
    reference = _rows(_wrapper(single, num_speculative_tokens=1).generate(prompts, seed=7, **kw), prompts)
    # a second wrapper over the same drafter, which the first split in place
    unseeded = _rows(DFlashSpecWrapper(target, draft, **geometry).generate(prompts, **kw), prompts)
    return {"seeded": seeded, "single": reference, "unseeded": unseeded}


class _DieAfter:
    def __init__(self, n):
        self.n = n

    def put(self, value):
        self.n -= 1
        if self.n < 0:
            os._exit(3)

    def end(self):
        pass


def kill(args, rank):
    target = _load(args.dir, True)
    spec = _wrapper(target, num_speculative_tokens=3)
    streamer = _DieAfter(6) if rank == 1 else None
    start = time.perf_counter()
    try:
        spec.generate(random_prompts([9], seed=3), max_new_tokens=80, streamer=streamer)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def odd_heads(args, rank):
    """A drafter with 3 heads (and 1 KV head) over 2 ranks: kept whole on each, said in the log; still lossless."""
    import logging

    target, single = _load(args.dir, True), _load(args.dir, False)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("dflash_compile.runtime.distributed").addHandler(handler)
    n = target.config.get_text_config().num_hidden_layers
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[0, n - 1], seed=0,
                                         num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    spec = DFlashSpecWrapper(target, draft, 3, max_batch_size=2, max_seq_len=96, page_size=8)
    prompts = random_prompts([7], seed=4)
    out = _rows(spec.generate(prompts, max_new_tokens=NEW), prompts)
    ref = single.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=NEW)[0, 7:].tolist()
    return {"split": spec.draft.split_over, "identical": out == [ref], "log": " ".join(records)}


class _Raise(_DieAfter):
    def put(self, value):
        self.n -= 1
        if self.n < 0:
            raise RuntimeError("the caller's streamer failed")


class _Stall(_DieAfter):
    def put(self, value):
        self.n -= 1
        if self.n == 0:
            time.sleep(float(os.environ["DFLASH_TP_TIMEOUT"]) * 2)


def streamer_raises(args, rank):
    """Rank 1's streamer raises after 4 tokens: the request fails there with that error and is cancelled on rank 0
    at the next step; then both ranks go on, in step, with a new request."""
    target, single = _load(args.dir, True), _load(args.dir, False)
    spec = _wrapper(target, num_speculative_tokens=3)
    prompt = random_prompts([9], seed=3)
    handle = spec.submit(prompt[0], max_new_tokens=40, streamer=_Raise(4) if rank == 1 else None)
    try:
        first = {"finish": handle.result().finish_reason}
    except CancelledError:
        first = {"cancelled": True}
    except RuntimeError as e:
        first = {"error": str(e)}
    out = _rows(spec.generate(prompt, max_new_tokens=NEW), prompt)
    ref = single.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=NEW)[0, 9:].tolist()
    return {"first": first, "then_identical": out == [ref]}


def stall(args, rank):
    """Rank 1 stops stepping (its streamer sleeps two timeouts): rank 0 fails when the collective times out."""
    target = _load(args.dir, True)
    spec = _wrapper(target, num_speculative_tokens=3)
    start = time.perf_counter()
    try:
        spec.generate(random_prompts([9], seed=3), max_new_tokens=80, streamer=_Stall(3) if rank == 1 else None)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def odd_target(args, rank):
    """A target with one KV head over 2 ranks: refused before any work."""
    target = _load(args.dir, True)
    try:
        _wrapper(target)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def mismatch(args, rank):
    target = _load(args.dir, True)
    try:
        _wrapper(target, seed=rank)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["greedy", "sample", "kill", "stall", "streamer_raises", "mismatch",
                                         "odd_heads", "odd_target"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, _ = init_distributed()
    result = globals()[args.mode](args, rank)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    if args.mode not in ("kill", "stall"):
        torch.distributed.barrier()
    os._exit(0)  # a peer that died leaves the process group unable to shut down cleanly


if __name__ == "__main__":
    main()
