"""Pass ``block_attention``: masked attention over K/V gathered from a paged pool becomes ``dflash.block_attention``.

Matches: ``scaled_dot_product_attention(q, K, V, attn_mask=M)`` (no dropout, not ``is_causal``) where

- ``K`` (and ``V``) is ``pool[read]`` — an ``aten.index`` of a ``[*lead, slots, Hkv, D]`` pool (or of
  ``select`` views of it) with the read slots of a block table, optionally concatenated with the block's own
  keys ``[B, T, Hkv, D]`` on the token dim, transposed to ``[B, Hkv, S(+T), D]``, optionally repeated to the
  query heads (HF ``repeat_kv``);
- the read slots are ``where(key_pos < ctx_lens, _paged_slots(block_table, key_pos, page_size), <negative>)``
  (``kv_cache.read_slots``);
- ``M`` is ``kv_cache.context_visibility(q_positions, ctx_lens, key_pos, causal, window)[:, None]`` — the
  target's verify mask — or, with block keys, ``cat([that, block part], -1)[:, None]`` where the block part
  is all-visible or windowed on ``q_positions`` (``DFlashDraftModel.attention_mask``).

The search pattern, as plain torch (the target's form; the drafter's adds the block keys)::

    read = torch.where(key_pos[None] < ctx_lens[:, None], _paged_slots(block_table, key_pos, page), -2)
    k, v = k_pool[read].transpose(1, 2), v_pool[read].transpose(1, 2)
    mask = ((key_pos < ctx_lens[:, None, None]) & (key_pos <= q_positions[..., None])
            & (q_positions[..., None] - key_pos < window))[:, None]
    out = F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask, scale=scale)

Rewrite to: ``dflash.block_attention(q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block,
page_size, causal, window, scale)`` — the kernels read K/V straight from the pool through the block table; the
dense gathers, the mask and the repeat become dead and are removed. Attention whose mask or K/V do not have
this form (e.g. an additive float mask) is left alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from ..lowerings import ops  # noqa: F401  (registers torch.ops.dflash.*)
from ..primitives.masks import MaskSpec, context_visibility
from ._common import DFlashPass, Region, bound_args, same_shape, size_arg, val

aten = torch.ops.aten

_SDPA = aten.scaled_dot_product_attention.default
_AND = (aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default)
_TRANSPARENT = (aten.clone.default, aten.contiguous.default, aten.alias.default)


def _is(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _strip(node, *targets):
    while _is(node, *targets):
        node = node.args[0]
    return node


# ------------------------------------------------------------------------------------------------ K/V sources
@dataclass
class _Source:
    pool: Node  # the pool tensor the gather indexes
    selects: list[tuple[int, int]]  # (dim, index) applied to the gather's lead dims, innermost first
    read: Node  # [B, S] slots
    block: Node | None  # [B, T, Hkv, D] block keys/values appended after the context


def _kv_source(node: Node) -> _Source | None:
    """Walk ``K``/``V`` back to the pool gather: [repeat_kv] <- transpose(1, 2) <- [cat] <- select* <- index."""
    node = _strip(node, *_TRANSPARENT)
    # HF repeat_kv: x[:, :, None].expand(B, Hkv, n_rep, S, D).reshape(B, Hkv * n_rep, S, D)
    if _is(node, aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        inner = _strip(node.args[0], *_TRANSPARENT)
        if _is(inner, aten.expand.default):
            node = _strip(inner.args[0], aten.unsqueeze.default, aten.slice.Tensor)
    if not (_is(node, aten.transpose.int) and sorted(node.args[1:]) == [1, 2]):
        return None
    node = _strip(node.args[0], *_TRANSPARENT)
    block = None
    if _is(node, aten.cat.default):
        parts, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
        if len(parts) != 2 or dim not in (1, -3):
            return None
        node, block = parts
    selects = []
    while _is(node, aten.select.int):
        selects.append((node.args[1], node.args[2]))
        node = node.args[0]
    if not _is(node, aten.index.Tensor):
        return None
    pool, indices = node.args
    if len(indices) != len(selects) + 1 or any(i is not None for i in indices[:-1]):
        return None
    if any(dim != 0 for dim, _ in selects) and not all(dim < len(selects) for dim, _ in selects):
        return None
    return _Source(pool, selects[::-1], indices[-1], block)


@dataclass
class _Read:
    block_table: Node
    ctx_lens: Node
    page_size: int


def _read_slots(read: Node) -> _Read | None:
    """``where(key_pos[None] < ctx_lens[:, None], table.gather(1, pos // page) * page + pos % page, neg)``."""
    if not (_is(read, aten.where.ScalarOther) and isinstance(read.args[2], int) and read.args[2] < 0):
        return None
    cond, slots = read.args[0], read.args[1]
    if not _is(cond, aten.lt.Tensor):
        return None
    lens = cond.args[1]
    if not (_is(lens, aten.unsqueeze.default) and lens.args[1] == 1):
        return None
    lens = _squeezed(lens)
    if not (_is(slots, aten.add.Tensor) and _is(slots.args[0], aten.mul.Tensor)):
        return None
    gather, page = slots.args[0].args
    if not (_is(gather, aten.gather.default) and isinstance(page, int) and page > 0):
        return None
    return _Read(gather.args[0], lens, page)


# ---------------------------------------------------------------------------------------------------- the mask
@dataclass
class _Visibility:
    ctx_lens: Node | None = None
    q_positions: Node | None = None
    causal: bool = False
    window: int = 0
    chunk: int = 0


def _conjuncts(node: Node) -> list[Node]:
    node = _strip(node, aten.expand.default)
    if _is(node, *_AND):
        return _conjuncts(node.args[0]) + _conjuncts(node.args[1])
    return [node]


def _is_full_slice(node) -> bool:
    if not _is(node, aten.slice.Tensor):
        return False
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (0, None) and (end is None or end >= 2**62) and step == 1


def _squeezed(node):
    """``x[:, None, ...]``-style views of ``x`` (unsqueeze, expand, full slices) -> ``x``."""
    while _is(node, aten.unsqueeze.default, aten.expand.default) or _is_full_slice(node):
        node = node.args[0]
    return node


def _is_key_pos(node) -> bool:
    return _is(_squeezed(node), aten.arange.default, aten.arange.start)


_WINDOW, _CHUNK = 1_000_003, 1_000_033  # stand-ins for the literals in the traced conditions


@functools.cache
def _conditions() -> dict[str, torch.fx.Graph]:
    """Each condition of the visibility rule traced alone, to pre-dispatch ATen as the backends retrace a step:
    ``within`` (``primitives.masks.context_visibility``'s ``key < ctx_lens``) and ``MaskSpec.visible``'s causal,
    window and chunk terms. The pass recognises a mask by these, not by a hand-written copy of the rule."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.zeros(1, 1, 1, dtype=torch.long)
    row, lens, keys = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    within = functools.partial(context_visibility, spec=MaskSpec(causal=False))  # (q_positions, ctx_lens, key_pos)
    conditions = {"within": make_fx(within, pre_dispatch=True)(row, lens, keys).graph}
    for name, spec in (("causal", MaskSpec(causal=True)), ("window", MaskSpec(causal=False, window=_WINDOW)),
                       ("chunk", MaskSpec(causal=False, chunk=_CHUNK))):
        conditions[name] = make_fx(functools.partial(_one_condition, spec), pre_dispatch=True)(x, x.clone()).graph
    return conditions


def _one_condition(spec: MaskSpec, q, k):
    return spec.visible(q, k)


def _match(pattern: torch.fx.Graph, node: Node) -> dict | None:
    """Bind ``pattern``'s output to ``node``: ``{placeholder index: node, stand-in literal: value}``, or None."""
    placeholders = {n: i for i, n in enumerate(pattern.find_nodes(op="placeholder"))}
    bound: dict = {}

    def walk(t, g) -> bool:
        if t.op == "placeholder":
            prev = bound.setdefault(placeholders[t], g)
            return _squeezed(prev) is _squeezed(g)
        if not (_is(g, t.target) and len(g.args) == len(t.args)):
            return False
        for ta, ga in zip(t.args, g.args):
            if isinstance(ta, Node):
                if not walk(ta, ga):
                    return False
            elif ta in (_WINDOW, _CHUNK):
                if not (isinstance(ga, int) and ga > 0):
                    return False
                bound[ta] = ga
            elif ta != ga:
                return False
        return True

    out = pattern.output_node().args[0]
    return bound if walk(out, node) else None


def _visibility(node: Node, block: bool = False) -> _Visibility | None:
    """Parse a conjunction of the rule's conditions: over the context (``key < ctx_lens`` and the spec's terms) or,
    with ``block``, over the block's own keys (all-visible ``ones`` and the spec's terms, the keys at the queries'
    own positions)."""
    vis = _Visibility()
    for c in _conjuncts(node):
        if block and _is(c, aten.ones.default, aten.new_ones.default, aten.full.default):
            continue
        for name, pattern in _conditions().items():
            bound = _match(pattern, c)
            if bound is not None:
                break
        else:
            return None
        if name == "within":
            if block or not _is_key_pos(bound[2]):
                return None
            vis.ctx_lens = _squeezed(bound[1])
            continue
        q, k = _squeezed(bound[0]), _squeezed(bound[1])
        if (k is not q) if block else not _is_key_pos(k):
            return None
        if vis.q_positions is not None and vis.q_positions is not q:
            return None
        vis.q_positions = q
        vis.causal |= name == "causal"
        vis.window = bound.get(_WINDOW, vis.window)
        vis.chunk = bound.get(_CHUNK, vis.chunk)
    return vis if block or vis.ctx_lens is not None else None


def _mask(mask: Node, with_block: bool) -> _Visibility | None:
    if not (_is(mask, aten.unsqueeze.default) and mask.args[1] == 1):
        return None
    m = mask.args[0]
    if not with_block:
        return _visibility(m)
    if not (_is(m, aten.cat.default) and len(m.args[0]) == 2 and m.args[1] in (-1, 2)):
        return None
    vis, own = _visibility(m.args[0][0]), _visibility(m.args[0][1], block=True)
    if vis is None or own is None or (own.q_positions is not None and own.q_positions is not vis.q_positions):
        return None
    if (own.causal, own.window, own.chunk) != (vis.causal, vis.window, vis.chunk):
        return None  # the block's keys under another rule than the context's: not this op
    return vis


# ---------------------------------------------------------------------------------------------------- the pass
class BlockAttentionPass(DFlashPass):
    name = "block_attention"

    def apply(self, graph: torch.fx.Graph, region: Region | None = None) -> int:
        count = 0
        for node in list(graph.nodes):
            if _is(node, _SDPA) and self._rewrite(graph, node, region):
                count += 1
        return count

    def _rewrite(self, graph, node: Node, region: Region | None) -> bool:
        a = bound_args(node)
        q, mask = a["query"], a["attn_mask"]
        if a["dropout_p"] != 0.0 or a["is_causal"] or not isinstance(mask, Node):
            return False
        k_src, v_src = _kv_source(a["key"]), _kv_source(a["value"])
        if k_src is None or v_src is None or k_src.read is not v_src.read:
            return False
        if (k_src.block is None) != (v_src.block is None):
            return False
        # Inside a region the read slots and the mask may be inputs of the layer, made once by the step around it
        # (the target's mask): the rule is read where they were made, in the graph that calls the region.
        read_slots, mask = _made(k_src.read, region), _made(mask, region)
        read = _read_slots(read_slots)
        vis = _mask(mask, with_block=k_src.block is not None)
        if read is None or vis is None or vis.ctx_lens is not read.ctx_lens:
            return False
        if not _extra_check(q, mask, k_src, read, read_slots):
            return False
        D = val(q).shape[-1]
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(D)
        here = region.inner if region is not None else (lambda n: n)  # an outer node as this graph reads it
        block_table, ctx_lens = here(read.block_table), here(read.ctx_lens)
        q_pos = None if vis.q_positions is None else here(vis.q_positions)
        with graph.inserting_before(node):
            k_pool, v_pool = self._pool_view(graph, k_src), self._pool_view(graph, v_src)
            if q_pos is None:  # neither causal nor windowed: positions are not needed, any [B, T] will do
                q_pos = graph.call_function(aten.new_zeros.default,
                                            (ctx_lens, [size_arg(graph, q, 0), size_arg(graph, q, 2)]))
            k_blk = v_blk = None
            if k_src.block is not None:
                k_blk = graph.call_function(aten.transpose.int, (k_src.block, 1, 2))
                v_blk = graph.call_function(aten.transpose.int, (v_src.block, 1, 2))
            out = graph.call_function(
                torch.ops.dflash.block_attention.default,
                (q, k_pool, v_pool, block_table, ctx_lens, q_pos, k_blk, v_blk,
                 read.page_size, vis.causal, vis.window, float(scale), vis.chunk),
            )
        out.meta["val"] = val(node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        return True

    @staticmethod
    def _pool_view(graph, src: _Source) -> Node:
        node = src.pool
        for dim, index in src.selects:
            node = graph.call_function(aten.select.int, (node, dim, index))
        return node


def _made(node: Node, region: Region | None) -> Node:
    """``node``, or where it was made if it is an input of ``region`` that every call of the region passes alike."""
    outer = region.outer(node) if region is not None else None
    return node if outer is None else outer


def _extra_check(q: Node, mask: Node, src: _Source, read: _Read, read_slots: Node) -> bool:
    """Shapes and dtypes from ``meta["val"]``: a boolean mask, GQA-compatible heads, a 3-D pool view."""
    qv, mv, pv, rv = val(q), val(mask), val(src.pool), val(read_slots)
    if any(t is None for t in (qv, mv, pv, rv)):
        return False
    B, Hq, T, D = qv.shape
    Hkv = pv.shape[-2]
    return (
        mv.dtype == torch.bool
        and pv.dim() == len(src.selects) + 3
        and same_shape(pv.shape[-1:], (D,))
        and Hq % Hkv == 0
        and same_shape(rv.shape, (B, val(read.block_table).shape[1] * read.page_size))
        and pv.dtype == qv.dtype
    )
