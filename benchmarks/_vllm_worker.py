"""One vLLM engine behind a pipe, for ``bench_vllm.py`` (and ``tests/test_vllm_agreement.py``).

Runs in vLLM's own venv (vLLM pins another transformers than this project), never imported by the project:

    <vllm venv>/bin/python benchmarks/_vllm_worker.py '{"target": DIR, "draft": DIR or null, "k": 7, ...}'

It builds ``vllm.LLM`` once (fp32, the draft as a DFlash speculator when given), prints ``READY {json}`` with its
start-up time, then answers one JSON request per stdin line with one ``RESULT {json}`` line on stdout (vLLM's own
logging goes to stderr and to other stdout lines, which the caller skips):

- ``{"prompts": [[ids], ...], "max_new": N, "eos": id or null, "in_flight": b}``: greedy generation of the
  queue of prompts with at most ``b`` of them in the engine at once (a new one is added as one finishes: ``b``
  clients of a server, vLLM's continuous batch), from an empty prefix cache (a queue replayed round after round must
  not find its prompts cached by the round before), answered with each prompt's new token ids (up to and including
  eos), the seconds the queue took, and the speculative-decoding counters of this call (drafts, draft tokens,
  accepted tokens, accepted per draft position; zeros without a drafter);
- ``{"quit": true}`` (or end of input): exits.

With ``"fix_grouped_rms_norm": true`` in its configuration the engine runs in this process (so that a patch reaches
the model) with one change to vLLM: ``DFlashQwen3Model._normalize_context_k`` normalises each drafter layer's
context keys with that layer's ``k_norm`` weight. vLLM 0.32 does it with one ``rms_norm`` op over ``[L, n, heads,
head_dim]`` and a ``[L, head_dim]`` weight, and the CPU build's op applies the weight's first row to every layer
(docs/checkpoints.md, "vLLM's CPU build drafts with the first layer's k_norm"); the agreement check
(tests/test_vllm_agreement.py) runs both.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

_IDS = itertools.count()  # request ids unique over the worker's life


def _counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [int(v) for v in m.values]
    return out


def _delta(after: dict, before: dict) -> dict:
    per_pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0)
               for i, a in enumerate(after["per_pos"])]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")} | {"per_pos": per_pos}


def _until_eos(ids: list[int], eos) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids


def _fix_grouped_rms_norm() -> None:
    """Per-layer ``k_norm`` on the drafter's context keys, in plain torch (what the GPU kernel computes)."""
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    def normalize_context_k(self, all_k):  # [L, n, heads, head_dim], weights [L, head_dim]
        x = all_k.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
        return (x * self._k_norm_weights.float()[:, None, None, :]).to(all_k.dtype)

    DFlashQwen3Model._normalize_context_k = normalize_context_k


def main() -> None:
    cfg = json.loads(sys.argv[1])
    extra = {}
    if cfg.get("fix_grouped_rms_norm"):
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and model here: the patch must reach them
        extra["distributed_executor_backend"] = "uni"
        _fix_grouped_rms_norm()
    from vllm import LLM, SamplingParams

    spec = None
    if cfg.get("draft"):
        spec = {"method": "dflash", "model": cfg["draft"], "num_speculative_tokens": cfg["k"]}
    t0 = time.perf_counter()
    llm = LLM(model=cfg["target"], dtype="float32", max_model_len=cfg.get("max_model_len", 1024),
              max_num_seqs=cfg.get("max_num_seqs", 16), speculative_config=spec, seed=0, disable_log_stats=False, **extra)
    print("READY " + json.dumps({"start_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        eos = req.get("eos")  # exactly this one stops (the tokenizer's own eos may be another id)
        params = SamplingParams(temperature=0, max_tokens=req["max_new"], ignore_eos=True,
                                stop_token_ids=[] if eos is None else [eos])
        # Every queue starts from an empty prefix cache: the rounds replay the same prompts, and prefix caching (on by
        # default in vLLM) would otherwise serve a round's prompts from the pages the previous round left, a prefill
        # no new workload gets (ours keeps none between calls). Within a queue, requests still share what they share.
        llm.reset_prefix_cache()
        before = _counters(llm)
        t0 = time.perf_counter()
        tokens = _queue(llm.llm_engine, req["prompts"], params, req.get("in_flight", len(req["prompts"])))
        seconds = time.perf_counter() - t0
        tokens = [_until_eos(t, eos) for t in tokens]
        print("RESULT " + json.dumps({"tokens": tokens, "seconds": seconds,
                                      "spec": _delta(_counters(llm), before)}), flush=True)


def _queue(engine, prompts: list[list[int]], params, in_flight: int) -> list[list[int]]:
    """Every prompt's output token ids, at most ``in_flight`` requests in the engine at any time."""
    todo, done, running = list(enumerate(prompts)), {}, 0
    while todo or running:
        while todo and running < in_flight:
            i, p = todo.pop(0)
            engine.add_request(f"{next(_IDS)}:{i}", {"prompt_token_ids": p}, params)
            running += 1
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.split(":")[1])] = list(out.outputs[0].token_ids)
                running -= 1
    return [done[i] for i in range(len(prompts))]


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is required
    main()
