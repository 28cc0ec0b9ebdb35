"""Targets beyond plain attention: hybrid linear-attention (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet recurrent
states), short convolutions (LFM2: a conv window only), attention and Mamba-2 in one layer (Falcon-H1; Zamba2's
layers with a shared attention block), interleaved Mamba-2 / attention / MLP-only layers (Nemotron-H: a layer that
caches nothing), MLA (DeepSeek-V3: K and V of different widths), gpt-oss (sinks, alternating windows, MoE) and
Mistral with a ``sliding_window`` and no ``layer_types``.

Greedy output is the same whatever the drafter proposes, so each target runs with three drafters: a random one
(nothing accepted), an always-right one (a zero LM head: every draft accepted) and an oracle right on the first
``position % block_size`` drafts of each block (``oracle_draft.py``), whose every step's acceptance is replayed
from the verified drafts: a recurrent state restored to the wrong block position, or a draft pool that misses its
context, shows in the tokens or in the acceptance.
"""

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.primitives.slots import TRASH_SLOT, ZERO_SLOT
from dflash_compile.paged.recurrent import unstep
from oracle_draft import CyclePolicy, check_drafting, oracle_pair
from test_batching import poisoning
from test_sampling import LAWS, N, V, _chi_square_p, _exact_law, _sampled_counts, one_thread  # noqa: F401
from tiny_models import VOCAB, tiny_target

STATEFUL = ["qwen3_5", "lfm2", "falcon_h1", "zamba2", "nemotron_h"]  # layers with conv / recurrent states
ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "gpt_oss", "mistral_sliding", "lfm2", "falcon_h1",
         "zamba2", "nemotron_h"]
HYBRID = "qwen3_5"
B = 4  # block size
NEW = 14
PAD = VOCAB - 2
LENGTHS = [3, 17, 30]  # longer than the sliding windows and the convolution


def _prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]


def _reference(target, prompt, new=NEW):
    return target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new)[0, len(prompt):].tolist()


def _spec(target, drafter, prompts=(), **kw):
    """(wrapper, the oracle's greedy sequences or None)."""
    draft_kw = dict(num_layers=2, block_size=B, target_layer_ids=[1, 3], seed=0)
    fulls = None
    if drafter == "always_right":
        with torch.no_grad():
            target.get_output_embeddings().weight.zero_()  # every logit 0: the target and drafter both pick token 0
    if drafter == "oracle":
        draft, fulls = oracle_pair(target, list(prompts), NEW, 96, **draft_kw)
    else:
        draft = DFlashDraftModel.from_target(target, **draft_kw)
    kw = {**dict(speculation="fixed", max_batch_size=4, max_seq_len=96, page_size=8), **kw}
    return DFlashSpecWrapper(target, draft, **kw), fulls


