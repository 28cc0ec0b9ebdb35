"""What the wrapper checks of a target and its drafter before any work, and what it reads of the target's masks.

``validate_pair`` (the pair's shapes, vocabularies, layer ids, dtypes, devices), ``check_heads_divide`` (a
tensor-parallel target's heads over its ranks), ``mask_plan`` (what each mask the target's forward reads is) and
``check_paged_forward`` (the target over the paged pools gives its own logits: run once per device and dtype, on
small pools of its own, before the real ones exist).
"""

from __future__ import annotations

import functools
import numbers

import torch
from torch import nn

from ..models.draft_model import DFlashDraftModel
from ..models.hidden_states import decoder_layers
from ..primitives.masks import MaskSpec
from ..primitives.slots import pages
from ..step.step import PADDING

MASKABLE = ("sdpa", "eager")  # attention implementations that read the 4-D masks the step builds


def validate_pair(target: nn.Module, draft: DFlashDraftModel, num_speculative_tokens: int | None = None) -> None:
    """Raise ``ValueError`` with a specific message when ``draft`` cannot speculate for ``target``."""
    tcfg = target.config.get_text_config()
    dcfg, dflash = draft.config, draft.dflash_config
    if dcfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"hidden size mismatch: drafter {dcfg.hidden_size}, target {tcfg.hidden_size}")
    embed = target.get_input_embeddings()
    target_vocab = tcfg.vocab_size
    if dcfg.vocab_size != target_vocab:
        raise ValueError(f"vocab size mismatch: drafter {dcfg.vocab_size}, target {target_vocab}")
    if embed is not None and embed.weight.shape[0] < target_vocab:
        raise ValueError(f"target embeddings have {embed.weight.shape[0]} rows for vocab_size {target_vocab}")
    n = len(decoder_layers(target))
    bad = [i for i in dflash.target_layer_ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"target_layer_ids {bad} are outside the target's {n} decoder layers [0, {n})")
    if dflash.num_target_layers != n:
        raise ValueError(
            f"the drafter was built for a {dflash.num_target_layers}-layer target, this target has {n} layers"
        )
    if dflash.mask_token_id >= target_vocab:
        raise ValueError(f"mask_token_id {dflash.mask_token_id} >= target vocab_size {target_vocab}")
    K = num_speculative_tokens
    if K is not None and (isinstance(K, bool) or not isinstance(K, numbers.Integral)
                          or not 0 <= K <= dflash.block_size - 1):
        raise ValueError(
            f"num_speculative_tokens={K!r}: a DFlash drafter with block_size {dflash.block_size} proposes "
            f"block_size - 1 = {dflash.block_size - 1} tokens, so 0 <= num_speculative_tokens <= "
            f"{dflash.block_size - 1} (0: plain decoding)"
        )
    tp, dp = next(target.parameters()), next(draft.parameters())
    if tp.dtype != dp.dtype:
        raise ValueError(f"dtype mismatch: drafter {dp.dtype}, target {tp.dtype}; call draft.to({tp.dtype})")
    if tp.device != dp.device:
        raise ValueError(f"device mismatch: drafter on {dp.device}, target on {tp.device}")


def check_heads_divide(tcfg, world: int) -> None:
    """A tensor-parallel target's attention and KV heads must split evenly over its ``world`` ranks."""
    heads = {"num_attention_heads": tcfg.num_attention_heads,
             "num_key_value_heads": getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads}
    odd = [f"{k}={v}" for k, v in heads.items() if v % world]
    if odd:
        raise ValueError(f"the target's {', '.join(odd)} do not divide over its {world} tensor-parallel ranks: each "
                         f"rank must hold whole heads, the same number on every rank")


def check_attention(target: nn.Module) -> None:
    attn = getattr(target.config, "_attn_implementation", None) or "eager"
    if attn not in MASKABLE:
        raise ValueError(f"target attention implementation {attn!r} is not supported: load it with "
                         f"attn_implementation='sdpa' (or 'eager')")


