"""Compile once: one step graph per key for every context length, saved graphs reused by later wrappers and
processes, damaged entries recompiled with one warning, ``precompile`` and ``on_miss``."""

import gc
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.runtime.compiled_steps import _MAGIC
from dflash_compile.runtime.step_keys import StepKey
from tiny_models import VOCAB, random_prompts, tiny_target

PAD = VOCAB - 2
WRAPPER = dict(speculation="fixed", max_batch_size=2, batch_buckets=(1, 2), max_seq_len=160, page_size=8)


class CountingBackend:
    """Records the batch size of each graph it is handed; runs it uncompiled (fast to 'compile')."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(next(t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2))
        return gm.forward


def _pair(seed=0, **kwargs):
    target = tiny_target("qwen3", seed=seed)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=seed)
    return target, DFlashSpecWrapper(target, draft, **{**WRAPPER, **kwargs})


def _reference(target, prompt, new):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def _new_tokens(spec, prompt, new):
    return spec.generate([prompt], max_new_tokens=new)[0, len(prompt):].tolist()


def test_one_graph_serves_every_context_length():
    target, spec = _pair()
    backend = CountingBackend()
    spec.compile(backend=backend)
    for prompt, new in zip(random_prompts([3, 40, 101], 0), (150, 60, 50)):  # up to the capacity
        assert _new_tokens(spec, prompt, new) == _reference(target, prompt, min(new, 160 - len(prompt)))
    assert backend.graphs == [1]
    assert spec.compiled_steps.compiled_keys() == [StepKey(1, None, False, None)]
    assert spec.context_bucket(20) == 3 and spec.context_bucket(1) == 2  # the live pages, at least 2


def test_static_context_backends_keep_their_buckets():
    _, spec = _pair(context_buckets=(32, 64))
    spec.compile(backend="dflash_neuron", on_miss="eager")
    assert spec.compiled_steps.keys.key(1, 4, False, spec.verify_len) == StepKey(1, spec.verify_len, False, 4)
    plain = spec.compiled_steps.keys.key(1, 4, False, 1, propose=False)  # K = 0 without a proposal: its own graph and file
    assert plain == StepKey(1, 1, False, 4, False) and plain.filename != StepKey(1, 1, False, 4).filename
    assert [spec.context_bucket(n) for n in (1, 40, 100)] == [4, 8, 20]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A cache with the batch-1 greedy step of the tiny pair compiled by ``dflash``, and that run's tokens."""
    cache = tmp_path_factory.mktemp("dflash-cache")
    target, spec = _pair()
    spec.compile(backend="dflash", cache_dir=cache)
    prompt = random_prompts([9], 1)[0]
    tokens = _new_tokens(spec, prompt, 24)
    assert tokens == _reference(target, prompt, 24)
    assert [how for _, how, _ in spec.compiled_steps.events] == ["compiled"]
    return cache, spec.compiled_steps.folder(), prompt


def test_saved_graph_is_loaded_not_compiled_and_reads_the_live_weights(saved, tmp_path):
    cache, folder, prompt = saved
    shutil.copytree(cache, tmp_path / "c")
    target, spec = _pair(seed=1)  # same shapes, other weights: the graph reads the parameters at every call
    spec.compile(backend="dflash", cache_dir=tmp_path / "c")
    assert _new_tokens(spec, prompt, 24) == _reference(target, prompt, 24)
    assert [how for _, how, _ in spec.compiled_steps.events] == ["loaded"]
    fp = json.loads((tmp_path / "c" / folder.name / "fingerprint.json").read_text())
    assert fp["backend"] == "dflash" and fp["torch"] == torch.__version__


