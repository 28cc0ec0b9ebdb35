"""DFlashSpecWrapper: a Hugging Face causal LM and a DFlash drafter, generating losslessly together."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from .draft_model import DFlashDraftModel
from .generation import DFlashGenerateOutput, DFlashStats, resolve_generation_args
from .hidden_states import AuxHiddenStates, decoder_layers
from .rejection import greedy_accept


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
    if num_speculative_tokens is not None and num_speculative_tokens != dflash.block_size - 1:
        raise ValueError(
            f"num_speculative_tokens={num_speculative_tokens}, but a DFlash drafter with block_size "
            f"{dflash.block_size} proposes exactly block_size - 1 = {dflash.block_size - 1}"
        )
    tp, dp = next(target.parameters()), next(draft.parameters())
    if tp.dtype != dp.dtype:
        raise ValueError(f"dtype mismatch: drafter {dp.dtype}, target {tp.dtype}; call draft.to({tp.dtype})")
    if tp.device != dp.device:
        raise ValueError(f"device mismatch: drafter on {dp.device}, target on {tp.device}")


class DFlashSpecWrapper(nn.Module):
    """A target causal LM and its DFlash drafter.

    ``generate`` follows HF ``generate``: greedy output is token-identical to
    ``target.generate(do_sample=False)``; ``return_dict_in_generate=True`` adds speculation counters.
    """

    def __init__(self, target: nn.Module, draft: DFlashDraftModel, num_speculative_tokens: int | None = None):
        super().__init__()
        validate_pair(target, draft, num_speculative_tokens)
        self.target = target
        self.draft = draft.bind_target(target)
        self.aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        eos_token_id=None,
        pad_token_id: int | None = None,
        return_dict_in_generate: bool = False,
        **kwargs,
    ):
        """Generate like HF ``generate``; returns ``[B, L + new]`` or a ``DFlashGenerateOutput``."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.shape[0] != 1:
            raise NotImplementedError("batch size > 1 is not supported yet")
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
            raise NotImplementedError("padded prompts are not supported yet")
        if input_ids.shape[1] == 0:
            raise ValueError("the prompt is empty")
        args = resolve_generation_args(
            self.target,
            input_ids.shape[1],
            dict(kwargs, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id),
        )
        device = next(self.target.parameters()).device
        input_ids = input_ids.to(device)
        new_tokens, stats, reason = self._generate_one(input_ids, args)
        sequences = torch.cat([input_ids, torch.tensor([new_tokens], device=device)], dim=1)
        if not return_dict_in_generate:
            return sequences
        return DFlashGenerateOutput.build(sequences, [stats], [reason], self.block_size - 1)

    def _target_forward(self, ids, positions, cache):
        logits = self.target(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits
        return logits, self.aux.read()

    def _generate_one(self, input_ids, args):
        draft, B = self.draft, self.block_size
        device = input_ids.device
        L = input_ids.shape[1]
        cache = DynamicCache()
        stats = DFlashStats()
        positions = torch.arange(L, device=device)[None]
        logits, aux = self._target_forward(input_ids, positions, cache)
        ctx_k, ctx_v = draft.context_kv(draft.context_features(aux), positions)  # [Ld, 1, L, Hkv, D]
        ctx_pos = positions
        bonus = int(logits[0, -1].argmax())
        out = [bonus]
        seq_len = L
        offsets = torch.arange(B, device=device)
        while not self._finished(out, args):
            block_pos = (seq_len + offsets)[None]  # [1, B]
            block = torch.full((1, B), draft.mask_token_id, device=device)
            block[0, 0] = bonus
            valid = torch.ones_like(ctx_pos, dtype=torch.bool)
            drafts = draft(block, block_pos, ctx_k, ctx_v, ctx_pos, valid).argmax(-1)  # [1, B - 1]
            verify = torch.cat([block[:, :1], drafts], dim=1)
            logits, aux = self._target_forward(verify, block_pos, cache)
            tokens, num_accepted = greedy_accept(drafts, logits.argmax(-1))
            a = int(num_accepted[0])
            stats.record(B - 1, a)
            cache.crop(-(B - (a + 1)))  # keep the bonus and the accepted drafts
            new_k, new_v = draft.context_kv(draft.context_features(aux[:, : a + 1]), block_pos[:, : a + 1])
            ctx_k, ctx_v = torch.cat([ctx_k, new_k], dim=2), torch.cat([ctx_v, new_v], dim=2)
            ctx_pos = torch.cat([ctx_pos, block_pos[:, : a + 1]], dim=1)
            for t in tokens[0, : a + 1].tolist():
                out.append(t)
                if self._finished(out, args):
                    break
            bonus = out[-1]
            seq_len += a + 1
        return out, stats, "stop" if out[-1] in args.eos_token_ids else "length"

    @staticmethod
    def _finished(out, args) -> bool:
        return len(out) >= args.max_new_tokens or out[-1] in args.eos_token_ids