@pytest.mark.parametrize("drafter", ["random", "always_right", "oracle"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_lossless(arch, drafter):
    target = tiny_target(arch)
    prompts = _prompts()
    spec, fulls = _spec(target, drafter, prompts)
    refs = [_reference(target, p) for p in prompts]
    kw = dict(max_new_tokens=NEW, return_dict_in_generate=True, output_drafts=True)
    for i, (p, ref) in enumerate(zip(prompts, refs)):  # batch 1, several prompt lengths
        out = spec.generate([p], **kw)
        assert out.sequences[0, len(p):].tolist() == ref
        if drafter == "oracle":
            accepted, forced = check_drafting(spec.draft, [p], [fulls[i]], out)
            assert forced > 0
        if drafter == "always_right":
            assert out.num_accepted_tokens == out.num_draft_tokens > 0
    out = spec.generate(prompts, pad_token_id=PAD, **kw)  # left-padded
    assert [out.sequences[i, out.prompt_width:].tolist() for i in range(3)] == refs
    if drafter == "oracle":
        check_drafting(spec.draft, prompts, fulls, out)


@pytest.mark.parametrize("arch", ARCHS)
def test_k_switching_every_step_is_lossless(arch):
    # K changes at every step (plain steps, with and without a proposal, between speculative ones): recurrent
    # states, MLA pools, sinks and windows all see verify blocks of every length.
    target = tiny_target(arch)
    prompts = _prompts()
    spec, fulls = _spec(target, "oracle", prompts, speculation=CyclePolicy([0, 1, 3, 0, 0, 2, 3, 1]))
    refs = [_reference(target, p) for p in prompts]
    out = spec.generate(prompts, pad_token_id=PAD, max_new_tokens=NEW, return_dict_in_generate=True,
                        output_drafts=True)
    assert [out.sequences[i, out.prompt_width:].tolist() for i in range(3)] == refs
    assert set(out.step_ks[0]) == {0, 1, 2, 3}
    accepted, forced = check_drafting(spec.draft, prompts, fulls, out)
    assert forced > 0


def test_pools_sized_from_what_each_layer_caches():
    # Read from HF's own cache after one token: MLA caches a latent and a rotary key of different widths; a Gated
    # DeltaNet layer a convolution window and a recurrent state, one slot per running request.
    mla = tiny_target("deepseek_v3")
    pools = DFlashSpecWrapper(mla, DFlashDraftModel.from_target(mla, num_layers=1, block_size=B), max_batch_size=2,
                              max_seq_len=32, page_size=8).kv_cache().target_pools
    cfg = mla.config
    assert all(isinstance(p, tuple) for p in pools)
    assert [(k.shape, v.shape) for k, v in pools][0] == ((2 * 4 * 8 + 2, 1, cfg.kv_lora_rank), (66, 1, cfg.qk_rope_head_dim))
    hybrid = tiny_target(HYBRID)
    pools = DFlashSpecWrapper(hybrid, DFlashDraftModel.from_target(hybrid, num_layers=1, block_size=B),
                              max_batch_size=3, max_seq_len=32, page_size=8).kv_cache().target_pools
    cfg = hybrid.config
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    assert {n: tuple(t.shape) for n, t in pools[0].items()} == {
        "conv0": (3 + 2, conv_dim, cfg.linear_conv_kernel_dim),
        "recurrent0": (3 + 2, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
    }
    assert pools[1].shape == (2, 3 * 4 * 8 + 2, cfg.num_key_value_heads, cfg.head_dim)
    # Falcon-H1 layers hold attention K/V and Mamba-2 states side by side: each gets both. Nemotron-H's MLP-only
    # layer caches nothing: no pool. LFM2's short convolutions keep a conv window and no recurrent state.
    both = tiny_target("falcon_h1")
    pools = DFlashSpecWrapper(both, DFlashDraftModel.from_target(both, num_layers=1, block_size=B), max_batch_size=3,
                              max_seq_len=32, page_size=8).kv_cache().target_pools
    assert all(sorted(p) == ["attention", "conv0", "recurrent0"] for p in pools)
    assert pools[0]["attention"].shape == (2, 3 * 4 * 8 + 2, 2, 16) and pools[0]["recurrent0"].shape[0] == 3 + 2
    kinds = {}
    for arch in ("nemotron_h", "lfm2", "zamba2"):
        target = tiny_target(arch)
        spec = DFlashSpecWrapper(target, DFlashDraftModel.from_target(target, num_layers=1, block_size=B),
                                 max_batch_size=3, max_seq_len=32, page_size=8)
        kinds[arch] = [None if p is None else sorted(p) if isinstance(p, dict) else "kv"
                       for p in spec.kv_cache().target_pools]
    assert kinds == {"nemotron_h": [["conv0", "recurrent0"], "kv", ["conv0", "recurrent0"], None],
                     "lfm2": [["conv0"], "kv", ["conv0"], "kv"],
                     "zamba2": [["conv0", "recurrent0"], ["attention", "conv0", "recurrent0"]] * 2}


# The passes' counters per family: block attention = the target's attention layers + the drafter's 2; paged
# writes = one K/V write per target attention layer + the drafter's 3, and the Mamba-2 conv-window writes that the
# same scatter pattern matches (a ``[slots, channels, kernel]`` pool written at 1-D slots: rewritten alike, exact).
COMPILED_COUNTERS = {
    "qwen3_5": {"block_attention": 4, "paged_kv_write": 5, "fused_kv_proj": 1},
    "lfm2": {"block_attention": 4, "paged_kv_write": 5, "fused_kv_proj": 1},
    "falcon_h1": {"block_attention": 6, "paged_kv_write": 9, "fused_kv_proj": 1},
    "zamba2": {"block_attention": 4, "paged_kv_write": 7, "fused_kv_proj": 1},
    "nemotron_h": {"block_attention": 3, "paged_kv_write": 4, "fused_kv_proj": 1},
}


@pytest.mark.parametrize("arch", STATEFUL)
def test_stateful_targets_compile_to_one_graph_per_bucket(arch):
    target = tiny_target(arch)
    prompts, later = _prompts(), _prompts(seed=1)
    spec, fulls = _spec(target, "oracle", prompts + later, batch_buckets=(4,), context_buckets=(96,))  # one key
    kw = dict(max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True, output_drafts=True)
    eager = spec.generate(prompts, **kw)
    counters.clear()
    torch._dynamo.reset()
    spec.compile(backend="dflash", fullgraph=True)
    out = spec.generate(prompts, **kw)
    assert torch.equal(out.sequences, eager.sequences)
    assert out.drafts == eager.drafts and out.per_request == eager.per_request  # the same drafts, accepted alike
    check_drafting(spec.draft, prompts, fulls[:3], out)
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["dflash"]) == COMPILED_COUNTERS[arch]  # the passes still fire on the attention layers
    again = spec.generate(later, **kw)  # a later batch reuses the graphs
    assert counters["stats"]["unique_graphs"] == 1
    assert [again.sequences[i, again.prompt_width:].tolist() for i in range(3)] == [_reference(target, p) for p in later]
    check_drafting(spec.draft, later, fulls[3:], again)


def _poison_state_slot(cache, request):
    slot = cache.state_slot(request.index)
    for pool in cache.target_pools:
        if isinstance(pool, dict):
            for name, state in pool.items():
                if name != "attention":
                    state[slot] = float("nan")


@pytest.mark.parametrize("max_batch_size", [4, 2], ids=["together", "queued_reuse"])
def test_poisoned_state_slot_does_not_leak(max_batch_size):
    target = tiny_target(HYBRID)
    prompts = _prompts([9, 21, 4, 16])
    kw = dict(max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True, output_drafts=True)
    ref = _spec(target, "random", max_batch_size=max_batch_size)[0].generate(prompts, **kw)
    poisoned = poisoning(_spec(target, "random", max_batch_size=max_batch_size)[0], prompts[1], _poison_state_slot)
    out = poisoned.generate(prompts, **kw)
    keep = [0, 2, 3]
    assert torch.equal(out.sequences[keep], ref.sequences[keep])
    assert [out.drafts[i] for i in keep] == [ref.drafts[i] for i in keep]
    assert not torch.equal(out.sequences[1], ref.sequences[1])  # the poison really reached the victim's state


def audit_state_writes(spec) -> dict:
    """After every step of ``spec``: the state pools changed only in live rows' slots (or the trash), never in
    ZERO_SLOT (hooks around its ``DFlashStep``); returns ``{"steps": audited steps}``."""
    seen = {"steps": 0}

    def before(module, inputs, kwargs):
        seen["states"] = [t for pool in inputs[4] if isinstance(pool, dict) for n, t in pool.items() if n != "attention"]
        seen["before"] = [t.clone() for t in seen["states"]]
        seen["live"] = kwargs["state_slots"][inputs[3]]

    def after(module, inputs, kwargs, out):
        allowed = torch.zeros(seen["states"][0].shape[0], dtype=torch.bool)
        allowed[seen["live"]] = True
        allowed[TRASH_SLOT] = True
        for old, new in zip(seen["before"], seen["states"]):
            changed = (old != new).flatten(1).any(1)
            assert not (changed & ~allowed).any(), "a state write landed outside the live rows' slots"
            assert not changed[ZERO_SLOT]
        seen["steps"] += 1

    spec.dflash_step.register_forward_pre_hook(before, with_kwargs=True)
    spec.dflash_step.register_forward_hook(after, with_kwargs=True)
    return seen


@pytest.mark.parametrize("arch", STATEFUL)
def test_state_writes_stay_in_own_slots(arch):
    target = tiny_target(arch)
    spec = _spec(target, "random", max_batch_size=4)[0]
    audited = audit_state_writes(spec)
    spec.generate(_prompts([3, 27, 9, 14, 6]), max_new_tokens=NEW, pad_token_id=PAD)
    assert audited["steps"] > 3


@pytest.mark.parametrize("arch", [HYBRID, "falcon_h1"])
def test_hybrid_sampling_keeps_the_targets_law(one_thread, arch):  # noqa: F811
    target = tiny_target(arch, vocab_size=V)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8)  # a peaked next-token distribution
    temperature, top_k, top_p, block_size = LAWS["top_k"]
    law = _exact_law(target, temperature, top_k, top_p)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=block_size, target_layer_ids=[1, 3], seed=0)
    counts, out = _sampled_counts(target, draft, temperature, top_k, top_p)
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens  # acceptance and rejection both exercised
    assert _chi_square_p(counts, law * N) > 1e-3