def test_another_process_loads_the_saved_graph(saved, tmp_path):
    cache, folder, prompt = saved
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from torch._inductor.cpu_vec_isa import VecISA
        from test_compile_cache import _pair, _new_tokens, _reference
        probes = []
        check_build = VecISA.check_build
        VecISA.check_build = lambda self, code: probes.append(str(self)) or check_build(self, code)
        target, spec = _pair()
        spec.compile(backend="dflash", cache_dir={str(cache)!r})
        same = _new_tokens(spec, {prompt!r}, 24) == _reference(target, {prompt!r}, 24)
        print(json.dumps([same, [how for _, how, _ in spec.compiled_steps.events], probes]))
    """)
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    # from another working directory: torch's settings hold paths that follow it, and the folder must not
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    same, hows, probes = json.loads(out.stdout.strip().splitlines()[-1])
    assert same and hows == ["loaded"]
    # the folder records the ISA its kernels were built for, and a load skips Inductor's probe of it (a CPU where
    # Inductor found none records "" and probes as before)
    assert json.loads((folder / "vec_isa.json").read_text()) == {"isa": str(isa) if isa else ""}
    if isa:
        assert probes == []


@pytest.mark.own_inductor_cache
def test_compile_caches_share_inductors_cache_when_told(tmp_path, monkeypatch):
    """By default a compile cache holds Inductor's cache (``inductor/``); with ``$DFLASH_INDUCTOR_CACHE_DIR`` another
    compile cache compiling the same graph traces it and runs the DFlash passes again, and takes the compiled code
    from AOTAutograd's cache there: no code generation, no C++ build, the same tokens."""
    from torch._dynamo.utils import counters

    prompt = random_prompts([9], 1)[0]
    runs = []
    for name in ("own", "shared"):
        if name == "shared":  # point the second compile cache at the first one's Inductor cache
            monkeypatch.setenv("DFLASH_INDUCTOR_CACHE_DIR", str(tmp_path / "own" / "inductor"))
        counters.clear()
        target, spec = _pair()
        spec.compile(backend="dflash", cache_dir=tmp_path / name)
        assert _new_tokens(spec, prompt, 16) == _reference(target, prompt, 16)
        assert [how for _, how, _ in spec.compiled_steps.events] == ["compiled"]
        runs.append((dict(counters["aot_autograd"]), sum(counters["dflash"].values())))
    (own, own_passes), (shared, shared_passes) = runs
    assert own.get("autograd_cache_miss", 0) >= 1 and own.get("autograd_cache_hit", 0) == 0
    assert shared.get("autograd_cache_hit", 0) == own["autograd_cache_miss"]
    assert shared.get("autograd_cache_miss", 0) == 0
    assert shared_passes == own_passes > 0  # traced and rewritten again
    assert (tmp_path / "own" / "inductor").is_dir() and not (tmp_path / "shared" / "inductor").exists()


def test_a_parameter_changed_before_the_first_call_is_caught_without_its_guard(saved, tmp_path, caplog):
    """Saved steps keep no tensor guards on parameters (``step_guards``: building them was most of a graph's load);
    the fingerprint holds every parameter's shape, dtype, strides and device, and a key's first call checks them:
    a weight replaced by a strided one after the graphs were loaded sends the step to the folder of the new
    parameters (here none: ``on_miss="eager"``), with one warning, and the tokens stay the target's."""
    cache, _, prompt = saved
    shutil.copytree(cache, tmp_path / "c")
    target, spec = _pair()
    spec.compile(backend="dflash", cache_dir=tmp_path / "c", on_miss="eager")
    spec.precompile(batch_sizes=[1], progress=False)
    assert [how for _, how, _ in spec.compiled_steps.events] == ["loaded"]
    weight = target.lm_head.weight
    with torch.no_grad():
        target.lm_head.weight = torch.nn.Parameter(weight.t().contiguous().t())  # same values, other strides
    assert target.lm_head.weight.stride() != weight.stride()
    with caplog.at_level(logging.WARNING, logger="dflash_compile"):
        assert _new_tokens(spec, prompt, 24) == _reference(target, prompt, 24)
    assert sum("parameters changed" in r.getMessage() for r in caplog.records) == 1
    hows = [how for _, how, _ in spec.compiled_steps.events]
    assert hows[0] == "loaded" and set(hows[1:]) == {"eager"}


def test_saved_steps_keep_no_tensor_guards_on_parameters():
    from torch._dynamo.types import GuardFilterEntry

    from dflash_compile.runtime.compiled_steps import step_guards

    def entry(kind, value, is_global=False):
        return GuardFilterEntry(name="x", has_value=True, value=value, guard_type=kind, derived_guard_types=(),
                                is_global=is_global, orig_guard=None)

    param, plain = torch.nn.Parameter(torch.ones(2)), torch.ones(2)
    entries = [entry("TENSOR_MATCH", param), entry("TENSOR_MATCH", plain), entry("GLOBAL_STATE", None),
               entry("SHAPE_ENV", None), entry("ID_MATCH", plain), entry("TENSOR_MATCH", plain, is_global=True)]
    assert step_guards(entries) == [False, True, True, True, False, False]
    assert step_guards(entries, parameters=True) == [True, True, True, True, False, False]


