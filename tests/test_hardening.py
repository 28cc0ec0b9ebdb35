"""Hostile checkpoints and inputs: what must be refused with a clear error, and resources owned by their lifetime."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_compile import DFlashConfig, DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.training import DataConfig, DraftDataset, TrainConfig, generate_continuations, train_drafter
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


# ---------------------------------------------------------------------------------------------- trainer resume
class _RunsCode:
    """Unpickling this creates a directory: stands for any code a planted checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_resume_refuses_a_checkpoint_that_would_run_code(target, tmp_path):
    marker = tmp_path / "pwned"
    ckpts = tmp_path / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    torch.save({"step": 1, "draft": _RunsCode(marker)}, ckpts / "step_0000001.pt")
    data = DraftDataset(torch.randint(0, VOCAB - 1, (4, 16)), torch.full((4,), 16), 4)
    cfg = TrainConfig(steps=2, batch_size=2, blocks_per_seq=2, warmup_steps=1)
    with pytest.raises(ValueError, match=r"refusing to load .*step_0000001\.pt.*posix\.mkdir"):
        train_drafter(target, _draft(target), data, cfg, tmp_path / "out", resume=True, progress=False)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------- block_size bounds
@pytest.mark.parametrize("block_size", [1.5, 2.5, 16.0, 1e6, "8", True, None])
def test_block_size_from_a_config_must_be_an_integer(block_size):
    raw = {"block_size": block_size, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]},
           "num_target_layers": 4, "num_hidden_layers": 1}
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig.from_dict(raw)


def test_block_size_beyond_capacity_is_refused_before_any_allocation(target, tmp_path):
    _draft(target).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["block_size"] = cfg["dflash_config"]["block_size"] = 10**6
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    draft = DFlashDraftModel.from_pretrained(tmp_path)  # loading allocates nothing that depends on the block
    with pytest.raises(ValueError, match=r"block_size 1000000 .*max_seq_len=64"):
        DFlashSpecWrapper(target, draft, max_seq_len=64)


# ---------------------------------------------------------------------------------------------- checkpoint loading
@pytest.fixture
def saved(target, tmp_path):
    _draft(target).save_pretrained(tmp_path)
    return tmp_path


def _edit_weights(path, fn):
    f = path / "model.safetensors"
    state = load_file(f)
    fn(state)
    save_file(state, f, metadata={"format": "pt"})



@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_non_floating_weights_are_refused(saved, dtype):
    _edit_weights(saved, lambda s: s.__setitem__("norm.weight", s["norm.weight"].to(dtype)))
    with pytest.raises(ValueError, match=r"not floating point \[model\.safetensors: 'norm\.weight' is "):
        DFlashDraftModel.from_pretrained(saved)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(saved, value):
    def poison(s):
        s["layers.1.mlp.up_proj.weight"][3, 7] = value

    _edit_weights(saved, poison)
    with pytest.raises(ValueError, match=r"model\.safetensors.*'layers\.1\.mlp\.up_proj\.weight'.*non-finite"):
        DFlashDraftModel.from_pretrained(saved)


@pytest.mark.parametrize("field,value", [
    ("num_attention_heads", 0), ("num_key_value_heads", 0), ("head_dim", 0), ("hidden_size", 0),
    ("intermediate_size", 0), ("vocab_size", 0), ("num_attention_heads", -4), ("num_key_value_heads", 1.5),
    ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", float("nan")),
    ("rope_theta", 0), ("rope_theta", -10000.0),
])
def test_bad_sizes_and_constants_are_clear_errors(saved, field, value):
    cfg = json.loads((saved / "config.json").read_text())
    if field == "rope_theta":
        cfg["rope_parameters"]["rope_theta"] = value
    cfg[field] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        DFlashDraftModel.from_pretrained(saved)


@pytest.mark.parametrize("keep", [0.5, 0.999, 12], ids=["half", "last_bytes", "header"])
def test_truncated_safetensors_name_the_file(saved, keep):
    f = saved / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        DFlashDraftModel.from_pretrained(saved)


def test_names_and_shapes_are_checked_from_the_header_before_reading(saved, monkeypatch):
    import safetensors

    _edit_weights(saved, lambda s: s.__setitem__("fc.weight", s["fc.weight"][:, :-1].contiguous()))
    real = safetensors.safe_open
    reads = []

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def get_tensor(self, key):
            reads.append(key)
            return self.inner.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    with pytest.raises(ValueError, match=r"wrong shapes \[fc\.weight"):
        DFlashDraftModel.from_pretrained(saved)
    assert reads == []


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


# ---------------------------------------------------------------------------------------------- generate inputs
@pytest.fixture(scope="module")
def spec(target):
    return DFlashSpecWrapper(target, _draft(target), max_batch_size=4, max_seq_len=96)


