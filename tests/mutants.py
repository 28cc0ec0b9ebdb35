"""Standing mutation check (``make mutants``): hand-made bugs the suite must catch.

Greedy output is lossless whatever the drafter does, so a bug in drafting, acceptance or the compiled drafter path
can leave every token-identity test green while the speed-up vanishes. Each mutation below is such a bug, written
as exact source replacements; for each one this script copies the repository (the files git tracks or would track)
into ``build/mutants/``, applies the replacements there — each pattern must match exactly once, or the run fails
saying so — runs the tests named for it in that copy, and calls the mutation killed when they fail. The working
tree is never touched, so a crash or an interrupt cannot leave it mutated. The run fails unless every mutation is
killed. It assumes the suite passes unmutated (CI runs ``make test`` first; ``--baseline`` checks it here).
Mutations run two at a time (each in its own copy, its pytest stopping at the first failure: one is a kill).

    python tests/mutants.py                 # all mutations
    python tests/mutants.py -k rope -k ratio  # those whose name contains one of the words
    python tests/mutants.py --list
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutants"
TIMEOUT_S = 600
PARALLEL = 2  # mutations at a time (each one pytest process)
SLOW_TESTS = ("test_tensor_parallel", "test_compiled_generate", "test_backends")  # minutes, not seconds


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (exact old text, new text), applied in order, each old text unique
    tests: tuple[str, ...]  # pytest node ids
    what: str


_DRAFT_QWEN3 = "tests/test_drafting.py::test_partly_right_drafter_is_accepted_as_far_as_it_is_right[qwen3]"
_FROM_SCRATCH = "tests/test_drafting.py::test_wrapper_drafts_are_the_drafter_on_the_whole_context[qwen3-fixed]"
_COMPILED = "tests/test_compiled_generate.py::test_compiled_equals_eager[qwen3]"
_TINY_PAIR = "tests/test_tiny_pair.py::test_tiny_pair_speculates_as_well_as_measured"
_LAW = "tests/test_sampling.py::test_sampled_law_matches_target"
_FROM_SCRATCH_SWITCHING = _FROM_SCRATCH.replace("-fixed]", "-switching]")

MUTANTS = (
    # ---- the table
    Mutant("greedy_accept_off_by_one", "dflash_compile/step/rejection.py",
           (("drafts == target_tokens[:, :-1]", "drafts == target_tokens[:, 1:]"),),
           ("tests/test_sampling.py::test_greedy_accept_values", _DRAFT_QWEN3),
           "greedy acceptance compares draft i with the target's token i + 1"),
    Mutant("propose_rope_offset", "dflash_compile/step/step.py",
           (("positions = ctx_lens[:, None] + torch.arange(B,", "positions = ctx_lens[:, None] + 1 + torch.arange(B,"),),
           (_DRAFT_QWEN3, _FROM_SCRATCH, _TINY_PAIR),
           "the drafter's block positions shifted by one (RoPE offset in propose)"),
    Mutant("compiled_drafter_pool_write_skipped", "dflash_compile/passes/paged_scatter.py",
           (("    torch.ops.dflash.paged_kv_write(pool, slots, values)",
             "    if lead < 2:\n        torch.ops.dflash.paged_kv_write(pool, slots, values)"),),
           (_COMPILED, "tests/test_backends.py::test_step_after_passes_keeps_only_dflash_ops_for_the_hot_patterns"),
           "the compiled write into the drafter pool is dropped by the paged_kv_write pass"),
    Mutant("cpu_paged_kv_write_ignores_5d", "dflash_compile/lowerings/ops.py",
           (("pool[..., slots, :, :] = values.to(pool.dtype)",
             "pool[..., slots, :, :] = values.to(pool.dtype) if pool.dim() < 5 else pool[..., slots, :, :]"),),
           (_COMPILED,),
           "the CPU paged_kv_write leaves 5-D pools (the drafter's) unwritten: the compiled drafter has no context"),
    Mutant("noise_ignores_position", "dflash_compile/step/rejection.py",
           (("(positions.to(torch.long) & _M32) * 0x2545F49", "(positions.to(torch.long) & _M32) * 0"),),
           (f"{_LAW}[top_k-position_noise]",
            "tests/test_sampling.py::test_position_noise_is_iid_gumbel_and_a_function_of_its_key"),
           "the sampling noise is keyed by the seed alone: a request's positions draw coupled tokens"),
    Mutant("verify_draws_with_its_input_position", "dflash_compile/step/step.py",
           (("self.next_tokens(logits, positions + 1, sampling)", "self.next_tokens(logits, positions, sampling)"),),
           (f"{_LAW}[top_k-position_noise]",),
           "verification draws the token at p + 1 with the noise of position p (the prefill's first token uses p)"),
    Mutant("drafts_drawn_with_another_positions_noise", "dflash_compile/step/step.py",
           (("drafts = self.next_tokens(logits, positions[:, 1:], sampling)",
             "drafts = self.next_tokens(logits, positions[:, :-1], sampling)"),),
           (f"{_LAW}[top_k-position_noise]",),
           "drafts drawn with the noise of the position before theirs: no coupling with the target's draw (speed)"),
    Mutant("target_ignores_top_p", "dflash_compile/step/step.py",
           (("sample_at_positions(process_logits(logits, p.temperature, p.top_k, p.top_p),",
             "sample_at_positions(process_logits(logits, p.temperature, p.top_k, p.top_p ** 0),"),),
           (f"{_LAW}[top_p_bonus-position_noise]",),
           "sampling ignores top_p"),
    Mutant("seed_depends_on_the_batch", "dflash_compile/runtime/batch.py",
           (("self.seeds[i] = r.sampling_seed() if a.do_sample else 0",
             "self.seeds[i] = r.sampling_seed() + i if a.do_sample else 0"),),
           ("tests/test_seeded_sampling.py::test_same_tokens_in_a_busy_batch_under_auto",),
           "a request's sampling seed depends on the row it holds in the batch"),
    Mutant("drafter_sees_position_ctx_len", "dflash_compile/models/draft_model.py",
           (("context_visibility(block_positions, ctx_lens,", "context_visibility(block_positions, ctx_lens + 1,"),),
           ("tests/test_draft_model.py::test_draft_forward_matches_fp64_transcription[qwen3-2]", _FROM_SCRATCH),
           "the drafter's mask shows it the context position ctx_len"),
    # ---- more places where a bug costs speed (or the sampled law) but not greedy tokens
    Mutant("inject_position_offset", "dflash_compile/step/step.py",
           (("self.draft.context_kv(ctx, positions)", "self.draft.context_kv(ctx, positions + 1)"),),
           (_FROM_SCRATCH,),
           "context K/V injected into the drafter cache with RoPE one position late"),
    Mutant("last_accepted_row_not_injected", "dflash_compile/step/step.py",
           (("device=block.device) <= num_accepted[:, None]", "device=block.device) < num_accepted[:, None]"),),
           (_FROM_SCRATCH,),
           "the last accepted token's context row never reaches the drafter"),
    Mutant("cpu_block_attention_sees_ctx_len", "dflash_compile/lowerings/cpu/block_attention.py",
           (("visible = block_attention_mask(ctx_lens,", "visible = block_attention_mask(ctx_lens + 1,"),),
           ("tests/lowerings/test_cpu_kernels.py::test_block_attention_matches_reference", _COMPILED),
           "the CPU block_attention lowering shows each query one context slot too many"),
    Mutant("rejected_writes_hit_slot_0", "dflash_compile/primitives/slots.py",
           (("torch.where(valid, slots, TRASH_SLOT)", "torch.where(valid, slots, 0)"),),
           (_DRAFT_QWEN3,),
           "padded and rejected positions write into a real slot instead of the trash slot"),
    Mutant("plain_step_skips_injection", "dflash_compile/step/step.py",
           (("        self.inject(aux, positions, accepted & in_capacity,",
             "        if not propose:\n            return tokens, num_accepted, bonus\n"
             "        self.inject(aux, positions, accepted & in_capacity,"),),
           (_FROM_SCRATCH_SWITCHING,),
           "a step that proposes nothing (before a plain step) keeps its accepted positions from the drafter's cache"),
    Mutant("training_mask_ignores_window", "dflash_compile/training/objective.py",
           (("draft.block_size, cfg.sliding_window if kind", "draft.block_size, None if kind"),),
           ("tests/test_training.py::test_training_blocks_match_inference_forward[sliding]",),
           "drafter training lets a sliding-attention layer see past its window (inference does not)"),
    Mutant("tp_drafter_partial_sums_not_reduced", "dflash_compile/models/draft_model.py",
           (("        return funcol.all_reduce(partial, \"sum\", self.tp_group)", "        return partial"),),
           ("tests/test_tensor_parallel.py::test_greedy_identity_eager_and_compiled[dense]",),
           "a drafter split over tensor-parallel ranks adds only its own heads' share of each layer's output"),
)


def _repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def _copy(dest: Path, files: list[str]) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)


def _apply(tree: Path, m: Mutant) -> None:
    path = tree / m.path
    text = path.read_text()
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            raise ValueError(f"{m.name}: pattern {old!r} matches {n} times in {m.path} (must be exactly once): "
                             f"update the mutation to the current source")
        text = text.replace(old, new)
    path.write_text(text)


def _pytest(tree: Path, tests: tuple[str, ...], first_failure: bool = False) -> tuple[int, str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
               TORCHINDUCTOR_CACHE_DIR=str(ROOT / "build" / "inductor-cache"))  # keyed by graph: safe to share
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                            *(["-x"] if first_failure else []), *tests],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {TIMEOUT_S} s"
    return r.returncode, r.stdout + r.stderr


def _check_imports_copy(tree: Path) -> None:
    r = subprocess.run([sys.executable, "-c", "import dflash_compile; print(dflash_compile.__file__)"], cwd=tree,
                       capture_output=True, text=True, check=True)
    if not Path(r.stdout.strip()).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"tests in {tree} would import dflash_compile from {r.stdout.strip()}, not the copy")


def _prepared(m: Mutant, files: list[str], apply: bool = True) -> Path:
    tree = WORK / m.name
    _copy(tree, files)
    if apply:
        _apply(tree, m)
    return tree


def _run_mutant(m: Mutant, files: list[str]) -> tuple[Mutant, str, str, float, str]:
    """``(m, killed?, "failed/run", seconds, why)`` for one mutation, in a copy of its own (removed after)."""
    t0 = time.monotonic()
    tree = _prepared(m, files)
    try:
        rc, out = _pytest(tree, m.tests, first_failure=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    failed_ids = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M))
    failed = [t for t in m.tests if any(f == t or f.startswith(t + "[") for f in failed_ids)]
    # pytest exit 1: tests ran and some failed. Anything else (0: all passed; 2-5: interrupted, internal or usage
    # error, nothing collected; -1: timeout) is not a kill.
    status = "yes" if rc == 1 else ("NO" if rc == 0 else f"ERROR (pytest exit {rc})")
    # Why: pytest's summary lines (a kill for the wrong reason, e.g. an import error, shows here), or the tail.
    why = re.findall(r"^(?:FAILED|ERROR) .*$", out, re.M)
    report = ("\n".join(f"    {line[:200]}" for line in why[:4]) if status == "yes" and why else
              "\n".join(out.splitlines()[-25:]))
    return m, status, f"{len(failed)}/{len(m.tests)} failed (stops at the first)", time.monotonic() - t0, report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", action="append", default=[], help="run the mutations whose name contains this word")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--baseline", action="store_true", help="first check that the selected tests pass unmutated")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n    {m.path}; tests: {' '.join(m.tests)}")
        return 0
    if not chosen:
        print(f"no mutation matches {args.k}")
        return 2
    files = _repo_files()
    # Every pattern must still match the current source exactly once before anything runs.
    stale = [(m, old) for m in chosen for old, _ in m.edits if (ROOT / m.path).read_text().count(old) != 1]
    for m, old in stale:
        print(f"mutation {m.name}: pattern {old!r} does not match exactly once in {m.path}; update the mutation")
    if stale:
        return 2
    start = time.monotonic()
    if args.baseline:
        tree = WORK / "baseline"
        _copy(tree, files)
        _check_imports_copy(tree)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, out = _pytest(tree, tests)
        shutil.rmtree(tree)
        if rc != 0:
            print(out[-3000:])
            print("baseline: the selected tests fail unmutated; fix the suite first")
            return 2
        print(f"baseline: {len(tests)} tests pass unmutated ({time.monotonic() - start:.0f} s)")
    _check_imports_copy(_prepared(chosen[0], files, apply=False))
    rows = []
    # the slow ones (their tests compile, or start ranks) first, so that they overlap with the quick ones
    slow_first = sorted(chosen, key=lambda m: not any(s in t for t in m.tests for s in SLOW_TESTS))
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        for m, status, frac, secs, report in pool.map(lambda m: _run_mutant(m, files), slow_first):
            rows.append((m, status, frac, secs))
            print(f"{m.name}: killed {status} ({frac}, {secs:.0f} s)\n{report}", flush=True)
    rows.sort(key=lambda r: chosen.index(r[0]))
    w = max(len(m.name) for m in chosen)
    print(f"\n{'mutation':<{w}}  killed  tests (failed/run)  seconds  tests run")
    for m, status, frac, secs in rows:
        names = ", ".join(t.removeprefix("tests/") for t in m.tests)
        print(f"{m.name:<{w}}  {status:<6}  {frac:<17}  {secs:7.0f}  {names}")
    survived = [m.name for m, status, _, _ in rows if status != "yes"]
    print(f"\n{len(rows) - len(survived)}/{len(rows)} mutations killed in {time.monotonic() - start:.0f} s")
    if survived:
        print(f"NOT killed: {', '.join(survived)}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
