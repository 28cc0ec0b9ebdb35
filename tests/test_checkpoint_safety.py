"""Checkpoints and configs that must be refused before any work: planted pickles, bad block sizes, bad weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_compile import DFlashConfig, DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.training import DraftDataset, TrainConfig, train_drafter
from tiny_models import VOCAB, tiny_target

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