def check_tokenizer(tokenizer, target: nn.Module) -> None:
    """A tokenizer whose vocabulary is larger than the target's cannot be used with it: ``ValueError``."""
    vocab = target.config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the target's vocabulary has {vocab}: "
            f"they do not belong together"
        )


def mask_plan(tcfg, layouts) -> dict[str | None, MaskSpec | str | None]:
    """What each mask the target reads is, keyed as its forward reads them: a ``MaskSpec`` (causal visibility over
    the paged context, windowed or chunked), ``PADDING`` (the 2-D padding mask that recurrent
    layers zero left padding with) or None (read by layers that cache nothing). Key None: one mask for every layer.

    A config with ``layer_types`` gets a dict, keyed as transformers keys the dict of masks its own ``generate``
    hands a model: each layer type names its mask function(s) in ``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING`` (a
    ``hybrid`` layer, attention and an SSM in one, reads two masks), and the function says what the mask is. A layer
    type transformers has no mask for is classified by what its layers cache (``layouts``, from
    ``paged.layout.probe_layout``). Without ``layer_types`` every layer attends, windowed by ``sliding_window`` if the
    config has one (Mistral), and one mask serves them all."""
    from transformers import masking_utils as hf

    patterns = getattr(tcfg, "layer_types", None)
    if not patterns:
        return {None: MaskSpec(window=getattr(tcfg, "sliding_window", None) or None)}
    built_as = {hf.create_causal_mask: MaskSpec(),
                hf.create_sliding_window_causal_mask: MaskSpec(window=getattr(tcfg, "sliding_window", None) or None),
                hf.create_chunked_causal_mask: MaskSpec(chunk=getattr(tcfg, "attention_chunk_size", None) or None),
                hf.create_recurrent_attention_mask: PADDING}

    def mask(pattern, fn):
        fn = fn.func if isinstance(fn, functools.partial) else fn
        if fn not in built_as:
            raise NotImplementedError(f"target layer type {pattern!r}: transformers masks it with "
                                      f"{getattr(fn, '__name__', fn)}, which this wrapper does not build")
        return built_as[fn]

    plan = {}
    for pattern in dict.fromkeys(patterns):
        fn = hf.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(pattern)
        if isinstance(fn, dict):
            for key, f in fn.items():
                plan.setdefault(key, mask(pattern, f))
        elif fn is not None:
            plan[pattern] = mask(pattern, fn)
        else:
            cached = {type(lay).__name__ if lay is None or lay.attention is None else "both"
                      for lay, p in zip(layouts, patterns) if p == pattern} if layouts is not None else set()
            if cached <= {"NoneType"}:
                plan[pattern] = None  # cache nothing: an MLP-only layer, say (or not probed yet)
            elif cached == {"StateLayout"}:
                plan[pattern] = PADDING
            else:
                raise NotImplementedError(f"target layer type {pattern!r} caches attention K/V, and transformers "
                                          f"names no mask for it")
    if len(plan) == 1 and list(plan.values()) == [MaskSpec()]:
        return {None: plan.popitem()[1]}  # every layer attends alike: one mask
    return plan


def _window_fields(tcfg) -> dict[str, int]:
    """Config fields named like a window or a chunk that the masks do not encode (the paged-forward check's prompts
    are made longer than each)."""
    encoded = {"sliding_window", "attention_chunk_size"}  # read by the masks (``mask_plan``)
    return {k: v for k, v in vars(tcfg).items() if ("window" in k or "chunk" in k) and k not in encoded
            and isinstance(v, int) and not isinstance(v, bool) and v > 0}


