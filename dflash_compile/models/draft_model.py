"""The DFlash block-diffusion drafter: Qwen3 decoder layers fed by the target's context features.

The drafter owns no embedding and no LM head: it borrows the target's (``bind_target``). Its attention is
non-causal over ``[cached context K/V, the query block's own K/V]``; the context K/V of every layer come from
one projection of the context features (``context_kv``) and are written to a cache by the caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from ..primitives.kv_projection import apply_rope, context_kv, rms_norm
from ..primitives.masks import MaskSpec, block_visibility, context_visibility
from .config import DFlashConfig


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

    #: The method the step calls and regional compilation marks (``runtime/regions.py``): the paged form, whose
    #: gather of context K/V from the pool runs inside the layer, where the ``block_attention`` pass finds it.
    region_method = "paged_forward"

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self._sum(self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask))
        return h + self._sum(self.mlp(self.post_attention_layernorm(h)))

    def paged_forward(self, h, cos, sin, pool, read, mask):
        """``forward`` with this layer's context K/V read from its pool: ``pool [2, slots, Hkv, D]`` (K, then V)
        at the slots ``read [B, S]``."""
        kv = pool[:, read]  # [2, B, S, Hkv, D]
        return self.forward(h, cos, sin, kv[0], kv[1], mask)

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


def _split_layer(layer: "DFlashDecoderLayer", rank: int, world: int, group) -> None:
    for name in SPLIT_COLUMNS:
        _rows(layer.get_submodule(name), rank, world)
    for name in SPLIT_ROWS:
        _columns(layer.get_submodule(name), rank, world)
    layer.self_attn.num_heads //= world
    layer.self_attn.num_kv_heads //= world
    layer.tp_group = group


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
            _split_layer(layer, rank, world, group)
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
        ctx_k: torch.Tensor | None = None,
        ctx_v: torch.Tensor | None = None,
        ctx_lens: torch.Tensor | None = None,
        *,
        pool: torch.Tensor | None = None,
        read: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the draft tokens.

        ``block_ids [B, Q]`` (bonus then masks) at ``block_positions [B, Q]``; ``ctx_k``/``ctx_v``
        ``[L, B, S, Hkv, D]`` from ``context_kv``, the context key of position ``p`` at index ``p``, valid for
        ``p < ctx_lens[b]``. Returns ``[B, Q - 1, V]``: the logits for block positions ``1..Q-1``.

        Over a paged cache (the compiled step's form), ``pool`` and ``read`` instead of ``ctx_k``/``ctx_v``:
        ``pool [L, 2, slots, Hkv, D]`` holds every layer's context K and V, and each layer reads its own at the
        slots ``read [B, S]`` (the context key of position ``p`` at column ``p``) inside ``paged_forward``.
        """
        if ctx_lens is None or (pool is None) == (ctx_k is None) or (pool is None) != (read is None) or (
                (ctx_k is None) != (ctx_v is None)):
            raise ValueError("give the drafter ctx_lens and its context as ctx_k and ctx_v, or as pool and read")
        h = self.embed_tokens(block_ids)
        cos, sin = self.rotary_emb(h, block_positions)
        masks = self.attention_mask(ctx_lens, ctx_k.shape[2] if pool is None else read.shape[1], block_positions)
        for i, layer in enumerate(self.layers):
            if pool is None:
                h = layer(h, cos, sin, ctx_k[i], ctx_v[i], masks[i])
            else:
                h = layer.paged_forward(h, cos, sin, pool[i], read, masks[i])
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

    # ------------------------------------------------------------------ construction / IO (``checkpoint.py``)
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
        from .checkpoint import from_target

        return from_target(cls, target, num_layers, block_size, mask_token_id, target_layer_ids, seed, tokenizer,
                           draft_vocab, overrides)

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
        from .checkpoint import load

        return load(cls, path, dtype, device, num_target_layers, vocab_size)

    def save_pretrained(self, path, format: str = "dflash") -> None:
        """Write ``config.json`` + ``model.safetensors``: ``format="dflash"`` in the DFlash authors' published
        layout, ``"transformers"`` in transformers' own DFlash assistant layout (``hf_format``), which
        ``AutoModel.from_pretrained`` loads for ``generate(assistant_model=..., speculation_type="dflash")``."""
        from .checkpoint import save

        save(self, path, format)
