"""The DFlash block-diffusion drafter: Qwen3 decoder layers fed by the target's context features.

The drafter owns no embedding and no LM head: it borrows the target's (``bind_target``). Its attention is
non-causal over ``[cached context K/V, the query block's own K/V]``; the context K/V of every layer come from
one projection of the context features (``context_kv``) and are written to a cache by the caller.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from .config import DFlashConfig, _integer, default_target_layer_ids
from .hf_format import WEIGHT_NAMES, authors_config, is_transformers_format, transformers_config
from .speculators_format import (
    authors_config_from_speculators,
    is_speculators_format,
    speculators_config,
    speculators_weights,
    weights_from_speculators,
)
from ..primitives.kv_projection import apply_rope, context_kv, rms_norm
from ..primitives.masks import MaskSpec, block_visibility, context_visibility

_CONFIG_NAME = "config.json"
_WEIGHTS_NAME = "model.safetensors"
_POSITIVE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "intermediate_size", "vocab_size")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DFlashRotaryEmbedding(nn.Module):
    """RoPE cos/sin at arbitrary positions. Angles are computed in fp32, or in fp64 for an fp64 model.

    ``inv_freq`` is rebuilt from the config whenever the module moves (``_apply``), so an fp64 copy of
    an fp32 model gets exact fp64 frequencies rather than widened fp32 ones.
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = self._frequencies(torch.float32, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _frequencies(self, dtype, device):
        rope = self.config.rope_parameters
        if rope.get("rope_type", "default") == "default":
            D = self.config.head_dim
            exponent = torch.arange(0, D, 2, dtype=torch.float64, device=device) / D
            return (1.0 / rope["rope_theta"] ** exponent).to(dtype), 1.0
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](self.config, device)
        return inv_freq.to(dtype), scaling

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            dtype = torch.float64 if self.inv_freq.dtype == torch.float64 else torch.float32
            self.inv_freq = self._frequencies(dtype, self.inv_freq.device)[0]
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [..., S]`` -> ``cos, sin [..., S, D]`` in ``x``'s dtype."""
        freqs = positions[..., None].to(self.inv_freq.dtype) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.eps = config.rms_norm_eps
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        # h [B, Q, H]; ctx_k/ctx_v [B, S, Hkv, D] (already normed and RoPE'd); mask [B, 1, Q, S + Q] bool
        B, Q, _ = h.shape
        q = apply_rope(self.q_norm(self.q_proj(h).view(B, Q, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(h).view(B, Q, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(h).view(B, Q, self.num_kv_heads, self.head_dim)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)  # [B, Hkv, S + Q, D]
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)  # [B, Hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp_group = None  # split over ranks (``DFlashDraftModel.split``): the partial outputs are summed

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self._sum(self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask))
        return h + self._sum(self.mlp(self.post_attention_layernorm(h)))

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's heads' (or MLP columns') share of a row-parallel output, summed over the ranks."""
        if self.tp_group is None:
            return partial
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(partial, "sum", self.tp_group)


#: Which of a layer's projections ``DFlashDraftModel.split`` shares out: column-parallel, then row-parallel.
SPLIT_COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
SPLIT_ROWS = ("self_attn.o_proj", "mlp.down_proj")
SPLIT_WEIGHTS = tuple(f"{name}.weight" for name in SPLIT_COLUMNS + SPLIT_ROWS)  # each rank's share differs


def _rows(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep this rank's share of ``linear``'s output features (column-parallel)."""
    n = linear.out_features // world
    linear.weight = nn.Parameter(linear.weight.detach()[rank * n:(rank + 1) * n].clone(), requires_grad=False)
    linear.out_features = n


def _columns(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep this rank's share of ``linear``'s input features (row-parallel)."""
    n = linear.in_features // world
    linear.weight = nn.Parameter(linear.weight.detach()[:, rank * n:(rank + 1) * n].clone(), requires_grad=False)
    linear.in_features = n


class DFlashDraftModel(nn.Module):
    """A DFlash drafter. ``config`` is the drafter's Qwen3 architecture, ``dflash_config`` its DFlash fields.

    Weight names follow the published checkpoints: ``fc``, ``hidden_norm``, ``norm``, ``layers.N.*``.
    """

    def __init__(self, config: Qwen3Config, dflash_config: DFlashConfig):
        super().__init__()
        if len(dflash_config.layer_types) != config.num_hidden_layers:
            raise ValueError(
                f"dflash_config.layer_types has {len(dflash_config.layer_types)} entries for "
                f"{config.num_hidden_layers} drafter layers"
            )
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})"
            )
        self.config = config
        self.dflash_config = dflash_config
        H = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(dflash_config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        Vd = dflash_config.draft_vocab_size
        if Vd is not None:  # a reduced draft vocabulary: an own head over Vd target tokens, d2t[i] = target id
            if Vd > config.vocab_size:
                raise ValueError(f"draft_vocab_size {Vd} is larger than the target's vocabulary {config.vocab_size}")
            # No init draw here (reset_parameters draws it last): a seed gives the layers the same weights as without.
            self.draft_head = nn.utils.skip_init(nn.Linear, H, Vd, bias=False)
            self.register_buffer("d2t", torch.arange(Vd), persistent=True)
        # Borrowed from the target, deliberately not registered as submodules (not in state_dict, not copied).
        self._borrowed: tuple[nn.Module, nn.Module] | None = None
        self.split_over: tuple[int, int] | None = None  # (rank, world) once ``split``

    # ------------------------------------------------------------------ tensor parallel
    def split_reason(self, world: int) -> str | None:
        """Why this drafter cannot be split over ``world`` ranks (a head or MLP count that ``world`` does not
        divide), or None."""
        c = self.config
        sizes = {"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                 "intermediate_size": c.intermediate_size}
        odd = [f"{k}={v}" for k, v in sizes.items() if v % world]
        return f"{', '.join(odd)} not divisible by {world} ranks" if odd else None

    def split(self, rank: int, world: int, group) -> "DFlashDraftModel":
        """Keep this rank's share of every layer, in place, as in Megatron-style tensor parallelism: the query, key and
        value heads and the MLP's gate/up columns (column-parallel), the output and down projections' matching
        inputs (row-parallel, their outputs all-reduced over ``group``: two all-reduces per layer). ``fc``, the norms
        and the rotary embedding stay whole. Every rank must call it with the full weights. Raises ``ValueError``
        when ``split_reason(world)``."""
        reason = self.split_reason(world)
        if reason:
            raise ValueError(f"the drafter cannot be split: {reason}")
        if self.split_over is not None:
            raise RuntimeError(f"the drafter is already split (rank {self.split_over[0]} of {self.split_over[1]})")
        for layer in self.layers:
            for name in SPLIT_COLUMNS:
                _rows(layer.get_submodule(name), rank, world)
            for name in SPLIT_ROWS:
                _columns(layer.get_submodule(name), rank, world)
            layer.self_attn.num_heads //= world
            layer.self_attn.num_kv_heads //= world
            layer.tp_group = group
        self.split_over = (rank, world)
        return self

    @property
    def num_kv_heads(self) -> int:
        """KV heads each layer holds here (this rank's share once ``split``)."""
        return self.layers[0].self_attn.num_kv_heads

    # ------------------------------------------------------------------ target binding
    def bind_target(self, target: nn.Module) -> "DFlashDraftModel":
        """Borrow ``target``'s input embeddings and LM head (shared modules, not copies)."""
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"{type(target).__name__} exposes no input embeddings or no output embeddings")
        self._borrowed = (embed, head)
        return self

    @property
    def embed_tokens(self) -> nn.Module:
        return self._require_bound()[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._require_bound()[1]

    def _require_bound(self):
        if self._borrowed is None:
            raise RuntimeError("the drafter is not bound to a target: call draft.bind_target(target) first")
        return self._borrowed

    @property
    def block_size(self) -> int:
        return self.dflash_config.block_size

    @property
    def draft_vocab_size(self) -> int | None:
        return self.dflash_config.draft_vocab_size

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary: the drafter's own head (reduced vocabulary) or the target's."""
        return self.draft_head(h) if self.draft_vocab_size is not None else self.lm_head(h)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., Vd]`` as target-vocabulary logits ``[..., V]``: ``-inf`` for every target
        token outside the draft vocabulary (probability 0 after any warper). The identity without a reduced vocabulary."""
        if self.draft_vocab_size is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.d2t, logits)

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids as draft-vocabulary ids, ``-1`` for those outside it (training labels)."""
        if self.draft_vocab_size is None:
            return ids
        t2d = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        t2d[self.d2t] = torch.arange(self.draft_vocab_size, device=ids.device)
        return t2d[ids]

    def set_draft_vocab(self, target_ids, target: nn.Module | None = None) -> None:
        """Make ``target_ids`` (distinct target token ids, ``draft_vocab_size`` of them) the draft vocabulary, in
        that order; with ``target``, the head starts as the target's LM head rows of those tokens."""
        ids = torch.as_tensor(target_ids, dtype=torch.long, device=self.d2t.device)
        if ids.shape != (self.draft_vocab_size,) or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.draft_vocab_size} distinct target ids, got {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids outside the target's vocabulary [0, {self.config.vocab_size})")
        with torch.no_grad():
            self.d2t.copy_(ids)
            if target is not None:
                w = target.get_output_embeddings().weight
                self.draft_head.weight.copy_(w[ids.to(w.device)].to(self.draft_head.weight))

    @property
    def mask_token_id(self) -> int:
        return self.dflash_config.mask_token_id

    # ------------------------------------------------------------------ forward pieces
    def stacked_kv_weight(self) -> torch.Tensor:
        """K and V projection weights of every layer stacked: ``[L * 2 * Hkv * D, H]`` (all K, then all V)."""
        ks = [layer.self_attn.k_proj.weight for layer in self.layers]
        vs = [layer.self_attn.v_proj.weight for layer in self.layers]
        return torch.cat(ks + vs, dim=0)

    def context_features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``[..., n_ids * H]`` concatenated target hidden states -> ``[..., H]`` context rows."""
        return self.hidden_norm(self.fc(aux_hidden))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE at ``positions``) and V of context rows for every layer, in one matmul.

        ``ctx [B, S, H]``, ``positions [B, S]`` -> ``k, v [L, B, S, Hkv, D]``.
        """
        k_norm = torch.stack([layer.self_attn.k_norm.weight for layer in self.layers])  # [L, D]
        cos, sin = self.rotary_emb(ctx, positions)  # [B, S, D]
        return context_kv(ctx, self.stacked_kv_weight(), k_norm, cos, sin, self.config.rms_norm_eps)

    def mask_spec(self, layer_type: str) -> MaskSpec:
        """What a drafter layer of ``layer_type`` sees: every context key and the whole block (non-causal), within
        the drafter's window on a sliding-attention layer."""
        return MaskSpec(causal=False, window=self.dflash_config.sliding_window if layer_type == "sliding_attention"
                        else None)

    def attention_mask(self, ctx_lens, num_ctx, block_positions) -> list[torch.Tensor]:
        """One ``[B, 1, Q, S + Q]`` boolean mask per layer: the valid context keys (positions ``< ctx_lens``)
        and the whole block, non-causal. Sliding-window layers also hide keys ``window`` or more positions
        behind the query."""
        B, Q = block_positions.shape
        key_pos = torch.arange(num_ctx, device=block_positions.device)
        masks = {}
        for kind in sorted(set(self.dflash_config.layer_types)):
            spec = self.mask_spec(kind)
            ctx = context_visibility(block_positions, ctx_lens, key_pos, spec).expand(B, Q, num_ctx)
            masks[kind] = torch.cat([ctx, block_visibility(block_positions, spec)], dim=-1)[:, None]
        return [masks[t] for t in self.dflash_config.layer_types]

    def forward(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of the draft tokens.

        ``block_ids [B, Q]`` (bonus then masks) at ``block_positions [B, Q]``; ``ctx_k``/``ctx_v``
        ``[L, B, S, Hkv, D]`` from ``context_kv``, the context key of position ``p`` at index ``p``, valid for
        ``p < ctx_lens[b]``. Returns ``[B, Q - 1, V]``: the logits for block positions ``1..Q-1``.
        """
        h = self.embed_tokens(block_ids)
        cos, sin = self.rotary_emb(h, block_positions)
        masks = self.attention_mask(ctx_lens, ctx_k.shape[2], block_positions)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, ctx_k[i], ctx_v[i], masks[i])
        return self.to_target_vocab(self.head(self.norm(h[:, 1:])))

    def forward_blocks(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | list[torch.Tensor],
    ) -> torch.Tensor:
        """Training form of ``forward``: several blocks per row in one pass, under an explicit mask.

        ``block_ids``/``block_positions [B, Q]`` hold the concatenated blocks; ``ctx_k``/``ctx_v``
        ``[L, B, S, Hkv, D]`` from ``context_kv``; ``mask [B, 1, Q, S + Q]`` bool (True = visible), one for every
        layer, or a list of one per layer (``training.objective.layer_masks``; a drafter with sliding-attention
        layers needs the list). Returns logits ``[B, Q, V]`` at every block position (a block's first position is
        its bonus token; the caller drops it).
        """
        if isinstance(mask, torch.Tensor):
            if "sliding_attention" in self.dflash_config.layer_types:
                raise ValueError("this drafter has sliding-attention layers: give forward_blocks one mask per layer "
                                 "(training.objective.layer_masks), not one for all")
            mask = [mask] * len(self.layers)
        if len(mask) != len(self.layers):
            raise ValueError(f"{len(mask)} masks for {len(self.layers)} drafter layers")
        h = self.embed_tokens(block_ids)
        cos, sin = self.rotary_emb(h, block_positions)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, ctx_k[i], ctx_v[i], mask[i])
        return self.head(self.norm(h))  # draft-vocabulary logits (``target_to_draft`` maps the labels)

    # ------------------------------------------------------------------ construction / IO
    @classmethod
    def from_target(
        cls,
        target: nn.Module,
        num_layers: int = 2,
        block_size: int = 8,
        mask_token_id: int | None = None,
        target_layer_ids=None,
        seed: int | None = None,
        tokenizer=None,
        draft_vocab=None,
        **overrides: Any,
    ) -> "DFlashDraftModel":
        """A randomly initialised drafter sized from ``target``'s config and bound to it.

        The mask token: ``mask_token_id`` if given, else ``config.choose_mask_token(tokenizer)`` (the tokenizer's
        mask token, else an unused special token). A ``mask_token_id`` that is an ordinary text token of
        ``tokenizer`` is refused. Without either, the id ``vocab_size - 1`` is taken with a warning: in many
        vocabularies it is ordinary text (a trained drafter then confuses masks with that token).

        ``draft_vocab``: target token ids for a reduced draft vocabulary (the drafter's own head over them, started
        from the target's LM head rows; see ``set_draft_vocab``); None: the target's head over its whole vocabulary.

        ``overrides`` set Qwen3 architecture fields (e.g. ``intermediate_size``) or ``layer_types`` /
        ``sliding_window``.
        """
        tcfg = target.config.get_text_config()
        mask_token_id = _mask_token(tcfg.vocab_size, mask_token_id, tokenizer)
        num_target_layers = _positive_int(tcfg, "num_hidden_layers")
        if num_target_layers is None:
            from .hidden_states import decoder_layers

            num_target_layers = len(decoder_layers(target))
        hidden = tcfg.hidden_size  # the drafter reads the target's hidden states and shares its vocabulary
        # The drafter's own shape follows the target's where the target has one (a trained drafter usually does),
        # else a plain one: targets without attention heads (Mamba, RWKV) or a single MLP width (per-layer lists).
        heads = _positive_int(tcfg, "num_attention_heads") or max(1, hidden // 64)
        kv_heads = _positive_int(tcfg, "num_key_value_heads") or heads
        if heads % kv_heads:
            kv_heads = heads
        head_dim = _positive_int(tcfg, "head_dim") or hidden // heads
        rope = _full_attention_rope(tcfg)
        layer_types = overrides.pop("layer_types", ["full_attention"] * num_layers)
        sliding_window = overrides.pop("sliding_window", None)
        arch = dict(
            vocab_size=tcfg.vocab_size,
            hidden_size=hidden,
            intermediate_size=_positive_int(tcfg, "intermediate_size") or 4 * hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", None) or 1e-6,
            max_position_embeddings=_positive_int(tcfg, "max_position_embeddings") or 32768,
            rope_parameters=rope,
            layer_types=list(layer_types),
            sliding_window=sliding_window,
            use_sliding_window=sliding_window is not None,
        )
        arch.update(overrides)
        config = Qwen3Config(**arch)
        dflash = DFlashConfig(
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(
                default_target_layer_ids(num_target_layers, num_layers) if target_layer_ids is None else target_layer_ids
            ),
            layer_types=tuple(layer_types),
            num_target_layers=num_target_layers,
            sliding_window=sliding_window,
            draft_vocab_size=None if draft_vocab is None else len(draft_vocab),
        )
        if seed is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = cls(config, dflash)
                model.reset_parameters()
        else:
            model = cls(config, dflash)
            model.reset_parameters()
        ref = next(target.parameters())
        model = model.to(dtype=ref.dtype, device=ref.device).bind_target(target)
        if draft_vocab is not None:
            model.set_draft_vocab(draft_vocab, target)
        return model

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) linear weights, unit norm weights (the Qwen3 initialisation)."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    @classmethod
    def from_pretrained(
        cls,
        path,
        dtype: torch.dtype | None = None,
        device=None,
        *,
        num_target_layers: int | None = None,
        vocab_size: int | None = None,
    ) -> "DFlashDraftModel":
        """Load ``config.json`` + ``*.safetensors`` written in the DFlash authors' format or in transformers' own
        DFlash assistant format (``model_type == "muse_glimmer_assistant"``, see ``hf_format``).

        Reads only JSON and safetensors (never executes code from ``path``). A ``ValueError`` names what is wrong:
        sizes that are not positive integers, ``rms_norm_eps`` or ``rope_theta`` not > 0, then (from the files'
        headers, before any tensor is read) missing, unexpected, mis-shaped or non-floating weights, a file that
        cannot be read (truncated), and last weights with NaN or inf. ``num_target_layers`` / ``vocab_size`` (the
        target's) fill in a config that lacks them (transformers' format records neither); one that disagrees with
        the config raises. The result is unbound: pass it to ``DFlashSpecWrapper`` (or call ``bind_target``).
        """
        path = Path(path)
        cfg_file = path / _CONFIG_NAME
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no {_CONFIG_NAME} in {path}")
        raw = _with_target_facts(json.loads(cfg_file.read_text()), num_target_layers=num_target_layers,
                                 vocab_size=vocab_size)
        names = {}  # our weight name -> the checkpoint's
        speculators = is_speculators_format(raw)
        if is_transformers_format(raw):
            raw, names = authors_config(raw), WEIGHT_NAMES
        elif speculators:
            try:
                raw = authors_config_from_speculators(raw)
            except ValueError as e:
                raise ValueError(f"{cfg_file}: {e}") from None
            raw = _with_target_facts(raw, num_target_layers=num_target_layers, vocab_size=vocab_size)
        arch = raw.get("architectures") or []
        if arch and "DFlashDraftModel" not in arch:
            raise ValueError(f"{cfg_file} describes {arch}, not a DFlashDraftModel")
        try:
            dflash = DFlashConfig.from_dict(raw)
            config = _qwen3_config(raw, dflash)
        except ValueError as e:
            raise ValueError(f"{cfg_file}: {e}") from None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        with torch.device("meta"):
            model = cls(config, dflash)
        expected = {names.get(k, k): v.shape for k, v in model.state_dict().items()}
        if speculators and dflash.draft_vocab_size is not None:  # its names and t2d (speculators_format)
            expected["lm_head.weight"] = expected.pop("draft_head.weight")
            expected["t2d"] = torch.Size([config.vocab_size])
        # Names, shapes and dtypes from the files' headers: nothing is read into memory before they check out.
        header: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for f in files:
            with _safetensors(f) as st:
                for key in st.keys():
                    if key in header:
                        raise ValueError(f"weight {key!r} appears in more than one file of {path}")
                    tensor = st.get_slice(key)
                    header[key] = (f, tuple(tensor.get_shape()), tensor.get_dtype())
        missing = sorted(set(expected) - set(header))
        unexpected = sorted(set(header) - set(expected))
        wrong = sorted(
            f"{k}: checkpoint {header[k][1]}, expected {tuple(expected[k])}"
            for k in set(header) & set(expected)
            if header[k][1] != tuple(expected[k])
        )
        not_float = sorted(
            f"{f.name}: {k!r} is {dt}" for k, (f, _, dt) in header.items()
            if not dt.startswith(("F", "BF")) and not (k == "d2t" and dt.startswith("I"))
            and not (speculators and k == "t2d" and dt == "BOOL")
        )
        problems = []
        if missing:
            problems.append(f"missing weights {missing}")
        if unexpected:
            problems.append(f"unexpected weights {unexpected}")
        if wrong:
            problems.append(f"wrong shapes [{'; '.join(wrong)}]")
        if not_float:
            problems.append(f"weights that are not floating point [{'; '.join(not_float)}]")
        if problems:
            raise ValueError(f"malformed DFlash checkpoint {path}: " + ", ".join(problems))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            with _safetensors(f) as st:
                for key in st.keys():
                    state[key] = st.get_tensor(key)
                    if not bool(torch.isfinite(state[key]).all()):
                        raise ValueError(f"malformed DFlash checkpoint: {f}: weight {key!r} has non-finite values")
        if speculators:
            try:
                state = weights_from_speculators(state, config.vocab_size)
            except ValueError as e:
                raise ValueError(f"malformed DFlash checkpoint {path}: {e}") from None
        model = model.to_empty(device=device or "cpu")
        ours = {v: k for k, v in names.items()}
        model.load_state_dict({ours.get(k, k): v for k, v in state.items()}, strict=True)
        model.rotary_emb = DFlashRotaryEmbedding(config).to(device=device or "cpu")  # buffers were on meta
        if dflash.draft_vocab_size is not None:
            try:
                model.set_draft_vocab(model.d2t.clone())
            except ValueError as e:
                raise ValueError(f"malformed DFlash checkpoint {path}: its d2t map: {e}") from None
        if dtype is not None:
            model = model.to(dtype=dtype)
        return model

    def save_pretrained(self, path, format: str = "dflash") -> None:
        """Write ``config.json`` + ``model.safetensors``: ``format="dflash"`` in the DFlash authors' published
        layout, ``"transformers"`` in transformers' own DFlash assistant layout (``hf_format``), which
        ``AutoModel.from_pretrained`` loads for ``generate(assistant_model=..., speculation_type="dflash")``."""
        from safetensors.torch import save_file

        if self.split_over is not None:
            raise ValueError(f"this drafter is split over {self.split_over[1]} ranks and holds one rank's share of "
                             f"each layer: save the drafter before a tensor-parallel wrapper splits it")
        if format not in ("dflash", "transformers", "speculators"):
            raise ValueError(f"unknown checkpoint format {format!r}: expected 'dflash', 'transformers' or 'speculators'")
        names = {}  # our weight name -> the checkpoint's
        if format == "transformers" and self.draft_vocab_size is not None:
            raise ValueError("transformers' DFlash assistant format has no reduced draft vocabulary: save this "
                             "drafter with format='dflash'")
        if format == "transformers":
            dtype = next(self.parameters()).dtype
            cfg, names = transformers_config(self.config, self.dflash_config, dtype).to_dict(), WEIGHT_NAMES
        elif format == "speculators":
            cfg = speculators_config(self.config, self.dflash_config)
        else:
            cfg = self.config.to_dict()
            for k in ("dflash_config", "target_layer_ids", "mask_token_id"):
                cfg.pop(k, None)
            cfg.update(self.dflash_config.to_dict())
            # transformers' Qwen3Config keeps sliding_window only with use_sliding_window (else it reads None, and
            # so would the authors' class and vLLM): the window must mean the same to every reader
            cfg["use_sliding_window"] = "sliding_attention" in self.dflash_config.layer_types
            cfg["architectures"] = ["DFlashDraftModel"]
            cfg["model_type"] = "qwen3"
            # Also the legacy flat rope_theta that published checkpoints carry.
            rope = cfg.get("rope_parameters") or {}
            if "rope_theta" in rope:
                cfg["rope_theta"] = rope["rope_theta"]
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / _CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        state = {names.get(k, k): v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if format == "speculators":
            state = {k: v.contiguous() for k, v in speculators_weights(state, self.config.vocab_size).items()}
        save_file(state, str(path / _WEIGHTS_NAME), metadata={"format": "pt"})


def _with_target_facts(raw: dict, **facts: int | None) -> dict:
    """``raw`` with the given target facts (``num_target_layers``, ``vocab_size``) filled in where it lacks them."""
    for name, value in facts.items():
        if value is None:
            continue
        if raw.get(name) is not None and raw[name] != value:
            raise ValueError(f"{name}={value} was passed, but the checkpoint's config.json says {raw[name]}")
        raw = {**raw, name: value}
    return raw


def _mask_token(vocab_size: int, mask_token_id: int | None, tokenizer) -> int:
    """``from_target``'s mask token rule (its docstring)."""
    from .config import choose_mask_token, is_ordinary_token

    if mask_token_id is None and tokenizer is not None:
        return choose_mask_token(tokenizer)
    if mask_token_id is None:
        warnings.warn(f"no mask_token_id and no tokenizer: the drafter's mask token is the last id, {vocab_size - 1}, "
                      f"which may be an ordinary text token; pass tokenizer= to choose a special one",
                      stacklevel=3)
        return vocab_size - 1
    if tokenizer is not None and is_ordinary_token(tokenizer, mask_token_id):
        raise ValueError(f"mask_token_id {mask_token_id} ({tokenizer.convert_ids_to_tokens(mask_token_id)!r}) is an "
                         f"ordinary text token of this tokenizer; use a special token "
                         f"(config.choose_mask_token(tokenizer) gives {choose_mask_token(tokenizer)})")
    return mask_token_id


@contextlib.contextmanager
def _safetensors(f: Path):
    """``safe_open(f)``; a file it cannot read (truncated, not safetensors) is a ``ValueError`` naming ``f``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as st:
            yield st
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read {f} (truncated or not a safetensors file?): {e}") from None


def _positive_int(cfg, name: str) -> int | None:
    """``cfg.name`` when it is one positive integer (not None, not a per-layer list), else None."""
    value = getattr(cfg, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _full_attention_rope(tcfg) -> dict:
    """The drafter's rotary embedding: the target's full-attention one where it has one, else RoPE with theta 1e4."""
    default = {"rope_type": "default", "rope_theta": 10000.0}
    rope = getattr(tcfg, "rope_parameters", None) or default
    if isinstance(rope.get("full_attention"), dict):  # per-layer-type (Gemma3)
        rope = rope["full_attention"]
    elif rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type, with no full_attention entry
        rope = default
    rope = dict(rope)
    if rope.get("rope_type", "default") == "default" and not isinstance(rope.get("rope_theta"), (int, float)):
        rope["rope_theta"] = 10000.0
    return rope


def _qwen3_config(raw: dict, dflash: DFlashConfig) -> Qwen3Config:
    fields = {k: v for k, v in raw.items() if k not in ("dflash_config", "architectures", "auto_map", "model_type")}
    fields["layer_types"] = list(dflash.layer_types)
    # the drafter's own window, as transformers' Qwen3Config keeps it (only with use_sliding_window)
    fields["use_sliding_window"] = dflash.sliding_window is not None
    fields["sliding_window"] = dflash.sliding_window
    if fields.get("rope_parameters") is None:
        fields["rope_parameters"] = {
            "rope_type": (raw.get("rope_scaling") or {}).get("rope_type", "default"),
            **(raw.get("rope_scaling") or {}),
            "rope_theta": raw.get("rope_theta", 10000.0),
        }
    fields.pop("rope_scaling", None)
    fields.pop("rope_theta", None)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if name not in fields:
            raise ValueError(f"config.json has no {name}")
    for name in _POSITIVE_SIZES:
        if fields.get(name) is not None and _integer(name, fields[name]) < 1:
            raise ValueError(f"{name} must be a positive integer, got {fields[name]!r}")
    for name, value in (("rms_norm_eps", fields.get("rms_norm_eps", 1e-6)),
                        ("rope_theta", fields["rope_parameters"].get("rope_theta"))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return Qwen3Config(**fields)