@torch.no_grad()
def check_paged_forward(step, make_pools) -> None:
    """Before any work: the target over the paged pools gives its own logits. Two left-padded random prompts through
    a prefill and a 3-token stepped forward (the verify path) of ``step`` (a ``DFlashStep``), on pools from
    ``make_pools(max_batch_size=, num_blocks=)``, against the target's own forward over each whole sequence (no
    cache). A target that reads something the pools and masks do not carry (an attention window or positions of its
    own, state kept outside transformers' cache) or that fails under them is refused here with the reason, rather
    than giving other tokens or failing in a step."""
    windows = _window_fields(step.target.config.get_text_config())
    new = 3
    long = min(max([2 * step.page_size + 3, *(w + 4 for w in windows.values())]), step.max_seq_len - new)
    lens = [long, max(1, min(5, long - 2))]
    if long < 2:
        return
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, step.draft.config.vocab_size - 2, (n + new,), generator=g).tolist() for n in lens]
    cache = make_pools(max_batch_size=2, num_blocks=sum(pages(n + new, step.page_size) for n in lens))
    rows = [0, 1]
    try:
        for r, n in zip(rows, lens):
            cache.ensure(r, n + new)
        paged, aux = _paged_logits(step, cache, rows, seqs, lens, new)
        _check_features(step.draft, aux, max(lens))
        _check_logits(step.target, paged, seqs, windows, lens, new)
    finally:
        for r in rows:
            cache.free(r)


def _paged_logits(step, cache, rows, seqs, lens, new):
    """Each sequence's logits over the pools (its prompt's, then the ``new`` stepped tokens') and the prefill's
    context features."""
    device = cache.device
    tables = cache.block_table(rows)
    slots = torch.tensor([cache.state_slot(r) for r in rows], device=device)
    L = max(lens)
    ids = torch.tensor([[0] * (L - n) + q[:n] for q, n in zip(seqs, lens)], device=device)
    n_t = torch.tensor(lens, device=device)
    positions = torch.arange(L, device=device) - (L - n_t)[:, None]
    active = torch.ones(len(rows), dtype=torch.bool, device=device)
    try:
        pre, aux, _ = step.target_forward(ids, positions.clamp(min=0), positions >= 0, n_t, tables, active,
                                          cache.target_pools, state_slots=slots)
        step_ids = torch.tensor([q[n:] for q, n in zip(seqs, lens)], device=device)
        step_pos = n_t[:, None] + torch.arange(new, device=device)
        stepped, _, _ = step.target_forward(step_ids, step_pos, step_pos >= 0, n_t + new, tables, active,
                                            cache.target_pools, state_slots=slots, stepped=True)
    except Exception as e:
        raise ValueError(f"the target fails over the paged cache ({type(e).__name__}: {e}): it reads or stores "
                         f"something transformers' cache seams do not carry here") from e
    return [torch.cat([pre[i, L - n:], stepped[i]]) for i, n in enumerate(lens)], aux


def _check_features(draft: DFlashDraftModel, aux: torch.Tensor, L: int) -> None:
    ids = list(draft.dflash_config.target_layer_ids)
    width = len(ids) * draft.config.hidden_size
    if tuple(aux.shape) != (2, L, width):
        raise ValueError(f"the target's decoder layers give hidden states the drafter cannot read: "
                         f"{tuple(aux.shape)} for its layers {ids} over 2 prompts of {L} tokens, expected "
                         f"{(2, L, width)} ([batch, tokens, hidden] per layer)")


def _check_logits(target: nn.Module, paged: list[torch.Tensor], seqs, windows: dict, lens, new) -> None:
    device = paged[0].device
    worst = 0.0
    for q, ours in zip(seqs, paged):
        # positions from 0, given as HF's generate gives them (RoBERTa-like models offset their own)
        ref = target(input_ids=torch.tensor([q], device=device),
                     position_ids=torch.arange(len(q), device=device)[None]).logits[0].float()
        scale = 1.0 + ref.abs().max().item()
        worst = max(worst, (ours.float() - ref).abs().max().item() / scale)
    tol = 1e-3 if paged[0].dtype == torch.float32 else 5e-2
    if not worst <= tol:
        named = [k for k in windows if "window" in k]
        raise ValueError(
            f"the target's logits over the paged cache differ from its own forward (largest difference {worst:.2g} "
            f"of the logits' scale, tolerance {tol:g}, prompts of {lens} tokens + {new}): it reads something the "
            f"cache and masks do not carry (an attention window or positions of its own"
            + (f", e.g. {', '.join(named)}" if named else "") + ", or state kept outside transformers' cache)")
