"""``dflash-serve`` under load: Poisson arrivals at a sweep of request rates, time to first token (TTFT), inter-token
latency (ITL) and throughput, DFlash against plain decoding behind the same server, and prefix caching on/off on
prompts that share a 512-token system prompt.

    OMP_NUM_THREADS=1 python benchmarks/bench_serve.py [--rates auto|0.5,1,2,...] [--requests 40] [--min-seconds 10]
        [--max-tokens 64] [--prefix-rate 1] [--prefix-requests 40] [--seed 0] [--out benchmarks/results]

Every server is its own process (``python -m dflash_compile.serve``, the shipped default pair, backend ``dflash``,
``--precompile``, ``OMP_NUM_THREADS=1``, compile cache ``--cache-dir`` through ``$DFLASH_COMPILE_CACHE_DIR``), started
and stopped by this script, one at a time; the load comes from this process (asyncio + httpx, streamed completions,
server-sent events). Three servers, in this order:

1. ``dflash``: speculation on (``speculation="auto"``, the CLI's default), ``--no-prefix-caching``: the rate sweep,
   then the prefix workload with prefix caching off.
2. ``plain``: the same pair and options with ``--speculative-config '{"method": "dflash", "model": DRAFT,
   "num_speculative_tokens": 0}'`` (every step verifies no draft and proposes none): the rate sweep.
3. ``dflash_prefix``: as 1 with ``--prefix-caching`` (the server's default): the prefix workload.

The sweep runs with prefix caching off so that every request's TTFT includes its whole prefill (the sweep reuses
HumanEval prompts across rates; with caching on, later rates would find their prompts cached).

Per server: wait for the "serving" line and ``/health`` (the precompile time is reported), then one untimed warm-up
pass (a burst of ``3 x max batch`` requests, which also measures the saturation throughput for ``--rates auto``, then
a few sequential ones), then ``--idle-requests`` sequential requests (the idle TTFT/ITL: no queue, batch 1), then the
timed passes. Workloads, greedy (``temperature: 0``), ``max_tokens`` = ``--max-tokens``:

- sweep: HumanEval prompts (``dflash_compile.training.loops.humaneval_prompts``) as text, in a rotating order (each
  rate starts where the previous one ended); the same requests and arrival times for ``dflash`` and ``plain``.
  Arrivals: exponential gaps from ``random.Random(seed + rate index)``; ``max(--requests, rate x --min-seconds)``
  requests per rate. ``--rates auto``: 0.5 req/s, doubling until 1.5x the probed saturation rate.
- prefix: ``--system-tokens`` (512) tokens of Python source (the stdlib's ``textwrap.py``) + a distinct suffix per
  request (a HumanEval prompt from its first ``def``, at most ``--suffix-tokens`` tokens), sent as token ids, at
  ``--prefix-rate`` req/s. Warm-up and timed passes use different suffixes, so the timed pass finds only the
  system prompt cached (a steady state where the system prompt is already in the cache).

What is measured, per request, in this process: the send time; each server-sent event's arrival (``time.perf_counter``
at the line); the text; the token count from the last chunk's ``usage`` (``stream_options: {"include_usage": true}``).
A step yields 1 to 8 tokens with DFlash, and the server sends them as one chunk or, when its event loop wakes between
two tokens of a step, as several chunks a fraction of a millisecond apart: chunks are neither tokens nor steps. Each
chunk's token count is found by matching the streamed text so far against the request's greedy tokens from
``target.generate`` (computed in this process before any server starts; the streamed text must equal their decode,
which checks every output); chunks less than ``--same-step-ms`` after the previous one are counted with its step.
TTFT: send to the first chunk. ITL: each step's gap shared among the tokens it brought (one observation per token:
the server's own ``inter_token_latency_seconds`` definition, with a step's split chunks joined); TPOT per request:
``(last chunk - first chunk) / (tokens - 1)``. Throughput: output tokens of completed requests / (first send to last
completion). From the server's ``/metrics`` (differences over each pass): its own TTFT and ITL histogram means, the
acceptance length, prefix-cache hits/queries. Other processes' CPU use during each configuration (``/proc/stat``
less this process's and the server's CPU time) and the load average before/after are recorded; a configuration where
others used more than ``--busy-cores`` is marked.

Writes ``bench_serve.{json,md,png}`` under ``--out``; server logs under ``build/bench_serve/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = "dflash-default"


# ---------------------------------------------------------------------------------------------- the machine
def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _cpu_busy_s() -> float:
    """Seconds of CPU time spent by everything on the machine (all cores), from ``/proc/stat``."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = f[3] + f[4]  # idle + iowait
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` (its threads, and its children it waited for)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """CPU used by other processes between ``start()`` and ``stop()``, in cores: the machine's busy time less this
    process's own and its children's (a server counts once ``stop()`` follows its exit and reaping)."""

    def start(self) -> None:
        self.t0, self.load0 = time.monotonic(), loadavg()
        self.busy0, self.ours0 = _cpu_busy_s(), _proc_cpu_s(os.getpid())

    def stop(self) -> dict:
        seconds = time.monotonic() - self.t0
        ours = _proc_cpu_s(os.getpid()) - self.ours0
        others = max(0.0, _cpu_busy_s() - self.busy0 - ours)
        return {"seconds": round(seconds, 1), "loadavg_before": self.load0, "loadavg_after": loadavg(),
                "our_cores": round(ours / seconds, 2), "other_cores": round(others / seconds, 2)}


# ---------------------------------------------------------------------------------------------- the server
class Server:
    """``python -m dflash_compile.serve ARGS`` in its own process, on a free port; logs to ``log``."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict, cwd: Path):
        self.name, self.log, self.env, self.cwd = name, log, env, cwd
        self.cmd = [sys.executable, "-m", "dflash_compile.serve", *args, "--port", "0", "--log-level", "warning"]

    def start(self, timeout: float) -> dict:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
        self.url, serving = None, None
        while self.url is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: the server exited with {self.proc.returncode}:\n"
                                   + self.log.read_text()[-3000:])
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise TimeoutError(f"{self.name}: no 'serving' line after {timeout:.0f} s (see {self.log})")
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("dflash-serve: serving") and " on http" in line:
                    self.url, serving = line.rsplit(" on ", 1)[1].strip(), time.monotonic() - t0
            time.sleep(0.1)
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        graphs: dict[str, list] = {}  # precompile's lines "<key>: compiled in 23.2 s" / "loaded in 0.4 s"
        for seg in self.log.read_text(errors="replace").replace("\r", "\n").splitlines():
            how, _, rest = seg.rpartition(": ")[2].partition(" in ")
            if how in ("compiled", "loaded", "ready") and rest.endswith(" s"):
                n_s = graphs.setdefault(how, [0, 0.0])
                n_s[0], n_s[1] = n_s[0] + 1, round(n_s[1] + float(rest[:-2]), 1)
        return {"serving_s": round(serving, 1), "healthy_s": round(time.monotonic() - t0, 1),
                "graphs": {how: {"count": n, "seconds": sec} for how, (n, sec) in graphs.items()}}

    def metrics(self) -> dict[tuple, float]:
        """``/metrics`` as ``{(name, labels...): value}`` (the ``model_name`` label dropped)."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10).text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, *labels)] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the server's own shutdown: exits 0
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def metric_delta(before: dict, after: dict, name: str, *labels) -> float:
    key = (name, *labels)
    return after.get(key, 0.0) - before.get(key, 0.0)


def server_stats(before: dict, after: dict) -> dict:
    """What the server saw during a pass, from its counters and histograms."""
    d = lambda n, *lab: metric_delta(before, after, f"dflash:{n}", *lab)  # noqa: E731
    drafts, accepted = d("spec_decode_num_drafts_total"), d("spec_decode_num_accepted_tokens_total")
    ttft_n, itl_n = d("time_to_first_token_seconds_count"), d("inter_token_latency_seconds_count")
    queries, hits = d("prefix_cache_queries_total"), d("prefix_cache_hits_total")
    return {"ttft_mean_ms": 1e3 * d("time_to_first_token_seconds_sum") / ttft_n if ttft_n else None,
            "itl_mean_ms": 1e3 * d("inter_token_latency_seconds_sum") / itl_n if itl_n else None,
            "generation_tokens": d("generation_tokens_total"), "prompt_tokens": d("prompt_tokens_total"),
            "drafts": drafts, "draft_tokens": d("spec_decode_num_draft_tokens_total"),
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else None}


def package_at(rev: str, root: Path) -> tuple[str, Path]:
    """``(commit, dir)``: the ``dflash_compile`` package as committed at ``rev``, extracted once under
    ``root/<commit>/`` (the servers import it from there, with ``PYTHONPATH``)."""
    from pairs import _git  # benchmarks/pairs.py

    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    out = root / commit
    if not (out / "dflash_compile" / "__init__.py").is_file():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(f"git -C {shlex.quote(str(ROOT))} archive {commit} dflash_compile | tar -x -C "
                       f"{shlex.quote(str(out))}", shell=True, check=True)
    return commit, out


# ---------------------------------------------------------------------------------------------- the client
async def _one(client: httpx.AsyncClient, url: str, payload: dict, start: float, at: float) -> dict:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    rec = {"at": at, "sent": time.perf_counter() - start, "chunks": [], "usage": None, "finish": None,
           "status": None, "error": None}
    t_send = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode(errors="replace")[:300]
                return rec
            async for line in r.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    rec["error"] = event["error"].get("message")
                elif event.get("choices"):
                    choice = event["choices"][0]
                    rec["chunks"].append((now - t_send, choice["text"]))
                    rec["finish"] = choice["finish_reason"] or rec["finish"]
                elif event.get("usage"):
                    rec["usage"] = event["usage"]
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["done"] = time.perf_counter() - start
    return rec


def run_pass(url: str, prompts: list, arrivals: list[float], max_tokens: int) -> tuple[list[dict], float]:
    """Send ``prompts[i]`` at ``arrivals[i]`` seconds (streamed, greedy); -> (records, wall seconds)."""

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            start = time.perf_counter()
            recs = await asyncio.gather(*(
                _one(client, url, {"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                   "stream": True, "stream_options": {"include_usage": True}}, start, at)
                for p, at in zip(prompts, arrivals)))
            return recs, time.perf_counter() - start

    return asyncio.run(main())


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------------------------------------- workloads
class Workloads:
    """The prompts (text for the sweep, token ids for the prefix workload), each prompt's greedy reference tokens,
    and the decoded text of every prefix of them (to count the tokens behind a streamed text)."""

    def __init__(self, args, pair: tuple[Path, Path]):
        from transformers import AutoTokenizer

        from dflash_compile.training.loops import humaneval_prompts

        self.args = args
        self.target_dir, self.draft_dir = (str(p) for p in pair)
        self.tok = AutoTokenizer.from_pretrained(self.target_dir)
        self.humaneval = humaneval_prompts(0, 163)
        import textwrap

        system = self.tok(Path(textwrap.__file__).read_text()).input_ids
        if len(system) < args.system_tokens:
            raise SystemExit(f"textwrap.py has only {len(system)} tokens, --system-tokens {args.system_tokens}")
        self.system = system[:args.system_tokens]
        self.suffixes = []
        for p in self.humaneval:
            body = p[p.index("def "):] if "def " in p else p
            self.suffixes.append(self.tok(body).input_ids[:args.suffix_tokens])
        self.reference: dict[tuple, list[int]] = {}
        self.prefix_text: dict[tuple, list[str]] = {}

    def ids(self, prompt) -> list[int]:
        return prompt if isinstance(prompt, list) else self.tok(prompt).input_ids

    def prefix_prompt(self, i: int) -> list[int]:
        return self.system + self.suffixes[i % len(self.suffixes)]

    def compute_references(self, prompts: list) -> float:
        """``target.generate`` greedy (batch 1) for every distinct prompt: the tokens each stream must decode to."""
        import torch
        from _harness import load_pair  # benchmarks/_harness.py

        t0 = time.perf_counter()
        target, _ = load_pair(self.target_dir, self.draft_dir)
        eos = self.tok.eos_token_id
        with torch.no_grad():
            for p in prompts:
                ids = self.ids(p)
                if tuple(ids) in self.reference:
                    continue
                seq = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=self.args.max_tokens,
                                      eos_token_id=eos, pad_token_id=self.tok.pad_token_id)[0, len(ids):].tolist()
                new = seq[: seq.index(eos) + 1] if eos in seq else seq
                self.reference[tuple(ids)] = new
                self.prefix_text[tuple(ids)] = [self.tok.decode(new[:n], skip_special_tokens=True)
                                                for n in range(len(new) + 1)]
        return time.perf_counter() - t0

    def token_counts(self, prompt, texts: list[str], total: int) -> list[int] | None:
        """Tokens received after each chunk (cumulative), from the streamed text against the reference; None when
        the text is not the reference's (then the output differs from ``target.generate``)."""
        ref = self.prefix_text[tuple(self.ids(prompt))]
        if "".join(texts) != ref[-1] or total != len(ref) - 1:
            return None
        counts, so_far, n = [], "", 0
        for t in texts:
            so_far += t
            while ref[n] != so_far:  # the fewest tokens whose text is what arrived so far
                n += 1
            counts.append(n)
        counts[-1] = total  # tokens with no text of their own (eos) came with the last chunk
        return counts


# ---------------------------------------------------------------------------------------------- analysis
def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def steps(times: list[float], counts: list[int], same_step_s: float) -> tuple[list[float], list[int]]:
    """Chunks regrouped into the steps that produced them: the server may split one step's tokens over several
    server-sent events (its event loop can wake between two tokens of a step), so chunks closer than
    ``same_step_s`` to the previous one join its step; -> (each step's last chunk time, tokens received by then)."""
    t_out, n_out = [times[0]], [counts[0]]
    for t, n in zip(times[1:], counts[1:]):
        if t - t_out[-1] < same_step_s and len(t_out) > 1:  # never merge into the prefill's first token
            t_out[-1], n_out[-1] = t, n
        else:
            t_out.append(t)
            n_out.append(n)
    return t_out, n_out


def summarize(recs: list[dict], prompts: list, wall: float, work: Workloads) -> dict:
    done = [r["status"] == 200 and r["finish"] is not None and r["usage"] and not r["error"] for r in recs]
    ok = [(r, p) for r, p, d in zip(recs, prompts, done) if d]
    ttft, itl, tpot, e2e, identical, chunks, nsteps = [], [], [], [], 0, 0, 0
    for r, p in ok:
        times = [t for t, _ in r["chunks"]]
        total = r["usage"]["completion_tokens"]
        counts = work.token_counts(p, [x for _, x in r["chunks"]], total)
        identical += counts is not None
        if counts is None:  # not the reference text: share the tokens evenly among the chunks
            counts = [round(total * (i + 1) / len(times)) for i in range(len(times))]
        r["counts"] = counts
        ttft.append(times[0])
        e2e.append(times[-1])
        chunks += len(times)
        st, sn = steps(times, counts, work.args.same_step_ms / 1e3)
        nsteps += len(st)
        itl += [0.0] * (sn[0] - 1)  # tokens that came with the first
        for i in range(1, len(st)):
            m = sn[i] - sn[i - 1]
            itl += [(st[i] - st[i - 1]) / m] * m if m else []
        if total > 1:
            tpot.append((times[-1] - times[0]) / (total - 1))
    tokens = sum(r["usage"]["completion_tokens"] for r, _ in ok)
    first_send = min(r["sent"] for r in recs)
    last_done = max(r["done"] for r, _ in ok) if ok else first_send
    ms = lambda xs, q: None if pct(xs, q) is None else 1e3 * pct(xs, q)  # noqa: E731
    return {"requests": len(recs), "completed": len(ok), "identical": identical,
            "errors": sorted({f"{r['status']}: {str(r['error'])[:120]}" for r, d in zip(recs, done) if not d}),
            "tokens": tokens, "chunks": chunks, "steps": nsteps, "tokens_per_step": tokens / nsteps if nsteps else None,
            "wall_s": wall, "throughput_tok_s": tokens / (last_done - first_send) if ok else 0.0,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else None, "itl_p50_ms": ms(itl, 50),
            "itl_p99_ms": ms(itl, 99), "itl_mean_ms": 1e3 * statistics.fmean(itl) if itl else None,
            "tpot_p50_ms": ms(tpot, 50), "e2e_p50_ms": ms(e2e, 50), "itl_observations": len(itl),
            "max_send_lag_ms": 1e3 * max(r["sent"] - r["at"] for r in recs)}


# ---------------------------------------------------------------------------------------------- the run
class Bench:
    def __init__(self, args):
        self.args = args
        self.logs = ROOT / "build" / "bench_serve"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
                    "DFLASH_COMPILE_CACHE_DIR": str(Path(args.cache_dir).resolve())}
        self.source, self.cwd = "the working tree", ROOT
        pair = None
        if args.revision:  # the package as committed: edits to a shared tree during the run change nothing here
            commit, self.cwd = package_at(args.revision, self.logs / "src")
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.cwd), os.environ.get("PYTHONPATH")]))
            self.source = f"revision {commit}"
            assets = self.cwd / "dflash_compile" / "assets"
            folder = next(f for f in (assets / "tiny_pair", assets / "default_pair") if f.is_dir())  # its old name
            pair = tuple(folder / d for d in ("target", "draft"))
        if pair is None:
            from dflash_compile.assets import default_pair_paths

            pair = default_pair_paths()
        self.work = Workloads(args, pair)
        self.raw: dict[str, list] = {}  # per pass, per request: chunk arrival times and token counts
        n = len(self.work.humaneval)
        self.warm = [self.work.humaneval[(n - 1 - i) % n] for i in range(3 * args.max_batch_size + 4)]
        step = max(1, n // args.idle_requests)  # spread over the set: prompt lengths like the sweep's
        self.idle = self.work.humaneval[::step][:args.idle_requests]
        self.prefix_warm = [self.work.prefix_prompt(n - 1 - i) for i in range(args.prefix_warmup)]
        self.prefix_timed = [self.work.prefix_prompt(i) for i in range(args.prefix_requests)]
        self.prefix_arrivals = poisson_arrivals(args.prefix_rate, args.prefix_requests, args.seed + 1000)

    def server(self, name: str, speculate: bool, prefix_caching: bool) -> Server:
        flags = ["--precompile", "--max-batch-size", str(self.args.max_batch_size),
                 "--prefix-caching" if prefix_caching else "--no-prefix-caching"]
        if not speculate:  # the same pair, every step verifying no draft (the CLI needs --target for a config)
            cfg = json.dumps({"method": "dflash", "model": self.work.draft_dir, "num_speculative_tokens": 0})
            flags = ["--target", self.work.target_dir, "--speculative-config", cfg,
                     "--served-model-name", MODEL, *flags]
        return Server(name, flags, self.logs / f"{name}.log", self.env, self.cwd)

    def sweep_plan(self, rates: list[float]) -> list[dict]:
        plan, cursor, n = [], 0, len(self.work.humaneval)
        for i, rate in enumerate(rates):
            k = max(self.args.requests, math.ceil(rate * self.args.min_seconds))
            plan.append({"rate": rate, "prompts": [self.work.humaneval[(cursor + j) % n] for j in range(k)],
                         "arrivals": poisson_arrivals(rate, k, self.args.seed + i)})
            cursor += k
        return plan

    def timed(self, srv: Server, prompts, arrivals, label: str) -> dict:
        before = srv.metrics()
        recs, wall = run_pass(srv.url, prompts, arrivals, self.args.max_tokens)
        out = summarize(recs, prompts, wall, self.work)
        out["server"] = server_stats(before, srv.metrics())
        out["drafting_step_share"] = out["server"]["drafts"] / out["steps"] if out["steps"] else None
        self.raw[f"{self.current}: {label}"] = [
            {"at": r["at"], "sent": r["sent"], "status": r["status"],
             "chunk_ms": [round(1e3 * t, 2) for t, _ in r["chunks"]], "tokens_after_chunk": r.get("counts")}
            for r in recs]
        print(f"  {label}: {out['completed']}/{out['requests']} done ({out['identical']} identical), TTFT p50 "
              f"{out['ttft_p50_ms']:.1f} p99 {out['ttft_p99_ms']:.1f} ms, ITL p50 {out['itl_p50_ms']:.2f} p99 "
              f"{out['itl_p99_ms']:.2f} ms, {out['throughput_tok_s']:.0f} tok/s, {wall:.1f} s", flush=True)
        return out

    def configuration(self, name: str, speculate: bool, prefix_caching: bool, passes) -> dict:
        """Start a server, warm it up, run ``passes(srv, result)``, stop it; -> its results."""
        srv = self.server(name, speculate, prefix_caching)
        self.current = name
        load = OtherLoad()
        load.start()
        print(f"{name}: {shlex.join(srv.cmd[1:])}", flush=True)
        where = "" if self.cwd == ROOT else f"cd {self.cwd.relative_to(ROOT)} && PYTHONPATH=. "
        cache = shlex.quote(self.env["DFLASH_COMPILE_CACHE_DIR"])
        res = {"command": f"{where}OMP_NUM_THREADS=1 DFLASH_COMPILE_CACHE_DIR={cache} "
                          + shlex.join(["python", *srv.cmd[1:]]),
               "start": srv.start(self.args.start_timeout)}
        print(f"  ready: 'serving' after {res['start']['serving_s']} s (graphs {res['start']['graphs']}), "
              f"/health after {res['start']['healthy_s']} s", flush=True)
        try:
            # untimed warm-up: a burst (every batch bucket; the saturation probe), then sequential requests
            burst = self.warm[: 3 * self.args.max_batch_size]
            t0 = time.perf_counter()
            recs, wall = run_pass(srv.url, burst, [0.0] * len(burst), self.args.max_tokens)
            warm = summarize(recs, burst, wall, self.work)
            res["warmup_burst"] = {k: warm[k] for k in ("requests", "completed", "identical", "throughput_tok_s",
                                                        "wall_s")}
            res["saturation_req_s"] = warm["completed"] / wall
            for p in self.warm[3 * self.args.max_batch_size:]:
                run_pass(srv.url, [p], [0.0], self.args.max_tokens)
            print(f"  warm-up: burst of {len(burst)} in {wall:.1f} s ({warm['throughput_tok_s']:.0f} tok/s, "
                  f"{res['saturation_req_s']:.2f} req/s), warm-up total {time.perf_counter() - t0:.1f} s", flush=True)
            passes(srv, res)
        finally:
            srv.stop()
            res["load"] = load.stop()
            res["busy"] = res["load"]["other_cores"] > self.args.busy_cores
            print(f"  load: {res['load']}" + (" BUSY" if res["busy"] else ""), flush=True)
        return res

    def idle_pass(self, srv: Server) -> dict:
        """``--idle-requests`` requests one after another: no queue, batch 1."""
        before = srv.metrics()
        recs = []
        for p in self.idle:
            recs += run_pass(srv.url, [p], [0.0], self.args.max_tokens)[0]
        out = summarize(recs, self.idle, sum(r["done"] for r in recs), self.work)
        out["server"] = server_stats(before, srv.metrics())
        out["drafting_step_share"] = out["server"]["drafts"] / out["steps"] if out["steps"] else None
        print(f"  idle: TTFT p50 {out['ttft_p50_ms']:.1f} ms, ITL p50 {out['itl_p50_ms']:.2f} ms", flush=True)
        return out

    def run(self) -> dict:
        a = self.args
        t_start = time.perf_counter()
        from _harness import machine

        results = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                               "python": platform.python_version(), "torch_process": machine()},
                   "command": "OMP_NUM_THREADS=1 python " + shlex.join(sys.argv), "args": vars(a),
                   "served_package": self.source}
        import torch
        import transformers

        results["machine"].update(torch=torch.__version__, transformers=transformers.__version__)
        fixed = None if a.rates == "auto" else [float(r) for r in a.rates.split(",")]
        plan = self.sweep_plan(fixed) if fixed else None
        t0 = time.perf_counter()
        # before any server starts: with --rates auto the sweep's prompts are not known yet, so every HumanEval prompt
        sweep = self.work.humaneval if plan is None else [p for step in plan for p in step["prompts"]]
        self.work.compute_references(self.warm + self.idle + sweep + self.prefix_warm + self.prefix_timed)
        print(f"references (target.generate greedy): {len(self.work.reference)} prompts in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)

        def dflash_passes(srv, res):
            nonlocal plan
            res["idle"] = self.idle_pass(srv)
            if plan is None:
                rates, r = [], 0.5
                while not rates or rates[-1] < 1.5 * res["saturation_req_s"]:
                    rates.append(r)
                    r *= 2
                plan = self.sweep_plan(rates)
                print(f"  rates {rates} (saturation probe {res['saturation_req_s']:.2f} req/s)", flush=True)
            res["sweep"] = self.sweep(srv, plan)
            self.prefix_pass(srv, res)

        def plain_passes(srv, res):
            res["idle"] = self.idle_pass(srv)
            res["sweep"] = self.sweep(srv, plan)

        configs = results["configurations"] = {}
        configs["dflash"] = self.configuration("dflash", True, False, dflash_passes)
        configs["plain"] = self.configuration("plain", False, False, plain_passes)
        configs["dflash_prefix"] = self.configuration("dflash_prefix", True, True, self.prefix_pass)
        results["rates"] = [step["rate"] for step in plan]
        results["requests_per_rate"] = [len(step["prompts"]) for step in plan]
        results["goals"] = goals(results)
        results["wall_s"] = time.perf_counter() - t_start
        return results

    def sweep(self, srv: Server, plan: list[dict]) -> list[dict]:
        return [{"rate": step["rate"], **self.timed(srv, step["prompts"], step["arrivals"], f"{step['rate']} req/s")}
                for step in plan]

    def prefix_pass(self, srv: Server, res: dict) -> None:
        """The shared-system-prompt workload: an untimed warm-up with other suffixes, then the timed pass."""
        run_pass(srv.url, self.prefix_warm, [0.3 * i for i in range(len(self.prefix_warm))], self.args.max_tokens)
        res["prefix"] = self.timed(srv, self.prefix_timed, self.prefix_arrivals,
                                   f"prefix {self.args.prefix_rate} req/s")
        res["prefix"]["server_totals"] = {k: v for (k, *lab), v in srv.metrics().items()
                                          if k.startswith("dflash:prefix_cache") and not lab}


def goals(results: dict) -> dict:
    c = results["configurations"]
    off, on = c["dflash"]["prefix"], c["dflash_prefix"]["prefix"]
    d, p = c["dflash"]["sweep"], c["plain"]["sweep"]
    ttft = off["ttft_p50_ms"] / on["ttft_p50_ms"]
    itl = p[0]["itl_p50_ms"] / d[0]["itl_p50_ms"]
    tpot = p[0]["tpot_p50_ms"] / d[0]["tpot_p50_ms"]
    thr = d[-1]["throughput_tok_s"] / p[-1]["throughput_tok_s"]
    return {
        "prefix_ttft_p50_off_over_on": {"value": ttft, "goal": 3.0, "met": ttft >= 3.0},
        "prefix_ttft_p99_off_over_on": {"value": off["ttft_p99_ms"] / on["ttft_p99_ms"]},
        "itl_p50_plain_over_dflash_lowest_rate": {"value": itl, "goal": 1.5, "met": itl >= 1.5, "rate": d[0]["rate"]},
        # the same goal read per request: (last chunk - first chunk) / (tokens - 1), p50 over requests
        "tpot_p50_plain_over_dflash_lowest_rate": {"value": tpot, "goal": 1.5, "met": tpot >= 1.5},
        "throughput_dflash_over_plain_highest_rate": {"value": thr, "goal": 1.0, "met": thr >= 1.0,
                                                      "rate": d[-1]["rate"]},
    }


# ---------------------------------------------------------------------------------------------- report
def _f(x, nd=1):
    return "" if x is None else f"{x:.{nd}f}"


def markdown(r: dict) -> str:
    a, m, c, g = r["args"], r["machine"], r["configurations"], r["goals"]
    busy = [n for n, x in c.items() if x["busy"]]
    lines = [f"# `dflash-serve` under load ({m['cpu']}, {m['cores']} cores; torch {m['torch']}, transformers "
             f"{m['transformers']})", "",
             f"Command: `{r['command']}` (wall time {r['wall_s'] / 60:.1f} min). Servers ({r['served_package']}), one "
             "at a time, each its own process:", ""]
    lines += [f"- `{n}`: `{x['command']}`" for n, x in c.items()]
    lines += ["", f"The shipped default pair, backend `dflash`, `--precompile`, max batch {a['max_batch_size']}; "
              f"greedy (`temperature: 0`), `max_tokens` {a['max_tokens']}, streamed. Sweep: HumanEval prompts, "
              f"Poisson arrivals (seeded), the same requests and arrival times for both servers, prefix caching off. "
              "TTFT: send to first chunk; ITL: each step's gap shared among the tokens it brought (one observation per "
              f"token; chunks under {a['same_step_ms']} ms apart joined into one step); TPOT: per request, (last "
              "chunk - first chunk) / (tokens - 1); throughput: output tokens / (first send to last completion). Every "
              "streamed text was checked against `target.generate` greedy.", ""]
    if busy:
        lines += [f"**Busy machine:** other processes used more than {a['busy_cores']} cores during {busy} (column "
                  "'others' below): those figures were taken on a busy machine.", ""]
    lines += ["## Goals (issue 23)", "",
              "| goal | measured | |", "|---|---|---|",
              f"| TTFT p50 >= 3x lower with prefix caching (512-token shared prefix, {a['prefix_rate']} req/s) | "
              f"{g['prefix_ttft_p50_off_over_on']['value']:.2f}x | {_met(g['prefix_ttft_p50_off_over_on'])} |",
              f"| ITL p50 at low load ({g['itl_p50_plain_over_dflash_lowest_rate']['rate']} req/s) >= 1.5x better "
              f"with DFlash | {g['itl_p50_plain_over_dflash_lowest_rate']['value']:.2f}x | "
              f"{_met(g['itl_p50_plain_over_dflash_lowest_rate'])} |",
              f"| the same, read as TPOT p50 (per request: decode time / (tokens - 1)) | "
              f"{g['tpot_p50_plain_over_dflash_lowest_rate']['value']:.2f}x | "
              f"{_met(g['tpot_p50_plain_over_dflash_lowest_rate'])} |",
              f"| throughput at saturation ({g['throughput_dflash_over_plain_highest_rate']['rate']} req/s) >= 1.0x "
              f"plain | {g['throughput_dflash_over_plain_highest_rate']['value']:.2f}x | "
              f"{_met(g['throughput_dflash_over_plain_highest_rate'])} |", "",
              "## Request-rate sweep: DFlash (`auto`) against plain decoding (`num_speculative_tokens: 0`)", "",
              "| rate (req/s) | requests | completed D / P | TTFT p50 D / P (ms) | TTFT p99 D / P (ms) | "
              "ITL p50 D / P (ms) | ITL p99 D / P (ms) | tok/s D / P | tok/s D/P | ITL p50 P/D | D: acceptance (steps "
              "drafting) |",
              "|---" * 11 + "|"]
    for d, p in zip(c["dflash"]["sweep"], c["plain"]["sweep"]):
        lines.append(
            f"| {d['rate']:g} | {d['requests']} | {d['completed']} / {p['completed']} | "
            f"{_f(d['ttft_p50_ms'])} / {_f(p['ttft_p50_ms'])} | {_f(d['ttft_p99_ms'])} / {_f(p['ttft_p99_ms'])} | "
            f"{_f(d['itl_p50_ms'], 2)} / {_f(p['itl_p50_ms'], 2)} | {_f(d['itl_p99_ms'], 2)} / {_f(p['itl_p99_ms'], 2)}"
            f" | {d['throughput_tok_s']:.0f} / {p['throughput_tok_s']:.0f} | "
            f"{d['throughput_tok_s'] / p['throughput_tok_s']:.2f}x | {p['itl_p50_ms'] / d['itl_p50_ms']:.2f}x | "
            f"{_f(d['server']['acceptance_length'], 2)} ({100 * (d['drafting_step_share'] or 0):.0f}%) |")
    idle = {n: c[n]["idle"] for n in ("dflash", "plain")}
    lines += ["", f"Idle (one request at a time, {a['idle_requests']} requests): TTFT p50 DFlash "
              f"{_f(idle['dflash']['ttft_p50_ms'])} / plain {_f(idle['plain']['ttft_p50_ms'])} ms; ITL p50 "
              f"{_f(idle['dflash']['itl_p50_ms'], 2)} / {_f(idle['plain']['itl_p50_ms'], 2)} ms; TPOT p50 "
              f"{_f(idle['dflash']['tpot_p50_ms'], 2)} / {_f(idle['plain']['tpot_p50_ms'], 2)} ms; tokens per step "
              f"{_f(idle['dflash']['tokens_per_step'], 2)} / {_f(idle['plain']['tokens_per_step'], 2)}; DFlash steps "
              f"that verified drafts {_f(100 * (idle['dflash']['drafting_step_share'] or 0), 0)}%.", "",
              "Where TTFT goes, per rate (p50, ms): idle TTFT (HTTP, tokenizing, the wait for the step in flight, "
              "prefill) and the rest (queueing behind other requests and their prefills); client TTFT mean against the "
              "server's own (its histogram: arrival in the handler to the first token), the difference being HTTP and "
              "the event loop. The idle requests are every n-th HumanEval prompt, each rate's are others, so the split "
              "is approximate (a negative remainder is a difference in prompt lengths):", "",
              "| rate | D: TTFT p50 = idle + queueing | P: TTFT p50 = idle + queueing | D: client / server mean | "
              "P: client / server mean | tokens per step D / P | TPOT p50 D / P (ms) | client send lag max D / P "
              "(ms) |", "|---" * 8 + "|"]
    for d, p in zip(c["dflash"]["sweep"], c["plain"]["sweep"]):
        di, pi = idle["dflash"]["ttft_p50_ms"], idle["plain"]["ttft_p50_ms"]
        lines.append(f"| {d['rate']:g} | {_f(d['ttft_p50_ms'])} = {_f(di)} + {_f(d['ttft_p50_ms'] - di)} | "
                     f"{_f(p['ttft_p50_ms'])} = {_f(pi)} + {_f(p['ttft_p50_ms'] - pi)} | "
                     f"{_f(d['ttft_mean_ms'])} / {_f(d['server']['ttft_mean_ms'])} | "
                     f"{_f(p['ttft_mean_ms'])} / {_f(p['server']['ttft_mean_ms'])} | "
                     f"{_f(d['tokens_per_step'], 2)} / {_f(p['tokens_per_step'], 2)} | "
                     f"{_f(d['tpot_p50_ms'], 2)} / {_f(p['tpot_p50_ms'], 2)} | "
                     f"{_f(d['max_send_lag_ms'])} / {_f(p['max_send_lag_ms'])} |")
    off, on = c["dflash"]["prefix"], c["dflash_prefix"]["prefix"]
    lines += ["", f"## Prefix caching: {a['system_tokens']}-token shared system prompt + a distinct suffix (<= "
              f"{a['suffix_tokens']} tokens), DFlash, {a['prefix_rate']} req/s, {a['prefix_requests']} requests", "",
              "| prefix caching | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | tok/s | server TTFT mean (ms) | "
              "hits / queries (tokens) | hit rate |", "|---" * 8 + "|"]
    for label, x in (("off", off), ("on", on)):
        s = x["server"]
        lines.append(f"| {label} | {_f(x['ttft_p50_ms'])} | {_f(x['ttft_p99_ms'])} | {_f(x['itl_p50_ms'], 2)} | "
                     f"{x['throughput_tok_s']:.0f} | {_f(s['ttft_mean_ms'])} | {s['prefix_cache_hits']:.0f} / "
                     f"{s['prefix_cache_queries']:.0f} | "
                     + (f"{100 * s['prefix_cache_hit_rate']:.1f}% |" if s["prefix_cache_hit_rate"] is not None
                        else "n/a |"))
    lines += ["", f"TTFT p50 off / on: **{g['prefix_ttft_p50_off_over_on']['value']:.2f}x**; p99 "
              f"{g['prefix_ttft_p99_off_over_on']['value']:.2f}x.", "",
              "## Servers: start-up and machine load", "",
              "| server | 'serving' line (s) | /health (s) | step graphs | warm-up burst | others (cores) | "
              "ours (cores) | load average before -> after |", "|---" * 8 + "|"]
    for n, x in c.items():
        L, w = x["load"], x["warmup_burst"]
        lines.append(f"| {n} | {x['start']['serving_s']} | {x['start']['healthy_s']} | {x['start']['graphs']} | "
                     f"{w['requests']} requests, {w['throughput_tok_s']:.0f} tok/s | {L['other_cores']}"
                     f"{' (busy)' if x['busy'] else ''} | {L['our_cores']} | "
                     f"{' '.join(map(str, L['loadavg_before']))} -> {' '.join(map(str, L['loadavg_after']))} |")
    return "\n".join(lines) + "\n"


def _met(goal: dict) -> str:
    return "met" if goal["met"] else "missed"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = r["configurations"]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for name, style in (("dflash", "-"), ("plain", "--")):
        sweep = c[name]["sweep"]
        rates = [s["rate"] for s in sweep]
        for ax, key in ((axes[0], "ttft"), (axes[1], "itl")):
            for q, marker in ((50, "o"), (99, "^")):
                ax.plot(rates, [s[f"{key}_p{q}_ms"] for s in sweep], style, marker=marker, label=f"{name} p{q}")
        axes[2].plot(rates, [s["throughput_tok_s"] for s in sweep], style, marker="o", label=name)
    for ax, title, ylabel in ((axes[0], "time to first token", "ms"), (axes[1], "inter-token latency", "ms"),
                              (axes[2], "throughput", "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    off, on = c["dflash"]["prefix"], c["dflash_prefix"]["prefix"]
    x = np.arange(2)
    axes[3].bar(x - 0.2, [off["ttft_p50_ms"], off["ttft_p99_ms"]], 0.4, label="prefix caching off")
    axes[3].bar(x + 0.2, [on["ttft_p50_ms"], on["ttft_p99_ms"]], 0.4, label="prefix caching on")
    axes[3].set_xticks(x, ["TTFT p50", "TTFT p99"])
    axes[3].set_ylabel("ms")
    axes[3].set_title(f"{r['args']['system_tokens']}-token shared prefix, {r['args']['prefix_rate']} req/s")
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="auto", help="req/s, comma-separated, or 'auto' (0.5 doubling past the "
                                                   "probed saturation)")
    p.add_argument("--requests", type=int, default=40, help="requests per rate (at least)")
    p.add_argument("--min-seconds", type=float, default=10.0, help="and at least rate x this many")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=8, help="the servers' --max-batch-size")
    p.add_argument("--idle-requests", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--prefix-rate", type=float, default=1.0)
    p.add_argument("--prefix-requests", type=int, default=40)
    p.add_argument("--prefix-warmup", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--same-step-ms", type=float, default=1.0,
                   help="chunks of a stream closer than this are counted as one step's tokens (split by the server)")
    p.add_argument("--busy-cores", type=float, default=0.25,
                   help="mark a configuration during which other processes used more CPU than this (cores)")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds to wait for a server (a cold "
                                                                       "precompile takes minutes)")
    p.add_argument("--cache-dir", default="build/dflash-cache", help="the servers' compile cache")
    p.add_argument("--revision", help="serve the package as committed at this git revision (extracted under "
                                      "build/bench_serve/src/), not the working tree")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="bench_serve", help="output files: NAME.{json,md,png}")
    p.add_argument("--report", metavar="JSON", help="run nothing: rewrite NAME.md and .png from this results file")
    args = p.parse_args()
    out = Path(args.out)
    if args.report:
        results = json.loads(Path(args.report).read_text())
        results["goals"] = goals(results)
        Path(args.report).write_text(json.dumps(results, indent=2) + "\n")
        (out / f"{args.name}.md").write_text(markdown(results))
        plot(results, out / f"{args.name}.png")
        print(markdown(results))
        return
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: OMP_NUM_THREADS is not 1 in this process (the servers get 1 regardless)", flush=True)
    bench = Bench(args)
    results = bench.run()
    (bench.logs / f"{args.name}_raw.json").write_text(json.dumps(bench.raw) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(markdown(results))
    plot(results, out / f"{args.name}.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