def test_token_stepping_is_owned_by_each_wrapper():
    target = tiny_target(HYBRID)
    mixer = target.model.layers[0].linear_attn
    specs = [_spec(target, "random")[0] for _ in range(2)]
    for spec in specs:
        spec.kv_cache()
        spec.kv_cache(num_blocks=10 ** 3)  # reallocating the pools does not step twice
    assert "forward" in vars(mixer)
    specs[0].close()
    assert "forward" in vars(mixer)  # the other wrapper still needs it
    prompt = _prompts([9])[0]
    assert specs[1].generate([prompt], max_new_tokens=NEW)[0, 9:].tolist() == _reference(target, prompt)
    specs[1].close()
    assert "forward" not in vars(mixer) and "forward" not in vars(target.model.layers[2].linear_attn)
    unstep(target)  # more releases than users change nothing
    assert "forward" not in vars(mixer)


def test_qwen3_5_checkpoint_class_with_text_prompts():
    # Qwen3.5 checkpoints load as the image-text class; text prompts through it are lossless too.
    from tiny_models import _COMMON, _GDN
    config = transformers.Qwen3_5Config(
        text_config={**_COMMON, **_GDN},
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64),
    )
    config._attn_implementation = config.text_config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        target = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    target.generation_config.bos_token_id = None
    spec = _spec(target, "random")[0]
    prompts = _prompts([7, 20])
    out = spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD)
    assert [out[i, -NEW:].tolist() for i in range(2)] == [_reference(target, p) for p in prompts]


def test_mla_head_counts():
    # MLA's cache holds a latent and a rotary key whatever the head counts (the pools are probed, not read from
    # num_key_value_heads): other head counts than the default tiny target's are lossless.
    target = tiny_target("deepseek_v3", num_attention_heads=2, num_key_value_heads=2)
    prompts = _prompts([5, 19])
    spec = _spec(target, "random")[0]
    out = spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD)
    assert [out[i, -NEW:].tolist() for i in range(2)] == [_reference(target, p) for p in prompts]
    # num_key_value_heads != num_attention_heads: transformers 5.24's own MLA attention repeats the K/V it has
    # already expanded to every head (num_attention_heads // num_key_value_heads times) and fails; the wrapper
    # says so before any work instead of failing inside a step.
    target = tiny_target("deepseek_v3", num_key_value_heads=2)
    with pytest.raises(RuntimeError, match="must match the size"):
        _reference(target, prompts[0])
    spec = _spec(target, "random")[0]
    with pytest.raises(ValueError, match="the target's own forward fails on one token .*must match the size"):
        spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD)
    assert spec.scheduler.idle()
