import pytest

from dflash_compile import DFlashConfig, default_target_layer_ids


def _authors_config(**over):
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "num_target_layers": 36,
        "num_hidden_layers": 5,
        "layer_types": ["full_attention"] * 5,
    }
    cfg.update(over)
    return cfg


def test_parse_top_level_block_size():
    c = DFlashConfig.from_dict(_authors_config())
    assert c.block_size == 16 and c.num_speculative_tokens == 15
    assert c.mask_token_id == 151669
    assert c.target_layer_ids == (1, 9, 17, 25, 33)
    assert c.num_target_layers == 36 and c.num_draft_layers == 5


def test_parse_nested_block_size():
    raw = _authors_config()
    del raw["block_size"]
    raw["dflash_config"]["block_size"] = 8
    assert DFlashConfig.from_dict(raw).block_size == 8


def test_conflicting_block_sizes():
    raw = _authors_config()
    raw["dflash_config"]["block_size"] = 8
    with pytest.raises(ValueError, match="two different block_size"):
        DFlashConfig.from_dict(raw)


@pytest.mark.parametrize(
    "N,n,expected",
    [(36, 5, (1, 9, 17, 25, 33)), (28, 5, (1, 7, 13, 19, 25)), (36, 1, (18,)), (6, 2, (1, 3))],
)
def test_default_layer_ids(N, n, expected):
    assert default_target_layer_ids(N, n) == expected
    raw = _authors_config(num_target_layers=N, num_hidden_layers=n, layer_types=["full_attention"] * n)
    del raw["dflash_config"]["target_layer_ids"]
    assert DFlashConfig.from_dict(raw).target_layer_ids == expected


def test_default_rule_out_of_range():
    with pytest.raises(ValueError, match="pass target_layer_ids explicitly"):
        default_target_layer_ids(2, 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=1), "block_size"),
        (dict(mask_token_id=-1), "mask_token_id"),
        (dict(target_layer_ids=(0, 40)), r"target_layer_ids \[40\] are outside"),
        (dict(target_layer_ids=()), "at least one"),
        (dict(layer_types=("full_attention", "local")), "unknown layer_types"),
        (dict(layer_types=("sliding_attention", "full_attention")), "sliding_window"),
    ],
)
def test_validation(kwargs, match):
    base = dict(block_size=4, mask_token_id=5, target_layer_ids=(0, 1), layer_types=("full_attention",) * 2,
                num_target_layers=36)
    with pytest.raises(ValueError, match=match):
        DFlashConfig(**{**base, **kwargs})


def test_frozen_and_roundtrip():
    c = DFlashConfig.from_dict(_authors_config())
    with pytest.raises(Exception):
        c.block_size = 3
    raw = {**c.to_dict(), "num_hidden_layers": 5}
    assert DFlashConfig.from_dict(raw) == c
