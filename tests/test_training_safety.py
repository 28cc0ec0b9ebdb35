"""The training CLI and data builder: --out never the target, --init, run records, fingerprints, the global RNG."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from dflash_compile import DFlashDraftModel
from dflash_compile.training import DataConfig, generate_continuations
from dflash_compile.training.data import cache_key, fingerprint_dir
from tiny_models import VOCAB, tiny_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 17, 42, 8]



@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def _draft(target, **kw):
    return DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0, **kw)


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def _greedy(target, prompt, n):
    return target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------------------- train_drafter --out
def _train_cli():
    path = os.path.join(ROOT, "examples", "train_drafter.py")
    spec = importlib.util.spec_from_file_location("train_drafter_cli", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("where", ["same", "inside", "symlink", "dotted"])
def test_train_drafter_out_may_not_be_the_target(tmp_path, capsys, where):
    tdir = tmp_path / "target"
    tdir.mkdir()
    (tdir / "config.json").write_text("{}")
    out = {"same": tdir, "inside": tdir / "drafter", "symlink": tmp_path / "link",
           "dotted": tmp_path / "x" / ".." / "target"}[where]
    if where == "symlink":
        out.symlink_to(tdir)
    with pytest.raises(SystemExit):
        _train_cli().main(["--target", str(tdir), "--out", str(out), "--steps", "1"])
    assert "--out" in capsys.readouterr().err
    assert sorted(p.name for p in tdir.iterdir()) == ["config.json"] and (tdir / "config.json").read_text() == "{}"


# ---------------------------------------------------------------------------------------------- training data
def test_data_builder_leaves_the_global_rng_alone(target):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    prompts = torch.randint(0, VOCAB - 1, (2, 4), generator=torch.Generator().manual_seed(0))
    cfg = DataConfig(num_prompts=2, prompt_len=4, gen_len=6, do_sample=True, gen_batch=2, seed=7)
    a = generate_continuations(target, prompts, cfg, progress=False)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(999)  # the global state does not change the data either: its seed is cfg.seed
    assert torch.equal(generate_continuations(target, prompts, cfg, progress=False).tokens, a.tokens)


def test_fingerprints_see_every_byte(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    data = bytearray(os.urandom(3 << 20))
    weights.write_bytes(bytes(data))
    before = fingerprint_dir(tmp_path)
    data[len(data) // 2] ^= 1  # the middle MiB, same size
    weights.write_bytes(bytes(data))
    assert fingerprint_dir(tmp_path) != before

    corpus = tmp_path / "corpus.py"
    corpus.write_text("x = 1\n")
    key = cache_key("t", [corpus], DataConfig())
    corpus.write_text("x = 2\n")  # same size, new content
    assert cache_key("t", [corpus], DataConfig()) != key


def test_train_drafter_init_copies_weights_into_a_sliding_drafter_and_refuses_another_shape(tmp_path, capsys):
    cli = _train_cli()
    target = tiny_target("qwen3", seed=0)
    source = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 1], seed=1)
    sliding = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 1], seed=2,
                                           layer_types=["sliding_attention"] * 2, sliding_window=16)
    cli.init_from(sliding, source, "src")
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in sliding.state_dict().items())
    for other, what in [(dict(num_layers=2, block_size=8, target_layer_ids=[0, 1]), "block size"),
                        (dict(num_layers=2, block_size=4, target_layer_ids=[1, 0]), "target_layer_ids"),
                        (dict(num_layers=3, block_size=4, target_layer_ids=[0, 1]), "do not fit")]:
        with pytest.raises(SystemExit, match=what):
            cli.init_from(DFlashDraftModel.from_target(target, seed=3, **other), source, "src")
    tdir = tmp_path / "target"
    tdir.mkdir()
    for argv, msg in [(["--init", "x", "--resume"], "--init starts a new run"),
                      (["--sliding-window", "0"], "--sliding-window must be >= 1")]:
        with pytest.raises(SystemExit):
            cli.main(["--target", str(tdir), "--out", str(tmp_path / "out"), *argv])
        assert msg in capsys.readouterr().err


def test_train_drafter_keeps_the_earlier_runs_records(tmp_path):
    import argparse

    earlier_runs = _train_cli().earlier_runs
    first, second = {"step": 10}, {"step": 20}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "training_info.json").write_text(json.dumps(first))  # a single record, as older runs wrote
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "training_info.json").write_text(json.dumps([first, second]))

    def runs(**kw):
        return earlier_runs(argparse.Namespace(**{"init": None, "resume": False, "out": tmp_path / "b", **kw}))

    assert runs() == []  # a new run starts its own list
    assert runs(resume=True) == [first, second]  # --resume keeps --out's records
    assert runs(init=tmp_path / "a") == [first]  # --init carries the source drafter's records
    assert runs(resume=True, out=tmp_path / "missing") == []


@pytest.mark.parametrize("flags, warns", [({"avx2", "fma"}, True), ({"avx2", "avx512_bf16"}, False),
                                          ({"amx_bf16"}, False)])
def test_bf16_autocast_on_a_cpu_without_bf16_instructions_warns(monkeypatch, flags, warns):
    """On an AVX2-only core torch's bf16 products take generic loops (a SmolLM2 drafter: ~70 s a step against ~5 s
    in fp32): training says so instead of running 14x slower without a word."""
    import warnings

    from dflash_compile.lowerings.cpu import host
    from dflash_compile.training import TrainConfig
    from dflash_compile.training.trainer import _check_autocast

    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset(flags))
    for autocast, device, expect in [("bfloat16", "cpu", warns), (None, "cpu", False), ("float16", "cpu", False),
                                     ("bfloat16", "meta", False)]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _check_autocast(TrainConfig(steps=1, autocast=autocast), torch.device(device))
        assert [("without bf16 instructions" in str(w.message)) for w in seen] == ([True] if expect else []), \
            (flags, autocast, device)