def _damage(path: Path, how: str, other: Path | None = None) -> None:
    blob = path.read_bytes()
    if how == "corrupted":
        i = len(blob) // 2
        path.write_bytes(blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1:])
    elif how == "truncated":
        path.write_bytes(blob[: len(blob) // 3])
    elif how == "not an entry":
        path.write_bytes(b"\x00" * 100)
    elif how == "another key":  # a valid entry, checksum and all, that says it is for batch 2
        at = len(_MAGIC)
        n = int.from_bytes(blob[at: at + 4], "little")
        header = json.loads(blob[at + 4: at + 4 + n])
        header["key"]["batch"] = 2
        new = json.dumps(header, sort_keys=True).encode()
        path.write_bytes(_MAGIC + len(new).to_bytes(4, "little") + new + blob[at + 4 + n:])
    elif how == "guards reject it":  # a sound entry of another wrapper (other pool shapes), relabelled as this one
        at = len(_MAGIC)
        n = int.from_bytes(blob[at: at + 4], "little")
        theirs = other.read_bytes()
        m = int.from_bytes(theirs[at: at + 4], "little")
        payload = theirs[at + 36 + m:]
        path.write_bytes(blob[: at + 4 + n] + hashlib.sha256(payload).digest() + payload)


@pytest.mark.parametrize("how", ["corrupted", "truncated", "not an entry", "another key", "guards reject it"])
def test_a_damaged_entry_is_recompiled_with_one_warning(saved, tmp_path, caplog, how):
    cache, folder, prompt = saved
    shutil.copytree(cache, tmp_path / "c")
    entry = tmp_path / "c" / folder.name / StepKey(1, None, False, None).filename
    other = None
    if how == "guards reject it":
        _, bigger = _pair(max_seq_len=200)
        bigger.compile(backend="dflash", cache_dir=tmp_path / "other")
        bigger.generate([prompt], max_new_tokens=4)
        other = bigger.compiled_steps.folder() / entry.name
    _damage(entry, how, other)
    target, spec = _pair()
    spec.compile(backend="dflash", cache_dir=tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="dflash_compile"):
        assert _new_tokens(spec, prompt, 24) == _reference(target, prompt, 24)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "ignoring the compile cache entry" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    assert [how for _, how, _ in spec.compiled_steps.events][-1] == "compiled"
    _, again = _pair()  # the entry was rewritten: the next wrapper loads it
    again.compile(backend="dflash", cache_dir=tmp_path / "c")
    again.generate([prompt], max_new_tokens=4)
    assert [how for _, how, _ in again.compiled_steps.events] == ["loaded"]


def test_precompile_compiles_every_key_up_front_with_progress(capsys):
    target, spec = _pair()
    backend = CountingBackend()
    spec.compile(backend=backend, on_miss="error")
    with pytest.raises(RuntimeError, match="no compiled step for batch 1"):
        spec.generate([[1, 2, 3]], max_new_tokens=4)
    report = spec.precompile(sampling="both")
    assert sorted(backend.graphs) == [1, 1, 2, 2]
    assert set(report) == {str(StepKey(b, None, s, None)) for b in (1, 2) for s in (False, True)}
    assert all(how == "compiled" and seconds >= 0 for how, seconds in report.values())
    err = capsys.readouterr().err
    assert "dflash precompile" in err and "4/4" in err
    prompts = random_prompts([5, 30], 3)
    out = spec.generate(prompts, max_new_tokens=20, pad_token_id=PAD)  # every key ready: no miss, no error
    for row, p in zip(out, prompts):
        new = row[-20:].tolist()
        assert new == _reference(target, p, 20)
    spec.generate(prompts[:1], max_new_tokens=8, do_sample=True, temperature=0.8, seed=1)
    assert len(backend.graphs) == 4
    with pytest.raises(ValueError, match="batch_sizes"):
        spec.precompile(batch_sizes=[3])


def test_callers_readying_the_same_graphs_at_once_compile_each_once():
    # clients submitting together each ready their batch's graphs (graphs_ready), and a precompile may ask for the
    # same key meanwhile: one of them makes each graph, the others wait for it and find it ready
    _, spec = _pair()
    backend = CountingBackend()
    spec.compile(backend=backend)
    steps = spec.compiled_steps
    key = steps.keys.keys_for([2], False)[0]
    calls = [lambda: steps.ready(2, "both") for _ in range(4)] + [lambda: steps.prepare(key, *steps.keys.example(key))]
    threads = [threading.Thread(target=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(backend.graphs) == [1, 1, 2, 2]
    assert sorted(how for _, how, _ in steps.events) == ["compiled"] * 4


def test_the_fingerprint_covers_every_source_of_the_package():
    # the passes, the lowerings and their C++ kernel change what a saved graph computes, as much as the runtime does
    from dflash_compile.runtime import compiled_steps

    root = Path(compiled_steps.__file__).parents[1]
    names = {p.relative_to(root).as_posix() for p in compiled_steps.package_sources()}
    assert {"passes/fused_kv.py", "lowerings/cpu/row_linear.cpp", "lowerings/cpu/block_attention.py",
            "step/step.py", "runtime/compiled_steps.py", "backends.py"} <= names


def test_python_collects_less_often_while_a_step_compiles_and_as_before_after():
    from dflash_compile.runtime import compiled_steps

    seen = []

    def backend(gm, example_inputs):
        seen.append(gc.get_threshold())
        return gm.forward

    before = gc.get_threshold()
    target, spec = _pair()
    spec.compile(backend=backend)
    prompt = random_prompts([8], seed=3)[0]
    assert _new_tokens(spec, prompt, 6) == _reference(target, prompt, 6)
    raised = (max(before[0], compiled_steps.COMPILE_GC_THRESHOLD), *before[1:])
    assert seen and all(t == raised for t in seen)
    assert gc.get_threshold() == before
    with compiled_steps.fewer_collections():  # nested (a background compile beside another): the last one restores
        with compiled_steps.fewer_collections():
            assert gc.get_threshold() == raised
        assert gc.get_threshold() == raised
    assert gc.get_threshold() == before


def test_precompile_needs_compile():
    _, spec = _pair()
    with pytest.raises(RuntimeError, match="call spec.compile"):
        spec.precompile()


def test_on_miss_eager_runs_the_eager_step_for_keys_not_compiled():
    target, spec = _pair()
    backend = CountingBackend()
    spec.compile(backend=backend, on_miss="eager")
    prompt = random_prompts([12], 4)[0]
    assert _new_tokens(spec, prompt, 30) == _reference(target, prompt, 30)
    assert backend.graphs == [] and {how for _, how, _ in spec.compiled_steps.events} == {"eager"}


def test_compile_arguments_are_checked():
    _, spec = _pair()
    with pytest.raises(ValueError, match="on_miss"):
        spec.compile(on_miss="later")
    with pytest.raises(ValueError, match="fullgraph"):
        spec.compile(fullgraph=False)
    with pytest.raises(ValueError, match="dynamic"):
        spec.compile(dynamic=True)
    with pytest.raises(Exception, match="no_such_backend"):
        spec.compile(backend="no_such_backend")


class GatedBackend(CountingBackend):
    """A CountingBackend whose compile waits until ``release()``: the test decides when the graph is ready, not the
    race between a background thread and the first step."""

    def __init__(self):
        super().__init__()
        self.started = threading.Event()
        self._gate = threading.Event()

    def release(self):
        self._gate.set()

    def __call__(self, gm, example_inputs):
        self.started.set()
        assert self._gate.wait(timeout=600), "the test never released the compile"
        return super().__call__(gm, example_inputs)


def test_on_miss_background_compiles_while_the_eager_step_serves():
    target, spec = _pair()
    backend = GatedBackend()
    spec.compile(backend=backend, on_miss="background")
    prompt = random_prompts([12], 5)[0]
    try:
        # generate readies the graph on a background thread, which blocks in the backend: every step runs eagerly
        assert _new_tokens(spec, prompt, 40) == _reference(target, prompt, 40)
        assert backend.started.wait(timeout=600) and backend.graphs == []
        hows = {how for _, how, _ in spec.compiled_steps.events}
        assert hows == {"eager"}, hows
    finally:
        backend.release()
    report = spec.precompile(batch_sizes=[1])  # waits for the background compile
    assert list(report.values()) == [("ready", 0.0)] and backend.graphs == [1]
    n = len(spec.compiled_steps.events)
    assert _new_tokens(spec, prompt, 40) == _reference(target, prompt, 40)
    assert len(spec.compiled_steps.events) == n  # every step compiled: no eager step, no compile


def test_close_waits_for_a_background_compile():
    _, spec = _pair()
    spec.compile(backend=CountingBackend(), on_miss="background")
    spec.generate([[1, 2, 3]], max_new_tokens=4)
    thread = spec.compiled_steps._background.get(StepKey(1, None, False, None))
    spec.close()  # the trace reads the hooks close() removes: it must be over first
    assert thread is None or not thread.is_alive()


def test_the_fingerprint_does_not_depend_on_where_the_model_was_loaded_from(tmp_path):
    from dflash_compile.runtime.compiled_steps import fingerprint

    target, spec = _pair()
    first = fingerprint(spec, "dflash", None, {})
    target.config._name_or_path = str(tmp_path / "elsewhere")
    assert fingerprint(spec, "dflash", None, {}) == first
    threads = torch.get_num_threads()
    try:  # so is the intra-op thread count on CPU (a graph is guarded on it)
        torch.set_num_threads(threads + 1)
        assert fingerprint(spec, "dflash", None, {}) != first
    finally:
        torch.set_num_threads(threads)
    target.config.rms_norm_eps = 1e-3  # a config value is part of it
    assert fingerprint(spec, "dflash", None, {}) != first


def test_the_fingerprint_follows_the_compilers_settings():
    """A graph made under other Inductor or dynamo settings (set in code or by TORCHINDUCTOR_* variables) is not
    loaded in their place; the settings the step's compile sets itself do not count."""
    from dflash_compile.runtime.compiled_steps import compiler_settings, fingerprint

    _, spec = _pair()

    def fingerprint_of(spec):
        return fingerprint(spec, "dflash", None, {})

    first = fingerprint_of(spec)
    with torch._inductor.config.patch(size_asserts=not torch._inductor.config.size_asserts):
        assert fingerprint_of(spec) != first
    with torch._dynamo.config.patch(capture_scalar_outputs=not torch._dynamo.config.capture_scalar_outputs):
        assert fingerprint_of(spec) != first
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=1000):
        assert fingerprint_of(spec) == first
    assert fingerprint_of(spec) == first and len(compiler_settings()) == 16


def test_a_wrapper_changes_folder_with_the_thread_count(tmp_path):
    """A graph compiled after ``torch.set_num_threads(n)`` is saved under the folder of ``n`` threads, not under the
    count the wrapper was compiled at: else a later process at the first count would load a graph its guards reject
    (and compile it again, and save it back)."""
    _, spec = _pair()
    spec.compile(backend="dflash", cache_dir=tmp_path)
    steps = spec.compiled_steps
    threads = torch.get_num_threads()
    first = steps.folder()
    try:
        torch.set_num_threads(threads + 1)
        other = steps.folder()
    finally:
        torch.set_num_threads(threads)
    assert other != first and other.parent == first.parent
    assert steps.folder() == first


def test_a_passed_paged_forward_check_is_recorded_in_the_folder_and_not_run_again(monkeypatch, tmp_path):
    """The target's paged-forward check (~1.2 s for SmolLM2-135M) runs once per compile-cache folder: a later wrapper
    (a restarted process) with the same folder skips it; another folder, or a wrapper with no cache, runs it."""
    from dflash_compile.runtime import cache_manager

    runs = []
    real = cache_manager.check_paged_forward
    monkeypatch.setattr(cache_manager, "check_paged_forward", lambda *a: (runs.append(1), real(*a)))

    def pools(cache_dir, **compile_kwargs):
        target, spec = _pair()
        if cache_dir is not None:
            spec.compile(backend="dflash", cache_dir=cache_dir, on_miss="eager", **compile_kwargs)
        spec.kv_cache()
        return spec

    first = pools(tmp_path)
    record = first.compiled_steps.check_record()
    assert len(runs) == 1 and record.parent == first.compiled_steps.folder()
    assert json.loads(record.read_text())["dtype"] == "torch.float32"
    pools(tmp_path)
    assert len(runs) == 1  # the same folder: recorded, not run again
    pools(tmp_path / "other")
    pools(None)
    assert len(runs) == 3
    record.unlink()
    pools(tmp_path)
    assert len(runs) == 4 and record.exists()


def test_a_failed_paged_forward_check_is_not_recorded(monkeypatch, tmp_path):
    from dflash_compile.runtime import cache_manager

    def fails(*a):
        raise ValueError("the target fails over the paged cache (a test)")

    monkeypatch.setattr(cache_manager, "check_paged_forward", fails)
    _, spec = _pair()
    spec.compile(backend="dflash", cache_dir=tmp_path, on_miss="eager")
    with pytest.raises(ValueError, match="a test"):
        spec.kv_cache()
    assert not spec.compiled_steps.check_record().exists()


def test_a_step_dynamo_cannot_package_compiles_in_process(monkeypatch, caplog, tmp_path):
    # When the ahead-of-time capture cannot package a step (an unpicklable object in its guard state), the key is
    # compiled the ordinary way and kept in memory, said once; tokens stay exact and nothing is saved.
    import torch._dynamo.aot_compile

    def refuse(*args, **kwargs):
        raise torch._dynamo.exc.PackageError("an object in the guard state does not pickle")

    monkeypatch.setattr(torch._dynamo.aot_compile, "aot_compile_fullgraph", refuse)
    target, spec = _pair()
    spec.compile(backend="dflash", cache_dir=tmp_path)
    prompts = random_prompts([7, 40], 6)
    with caplog.at_level(logging.WARNING, logger="dflash_compile"):
        for p in prompts:
            assert _new_tokens(spec, p, 30) == _reference(target, p, 30)
    said = [r.getMessage() for r in caplog.records if "cannot be saved" in r.getMessage()]
    assert len(said) == 1 and "PackageError" in said[0]
    assert [how for _, how, _ in spec.compiled_steps.events] == ["compiled"]
    assert not list(tmp_path.rglob("*.pt2"))


def test_a_request_joining_others_of_its_mode_readies_that_mode_alone():
    """Greedy requests that join a running greedy batch ready no sampled graph (the batch never runs one); a sampled
    request joining it readies the sampled graphs (the greedy ones stay for when it leaves)."""
    import threading

    from dflash_compile.runtime.scheduler import graphs_ready

    target, spec = _pair(speculation="fixed", max_batch_size=4, batch_buckets=(2, 4))
    spec.compile(backend=CountingBackend())
    running, release = threading.Event(), threading.Event()

    class Holding:  # holds the driver inside the first request's stream: that request stays in flight
        def put(self, value):
            if threading.current_thread().name == "dflash-scheduler":  # not the prompt, put by submit's caller
                running.set()
                assert release.wait(60)

        def end(self):
            pass

    first = spec.submit(random_prompts([5], 3)[0], max_new_tokens=8, streamer=Holding(), pad_token_id=0)
    assert running.wait(120)
    sampled = lambda: sorted({key.sampled for key in spec.compiled_steps.compiled_keys()})  # noqa: E731
    try:
        assert sampled() == [False]
        with graphs_ready(spec.scheduler, 1, False):  # a greedy request joining the greedy one
            pass
        assert sampled() == [False]
        with graphs_ready(spec.scheduler, 1, True):  # a sampled one
            pass
        assert sampled() == [False, True]
    finally:
        release.set()
    assert len(first.result().tokens) == 8


def test_no_step_compiles_inside_a_long_mixed_run():
    """``generate`` readies every graph its batch may step through before the batch steps (``CompiledSteps.ready``):
    the batch shrinking from 4 rows to 2 as calls finish, K moving under ``speculation="auto"``, sampled and
    greedy rows sharing the batch. Not one compile (or load) happens on the scheduler's thread."""
    import threading

    target, spec = _pair(speculation="auto", max_batch_size=4, batch_buckets=(2, 4))
    backend = CountingBackend()
    spec.compile(backend=backend)
    events = []
    spec.compiled_steps.listeners.append(lambda key, how, s: events.append((threading.current_thread().name, how)))
    greedy, sampled, late = random_prompts([5, 12], 3), random_prompts([7, 4], 4), random_prompts([9], 5)
    out = {}
    calls = [threading.Thread(target=lambda: out.__setitem__("greedy", spec.generate(
                 greedy, max_new_tokens=60, pad_token_id=0))),
             threading.Thread(target=lambda: out.__setitem__("sampled", spec.generate(
                 sampled, max_new_tokens=12, do_sample=True, temperature=0.8, seed=1, pad_token_id=0)))]
    for t in calls:
        t.start()
    out["late"] = spec.generate(late, max_new_tokens=30)  # joins while the others run, or alone after them
    for t in calls:
        t.join()
    assert len(out["sampled"]) == len(sampled)  # the sampled call finished (a thread's error leaves no result)
    assert events and {how for _, how in events} == {"compiled"}
    assert [name for name, _ in events if name == "dflash-scheduler"] == []
    for prompts, name, new in ((greedy, "greedy", 60), (late, "late", 30)):
        width = max(map(len, prompts))  # the output is left-padded to the longest prompt
        for prompt, row in zip(prompts, out[name]):
            assert row[width:].tolist() == _reference(target, prompt, new)
    # at most (K >= 1, K 0, K 0 without a proposal) per bucket and sampling mode
    assert len(spec.compiled_steps.compiled_keys()) <= 2 * 2 * 3