@pytest.mark.parametrize("ids", [
    torch.tensor([PROMPT], dtype=torch.float32), torch.tensor([PROMPT], dtype=torch.float64),
    torch.tensor([[True, False, True]]), torch.tensor([PROMPT]) + 0j, [[5.0, 17.0, 42.0]], [[5, 17.5]],
    [[True, 3]], [5.0, 17.0],
], ids=["f32", "f64", "bool", "complex", "float_list", "mixed_list", "bool_list", "flat_float_list"])
def test_input_ids_must_be_integers(spec, monkeypatch, ids):
    def no_work(*a, **k):
        raise AssertionError("model work started before validation")

    monkeypatch.setattr(spec, "prefill", no_work)
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        spec.generate(ids, max_new_tokens=4)


def _tokenizer():
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class _CountingTokenizer:
    """Records the most token ids any one ``decode`` call was given."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __len__(self):
        return len(self.tok)

    def decode(self, ids, **kw):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def test_stop_strings_decode_a_bounded_tail(target, spec):
    tok = _CountingTokenizer(_tokenizer())
    out = spec.generate([PROMPT], max_new_tokens=60, stop_strings=["never there"], tokenizer=tok,
                        return_dict_in_generate=True)
    assert out.num_new_tokens == [60] and out.finish_reasons == ["length"]
    assert tok.longest <= 2 * len("never there"), tok.longest  # not the whole generation (60 tokens)

    # A stop string that starts and ends inside tokens and spans three of them still stops at the right token.
    free = _greedy(target, PROMPT, 30)
    plain = _tokenizer()
    piece = plain.decode(free[20:23])
    stop = piece[1:-1]
    first = next(k for k in range(1, 31) if stop in plain.decode(free[:k]))
    out = spec.generate([PROMPT], max_new_tokens=30, stop_strings=[stop], tokenizer=tok, return_dict_in_generate=True)
    assert out.finish_reasons == ["stop"] and out.sequences[0, len(PROMPT):].tolist() == free[:first]


# ---------------------------------------------------------------------------------------------- hooks and lifetime
def test_close_and_with_remove_the_hooks(target):
    before = _hooks(target)
    draft = _draft(target)
    specs = [DFlashSpecWrapper(target, draft, max_seq_len=64) for _ in range(3)]
    assert _hooks(target) > before
    for s in specs:
        s.close()
        s.close()  # idempotent
    assert _hooks(target) == before
    with pytest.raises(RuntimeError, match="closed"):
        specs[0].generate([PROMPT], max_new_tokens=2)
    with DFlashSpecWrapper(target, draft, max_seq_len=64) as s:
        assert s.generate([PROMPT], max_new_tokens=3)[0, len(PROMPT):].tolist() == _greedy(target, PROMPT, 3)
        assert _hooks(target) > before
    assert _hooks(target) == before


def test_no_hidden_states_kept_after_generate(target):
    with DFlashSpecWrapper(target, _draft(target), max_seq_len=64) as s:
        s.generate([PROMPT], max_new_tokens=5)
        assert not s.aux._store
        target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=3)  # a plain target call
        assert not s.aux._store  # records only for the wrapper's own forwards


# ---------------------------------------------------------------------------------------------- KV pools
def test_pools_are_sized_from_the_requests(target):
    spec = DFlashSpecWrapper(target, _draft(target), max_batch_size=64, max_seq_len=512, page_size=8)
    out = spec.generate([PROMPT], max_new_tokens=8)
    assert out[0, len(PROMPT):].tolist() == _greedy(target, PROMPT, 8)
    assert spec.kv_cache_bytes() < 2**20 and spec.pools.cache.num_blocks <= 4  # 4 + 8 + 4 tokens, not 64 x 512

    prompts = [PROMPT * k for k in range(1, 7)]  # 6 requests, 3 at a time: the pools grow for them, once
    spec = DFlashSpecWrapper(target, _draft(target), max_batch_size=3, max_seq_len=512, page_size=8)
    out = spec.generate(prompts, max_new_tokens=20, pad_token_id=0, return_dict_in_generate=True)
    width = out.prompt_width
    assert [out.sequences[i, width:].tolist() for i in range(6)] == [_greedy(target, p, 20) for p in prompts]
    assert spec.pools.cache.num_blocks <= 2 * 3 * -(-(24 + 20 + 4) // 8)


def test_huge_max_batch_size_with_one_prompt(target):
    spec = DFlashSpecWrapper(target, _draft(target), max_batch_size=100_000, max_cache_bytes=10**8)
    assert spec.generate([PROMPT], max_new_tokens=4)[0, len(PROMPT):].tolist() == _greedy(target, PROMPT, 4)


def test_pools_over_the_allowed_memory_are_refused_naming_the_bytes(target):
    spec = DFlashSpecWrapper(target, _draft(target), max_batch_size=4, max_seq_len=64, page_size=8,
                             max_cache_bytes=10_000)
    with pytest.raises(ValueError, match=r"need \d+ bytes .*max_cache_bytes=10000"):
        spec.generate([PROMPT], max_new_tokens=8)
    assert spec.pools.cache is None


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
