"""Graphs compiled at once in forked processes (``runtime/compile_workers.py``): which process compiled each graph,
the same tokens as eager, counters and phase timers as if compiled here, a failing child's key compiled here."""

import logging
import os

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics, counters

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.runtime import compile_workers
from dflash_compile.runtime.compiled_steps import CompiledSteps
from tiny_models import VOCAB, random_prompts, tiny_target

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or os.uname().sysname != "Linux",
                                reason="compile workers are forked processes: Linux only")

PAD = VOCAB - 2


def _pair():
    target = tiny_target("llama", seed=0)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[1, 3], seed=0)
    return target, DFlashSpecWrapper(target, draft, max_batch_size=1, max_seq_len=96, page_size=8)


@pytest.fixture
def compiling_pids(monkeypatch, tmp_path):
    """The pid of the process each graph is compiled in, appended to a file (a forked child's list would stay in
    the child)."""
    log = tmp_path / "pids"
    real = CompiledSteps._compile

    def compile_and_note(self, key, args, kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {key.filename}\n")
        return real(self, key, args, kwargs)

    monkeypatch.setattr(CompiledSteps, "_compile", compile_and_note)
    return lambda: [(int(p), name) for p, name in (line.split() for line in log.read_text().splitlines())] \
        if log.exists() else []


def _generate(spec, prompts):
    return [spec.generate(torch.tensor([p]), max_new_tokens=12, pad_token_id=PAD)[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.own_inductor_cache  # each child runs Inductor (the run's shared cache may hold these graphs)
def test_two_graphs_compile_in_two_child_processes_and_run_here(compiling_pids, tmp_path):
    target, spec = _pair()
    prompts = random_prompts([9, 17], seed=3)
    eager = _generate(spec, prompts)
    spec.compile(backend="dflash", cache_dir=tmp_path / "cache", workers=2)
    counters.clear()
    compilation_time_metrics.clear()
    report = spec.precompile([1], progress=False)
    compiled = compiling_pids()
    assert len(report) == 2 and {how for how, _ in report.values()} == {"compiled"}, report
    pids = {p for p, _ in compiled}
    assert len(compiled) == 2 and len(pids) == 2 and os.getpid() not in pids, compiled  # one child per graph
    # what the children's compiles counted is counted here: the passes fired in both graphs
    assert counters["dflash"]["paged_kv_write"] >= 2 and counters["dflash"]["block_attention"] >= 2, counters["dflash"]
    assert len(compilation_time_metrics["compile_fx_inner"]) >= 2
    assert {how for _, how, _ in spec.compiled_steps.events} == {"compiled"}
    assert _generate(spec, prompts) == eager  # the graphs the children saved, loaded and run here
    assert {how for _, how, _ in spec.compiled_steps.events} == {"compiled"}  # nothing compiled while generating
    assert len(compiling_pids()) == 2


def test_one_worker_compiles_here(compiling_pids, tmp_path):
    _, spec = _pair()
    spec.compile(backend="eager", cache_dir=tmp_path / "cache", workers=1)  # dynamo alone: quick, and saved
    spec.precompile([1], progress=False)
    assert [p for p, _ in compiling_pids()] == [os.getpid()] * 2


def test_a_failed_child_leaves_its_graph_to_this_process(monkeypatch, tmp_path, caplog):
    target, spec = _pair()
    prompts = random_prompts([13], seed=4)
    eager = _generate(spec, prompts)
    here = os.getpid()
    real = CompiledSteps._compile

    def fail_in_plain_decodings_child(self, key, args, kwargs):
        if os.getpid() != here and not key.propose:
            raise RuntimeError("injected failure")
        return real(self, key, args, kwargs)

    monkeypatch.setattr(CompiledSteps, "_compile", fail_in_plain_decodings_child)
    spec.compile(backend="eager", cache_dir=tmp_path / "cache", workers=2)
    with caplog.at_level(logging.WARNING):
        report = spec.precompile([1], progress=False)
    said = [r.getMessage() for r in caplog.records if "in a worker process failed" in r.getMessage()]
    assert len(said) == 1 and "injected failure" in said[0] and "no proposal" in said[0], said
    assert {how for how, _ in report.values()} == {"compiled"}
    assert _generate(spec, prompts) == eager


def test_a_child_that_dies_is_said_and_its_graph_compiled_here(monkeypatch, tmp_path, caplog):
    _, spec = _pair()
    here = os.getpid()
    real = CompiledSteps._compile

    def die_in_the_proposing_child(self, key, args, kwargs):
        if os.getpid() != here and key.propose:
            os._exit(3)  # no reply, as a crash would leave it
        return real(self, key, args, kwargs)

    monkeypatch.setattr(CompiledSteps, "_compile", die_in_the_proposing_child)
    spec.compile(backend="eager", cache_dir=tmp_path / "cache", workers=2)
    with caplog.at_level(logging.WARNING):
        report = spec.precompile([1], progress=False)
    said = [r.getMessage() for r in caplog.records if "in a worker process failed" in r.getMessage()]
    assert len(said) == 1 and "exit code 3" in said[0], said
    assert len(report) == 2 and {how for how, _ in report.values()} == {"compiled"}


def test_when_graphs_compile_in_workers():
    _, spec = _pair()
    spec.compile(backend="dflash", workers=2)
    steps = spec.compiled_steps
    keys = steps.keys.keys_for([1], False)
    assert compile_workers.parallel_workers(steps, keys) == 2
    assert compile_workers.parallel_workers(steps, keys[:1]) == 1  # one graph: no process to start
    steps.workers = 1
    assert compile_workers.parallel_workers(steps, keys) == 1
    spec.compile(backend=lambda gm, inputs: gm.forward, workers=2)  # no compile cache for the children to save into
    assert compile_workers.parallel_workers(spec.compiled_steps, keys) == 1


def test_workers_are_checked(monkeypatch):
    _, spec = _pair()
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="workers must be a positive number"):
            spec.compile(backend="dflash", workers=bad)
    monkeypatch.setenv(compile_workers.WORKERS_ENV, "3")
    assert compile_workers.default_workers() == 3
    monkeypatch.setenv(compile_workers.WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="DFLASH_COMPILE_WORKERS must be a positive number"):
        compile_workers.default_workers()
    monkeypatch.delenv(compile_workers.WORKERS_ENV)
    assert compile_workers.default_workers() == len(os.sched_getaffinity(0))
