import pytest

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from tiny_models import VOCAB, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def _draft(target, **kw):
    kw.setdefault("target_layer_ids", [1, 3])
    return DFlashDraftModel.from_target(target, seed=0, **kw)


def test_valid_pair(target):
    draft = _draft(target)
    hooks = sum(len(m._forward_hooks) for m in target.modules())
    spec = DFlashSpecWrapper(target, draft, num_speculative_tokens=7)
    assert spec.speculative_ks == (7,) and spec.verify_len == 8 and spec.block_size == draft.block_size
    assert draft.embed_tokens is target.get_input_embeddings() and draft.lm_head is target.get_output_embeddings()
    assert spec.kv_cache_bytes() == 0 and spec.pools.cache is None  # nothing allocated before a request
    assert sum(len(m._forward_hooks) for m in target.modules()) == hooks + len(set(draft.dflash_config.target_layer_ids))
    spec.close()


def test_hidden_size_mismatch(target):
    other = tiny_target("qwen3", hidden_size=32)
    with pytest.raises(ValueError, match="hidden size mismatch: drafter 32, target 64"):
        DFlashSpecWrapper(target, _draft(other))


def test_vocab_mismatch(target):
    other = tiny_target("qwen3", vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match=f"vocab size mismatch: drafter {VOCAB + 8}, target {VOCAB}"):
        DFlashSpecWrapper(target, _draft(other))


def test_layer_ids_outside_target(target):
    deeper = tiny_target("qwen3", num_hidden_layers=8)
    with pytest.raises(ValueError, match=r"target_layer_ids \[6\] are outside the target's 4 decoder layers"):
        DFlashSpecWrapper(target, _draft(deeper, target_layer_ids=[1, 6]))


def test_built_for_another_depth(target):
    deeper = tiny_target("qwen3", num_hidden_layers=8)
    with pytest.raises(ValueError, match="built for a 8-layer target, this target has 4 layers"):
        DFlashSpecWrapper(target, _draft(deeper, target_layer_ids=[1, 3]))


def test_mask_token_outside_vocab(target):
    with pytest.raises(ValueError, match=f"mask_token_id {VOCAB} >= target vocab_size {VOCAB}"):
        DFlashSpecWrapper(target, _draft(target, mask_token_id=VOCAB))


def test_num_speculative_tokens(target):
    assert DFlashSpecWrapper(target, _draft(target), num_speculative_tokens=5).num_speculative_tokens == 5
    with pytest.raises(ValueError, match=r"num_speculative_tokens=8: .* block_size 8 .* 0 <= num_speculative_tokens <= 7"):
        DFlashSpecWrapper(target, _draft(target), num_speculative_tokens=8)


def test_dtype_mismatch(target):
    with pytest.raises(ValueError, match="dtype mismatch: drafter torch.float64, target torch.float32"):
        DFlashSpecWrapper(target, _draft(target).double())


def test_device_mismatch(target):
    draft = _draft(target).to("meta")
    with pytest.raises(ValueError, match="device mismatch: drafter on meta, target on cpu"):
        DFlashSpecWrapper(target, draft)
