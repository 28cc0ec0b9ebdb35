"""Each pass on a small pre-dispatch graph: the graph before and after, the counter, and equal values."""

import functools
from collections import Counter

import expecttest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

from dflash_compile import DFlashDraftModel
from dflash_compile.primitives.masks import MaskSpec, context_visibility
from dflash_compile.primitives.slots import read_slots, write_slots
from dflash_compile.passes import build_passes, passes_uuid
from dflash_compile.passes.block_attention import BlockAttentionPass
from dflash_compile.passes.fused_kv import FusedKVProjPass
from dflash_compile.passes.paged_scatter import PagedKVWritePass
from tiny_models import tiny_target


def _trace(fn, *args):
    return make_fx(fn, pre_dispatch=True, tracing_mode="fake")(*args)


def _with_state(module, fn):
    """``fn`` with ``module``'s parameters and buffers as leading inputs (as dynamo lifts them)."""
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    state = [t.detach() for _, t in module.named_parameters()] + [b for _, b in module.named_buffers()]

    def call(*args):
        with torch.nn.utils.stateless._reparametrize_module(module, dict(zip(names, args[: len(names)]))):
            return fn(*args[len(names):])

    return call, state


def _run_pass(pass_, gm):
    counters.clear()
    n = pass_(gm.graph)
    gm.recompile()
    return n, dict(counters["dflash"])


def _rewrite(pass_, gm):
    """Run ``pass_`` on ``gm``: ``(replacements, counters, the region it removed, the region it put in)``, each
    region the nodes (in graph order) that left the graph or changed, and the nodes that came in or changed."""
    before = {n.name: n.format_node() for n in gm.graph.nodes}
    n, count = _run_pass(pass_, gm)
    after = {n.name: n.format_node() for n in gm.graph.nodes}
    removed = "\n".join(v for k, v in before.items() if after.get(k) != v)
    added = "\n".join(v for k, v in after.items() if before.get(k) != v)
    return n, count, removed, added


class TestPasses(expecttest.TestCase):
    def test_fused_kv_proj(self):
        target = tiny_target("qwen3", hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        draft = DFlashDraftModel.from_target(target, num_layers=2, target_layer_ids=[1, 3], seed=0)
        ctx, pos = torch.randn(2, 3, 16), torch.arange(3).expand(2, 3) + 5

        context_kv, state = _with_state(draft, draft.context_kv)
        gm = _trace(context_kv, *state, ctx, pos)
        n, count, removed, added = _rewrite(FusedKVProjPass(), gm)
        self.assertEqual((n, count), (1, {"fused_kv_proj": 1}))
        self.assertExpectedInline(removed, """\
%linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default](args = (%arg26_1, %cat_1), kwargs = {})
%view : [num_users=1] = call_function[target=torch.ops.aten.view.default](args = (%linear, [2, 3, 2, 2, -1, 8]), kwargs = {})
%permute : [num_users=2] = call_function[target=torch.ops.aten.permute.default](args = (%view, [2, 3, 0, 1, 4, 5]), kwargs = {})
%select : [num_users=2] = call_function[target=torch.ops.aten.select.int](args = (%permute, 0, 0), kwargs = {})
%view_1 : [num_users=1] = call_function[target=torch.ops.aten.view.default](args = (%stack, [2, 1, 1, 1, 8]), kwargs = {})
%pow_1 : [num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%select, 2), kwargs = {})
%mean : [num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_1, [-1], True), kwargs = {})
%add : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean, 1e-06), kwargs = {})
%rsqrt : [num_users=1] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add,), kwargs = {})
%mul_3 : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%select, %rsqrt), kwargs = {})
%to_3 : [num_users=1] = call_function[target=torch.ops.aten.to.dtype](args = (%mul_3, torch.float32), kwargs = {})
%mul_4 : [num_users=3] = call_function[target=torch.ops.aten.mul.Tensor](args = (%view_1, %to_3), kwargs = {})
%unsqueeze_1 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%to_1, -2), kwargs = {})
%unsqueeze_2 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%to_2, -2), kwargs = {})
%slice_1 : [num_users=1] = call_function[target=torch.ops.aten.slice.Tensor](args = (%mul_4, 4, 4, 9223372036854775807), kwargs = {})
%neg : [num_users=1] = call_function[target=torch.ops.aten.neg.default](args = (%slice_1,), kwargs = {})
%slice_2 : [num_users=1] = call_function[target=torch.ops.aten.slice.Tensor](args = (%mul_4, 4, 0, 4), kwargs = {})
%cat_2 : [num_users=1] = call_function[target=torch.ops.aten.cat.default](args = ([%neg, %slice_2], -1), kwargs = {})
%mul_5 : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_4, %unsqueeze_1), kwargs = {})
%mul_6 : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%cat_2, %unsqueeze_2), kwargs = {})
%add_1 : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul_5, %mul_6), kwargs = {})
%select_1 : [num_users=1] = call_function[target=torch.ops.aten.select.int](args = (%permute, 0, 1), kwargs = {})
return (add_1, select_1)""")
        self.assertExpectedInline(added, """\
%reshape_default : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%arg26_1, [6, 16]), kwargs = {})
%reshape_default_1 : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%to_1, [6, 8]), kwargs = {})
%reshape_default_2 : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%to_2, [6, 8]), kwargs = {})
%fused_kv_proj_default : [num_users=2] = call_function[target=torch.ops.dflash.fused_kv_proj.default](args = (%reshape_default, %cat_1, %stack, %reshape_default_1, %reshape_default_2, 1e-06), kwargs = {})
%getitem : [num_users=1] = call_function[target=operator.getitem](args = (%fused_kv_proj_default, 0), kwargs = {})
%view_default : [num_users=1] = call_function[target=torch.ops.aten.view.default](args = (%getitem, [2, 2, 3, -1, 8]), kwargs = {})
%getitem_2 : [num_users=1] = call_function[target=operator.getitem](args = (%fused_kv_proj_default, 1), kwargs = {})
%view_default_2 : [num_users=1] = call_function[target=torch.ops.aten.view.default](args = (%getitem_2, [2, 2, 3, -1, 8]), kwargs = {})
return (view_default, view_default_2)""")
        # V comes from the op too: the stacked projection runs once, inside it
        self.assertFalse(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default))
        for a, b in zip(gm(*state, ctx, pos), draft.context_kv(ctx, pos)):
            torch.testing.assert_close(a, b)

    def test_paged_kv_write(self):
        def write(pool, table, positions, valid, values):
            slots = write_slots(table, positions, valid, 4).flatten()
            pool[:, :, slots] = values
            return pool[:, :, slots[:2]]

        pool = torch.zeros(2, 2, 4 * 4 + 2, 1, 8)
        args = (torch.tensor([[2, 0], [3, 1]]), torch.tensor([[1, 2, 3], [5, 6, 7]]),
                torch.tensor([[True, True, False], [True, True, True]]), torch.randn(2, 2, 6, 1, 8))
        gm = _trace(write, pool.clone(), *args)
        n, count, removed, added = _rewrite(PagedKVWritePass(), gm)
        self.assertEqual((n, count), (1, {"paged_kv_write": 1}))
        self.assertExpectedInline(removed, """\
%pool_1 : [num_users=1] = placeholder[target=pool_1]
%index_put_ : [num_users=1] = call_function[target=torch.ops.aten.index_put_.default](args = (%pool_1, [None, None, %flatten], %values_1), kwargs = {})
%index : [num_users=1] = call_function[target=torch.ops.aten.index.Tensor](args = (%index_put_, [None, None, %slice_1]), kwargs = {})""")
        self.assertExpectedInline(added, """\
%pool_1 : [num_users=2] = placeholder[target=pool_1]
%expand_default : [num_users=1] = call_function[target=torch.ops.aten.expand.default](args = (%values_1, [2, 2, 6, 1, 8]), kwargs = {})
%paged_kv_write_default : [num_users=0] = call_function[target=torch.ops.dflash.paged_kv_write.default](args = (%pool_1, %flatten, %expand_default), kwargs = {})
%index : [num_users=1] = call_function[target=torch.ops.aten.index.Tensor](args = (%pool_1, [None, None, %slice_1]), kwargs = {})""")
        p1, p2 = pool.clone(), pool.clone()
        torch.testing.assert_close(gm(p1, *args), write(p2, *args))
        torch.testing.assert_close(p1, p2)

    def test_block_attention_target_form(self):
        # The target's verify: gather through the block table, causal + window mask, GQA repeat (HF repeat_kv).
        def verify(q, pool, table, kv_lens, positions):
            read, key_pos = read_slots(table, kv_lens, 4)
            k, v = pool[0][read].transpose(1, 2), pool[1][read].transpose(1, 2)
            k = k[:, :, None].expand(2, 1, 2, 8, 8).reshape(2, 2, 8, 8)
            v = v[:, :, None].expand(2, 1, 2, 8, 8).reshape(2, 2, 8, 8)
            mask = context_visibility(positions, kv_lens, key_pos, MaskSpec(window=3))[:, None]
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)

        args = (torch.randn(2, 2, 2, 8), torch.randn(2, 4 * 4 + 2, 1, 8), torch.tensor([[2, 0], [3, 1]]),
                torch.tensor([6, 3]), torch.tensor([[4, 5], [1, 2]]))
        gm = _trace(verify, *args)
        n, count, removed, added = _rewrite(BlockAttentionPass(), gm)
        self.assertEqual((n, count), (1, {"block_attention": 1}))
        self.assertExpectedInline(removed, """\
%kv_lens_1 : [num_users=2] = placeholder[target=kv_lens_1]
%arange : [num_users=3] = call_function[target=torch.ops.aten.arange.default](args = (8,), kwargs = {device: cpu, pin_memory: False})
%expand : [num_users=2] = call_function[target=torch.ops.aten.expand.default](args = (%arange, [2, 8]), kwargs = {})
%floor_divide : [num_users=1] = call_function[target=torch.ops.aten.floor_divide.default](args = (%expand, 4), kwargs = {})
%gather : [num_users=1] = call_function[target=torch.ops.aten.gather.default](args = (%table_1, 1, %floor_divide), kwargs = {})
%mul : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%gather, 4), kwargs = {})
%remainder : [num_users=1] = call_function[target=torch.ops.aten.remainder.Scalar](args = (%expand, 4), kwargs = {})
%add : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul, %remainder), kwargs = {})
%unsqueeze : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%arange, 0), kwargs = {})
%unsqueeze_1 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%kv_lens_1, 1), kwargs = {})
%lt : [num_users=1] = call_function[target=torch.ops.aten.lt.Tensor](args = (%unsqueeze, %unsqueeze_1), kwargs = {})
%where : [num_users=2] = call_function[target=torch.ops.aten.where.ScalarOther](args = (%lt, %add, -2), kwargs = {})
%index : [num_users=1] = call_function[target=torch.ops.aten.index.Tensor](args = (%select, [%where]), kwargs = {})
%transpose : [num_users=1] = call_function[target=torch.ops.aten.transpose.int](args = (%index, 1, 2), kwargs = {})
%index_1 : [num_users=1] = call_function[target=torch.ops.aten.index.Tensor](args = (%select_1, [%where]), kwargs = {})
%transpose_1 : [num_users=1] = call_function[target=torch.ops.aten.transpose.int](args = (%index_1, 1, 2), kwargs = {})
%unsqueeze_2 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%transpose, 2), kwargs = {})
%expand_1 : [num_users=1] = call_function[target=torch.ops.aten.expand.default](args = (%unsqueeze_2, [2, 1, 2, 8, 8]), kwargs = {})
%reshape : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%expand_1, [2, 2, 8, 8]), kwargs = {})
%unsqueeze_3 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%transpose_1, 2), kwargs = {})
%expand_2 : [num_users=1] = call_function[target=torch.ops.aten.expand.default](args = (%unsqueeze_3, [2, 1, 2, 8, 8]), kwargs = {})
%reshape_1 : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%expand_2, [2, 2, 8, 8]), kwargs = {})
%unsqueeze_4 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%arange, 0), kwargs = {})
%unsqueeze_5 : [num_users=3] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%unsqueeze_4, 1), kwargs = {})
%unsqueeze_6 : [num_users=2] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%positions_1, 2), kwargs = {})
%unsqueeze_7 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%kv_lens_1, 1), kwargs = {})
%unsqueeze_8 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%unsqueeze_7, 2), kwargs = {})
%lt_1 : [num_users=1] = call_function[target=torch.ops.aten.lt.Tensor](args = (%unsqueeze_5, %unsqueeze_8), kwargs = {})
%le : [num_users=1] = call_function[target=torch.ops.aten.le.Tensor](args = (%unsqueeze_5, %unsqueeze_6), kwargs = {})
%and_1 : [num_users=1] = call_function[target=torch.ops.aten.__and__.Tensor](args = (%lt_1, %le), kwargs = {})
%sub : [num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%unsqueeze_6, %unsqueeze_5), kwargs = {})
%lt_2 : [num_users=1] = call_function[target=torch.ops.aten.lt.Scalar](args = (%sub, 3), kwargs = {})
%and_2 : [num_users=1] = call_function[target=torch.ops.aten.__and__.Tensor](args = (%and_1, %lt_2), kwargs = {})
%unsqueeze_9 : [num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%and_2, 1), kwargs = {})
%scaled_dot_product_attention : [num_users=1] = call_function[target=torch.ops.aten.scaled_dot_product_attention.default](args = (%q_1, %reshape, %reshape_1, %unsqueeze_9), kwargs = {scale: 0.5})
return scaled_dot_product_attention""")
        self.assertExpectedInline(added, """\
%kv_lens_1 : [num_users=1] = placeholder[target=kv_lens_1]
%block_attention_default : [num_users=1] = call_function[target=torch.ops.dflash.block_attention.default](args = (%q_1, %select, %select_1, %table_1, %kv_lens_1, %positions_1, None, None, 4, True, 3, 0.5, 0), kwargs = {})
return block_attention_default""")
        torch.testing.assert_close(gm(*args), verify(*args))

    def test_block_attention_reads_every_visibility_rule(self):
        # The pass recognises the conditions of MaskSpec by tracing them: causal, window and chunk, alone or together,
        # and hands the op the same rule (values equal the SDPA's).
        args = (torch.randn(2, 2, 3, 8), torch.randn(2, 4 * 6 + 2, 1, 8), torch.tensor([[2, 0, 5, 4, 1, 3]] * 2),
                torch.tensor([19, 11]), torch.tensor([[17, 18, 19], [9, 10, 11]]))
        for spec in (MaskSpec(), MaskSpec(chunk=8), MaskSpec(window=5, chunk=8), MaskSpec(causal=False, chunk=4),
                     MaskSpec(causal=False)):
            def verify(q, pool, table, kv_lens, positions):
                read, key_pos = read_slots(table, kv_lens, 4)
                k, v = pool[0][read].transpose(1, 2), pool[1][read].transpose(1, 2)
                k = k[:, :, None].expand(2, 1, 2, 24, 8).reshape(2, 2, 24, 8)
                v = v[:, :, None].expand(2, 1, 2, 24, 8).reshape(2, 2, 24, 8)
                mask = context_visibility(positions, kv_lens, key_pos, spec)[:, None]
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)

            gm = _trace(verify, *args)
            n, count = _run_pass(BlockAttentionPass(), gm)
            self.assertEqual((n, count), (1, {"block_attention": 1}), spec)
            op = next(x for x in gm.graph.nodes if x.target == torch.ops.dflash.block_attention.default)
            self.assertEqual(op.args[9:], (spec.causal, spec.window or 0, 0.5, spec.chunk or 0))
            torch.testing.assert_close(gm(*args), verify(*args))

    def test_block_attention_with_a_symbolic_batch(self):
        # One graph for every batch bucket from 2 rows: the positions the op takes where no rule reads them are made
        # in the graph's own symbolic sizes (a bare SymInt in a node's arguments names a symbol the code lacks).
        def verify(q, pool, table, kv_lens, positions):
            B, T = q.shape[0], q.shape[2]
            read, key_pos = read_slots(table, kv_lens, 4)
            k, v = pool[0][read].transpose(1, 2), pool[1][read].transpose(1, 2)
            k = k[:, :, None].expand(B, 1, 2, 24, 8).reshape(B, 2, 24, 8)
            v = v[:, :, None].expand(B, 1, 2, 24, 8).reshape(B, 2, 24, 8)
            mask = context_visibility(positions, kv_lens, key_pos, MaskSpec(causal=False))[:, None]
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)

        def inputs(B):
            g = torch.Generator().manual_seed(B)
            table = torch.stack([torch.randperm(6, generator=g) for _ in range(B)])
            lens = torch.randint(1, 20, (B,), generator=g)
            return (torch.randn(B, 2, 3, 8, generator=g), torch.randn(2, 4 * 6 + 2, 1, 8, generator=g), table, lens,
                    lens[:, None] + torch.arange(3))

        from dflash_compile.backends import dflash_passes

        graphs = []

        def backend(gm, example_inputs):  # dynamo's graph through the passes, as the dflash backend runs them
            counters.clear()
            graphs.append(dflash_passes(gm, example_inputs))
            graphs.append(dict(counters["dflash"]))
            return graphs[0].forward

        compiled = torch.compile(verify, backend=backend, fullgraph=True, dynamic=False)
        for B in (2, 4, 7):
            args = inputs(B)
            for i in (0, 2, 3, 4):  # every per-row input; the pool is not one
                torch._dynamo.mark_dynamic(args[i], 0, min=2, max=16)
            torch.testing.assert_close(compiled(*args), verify(*args))
        self.assertEqual(len(graphs), 2)  # one graph for every batch
        self.assertEqual(graphs[1], {"block_attention": 1})
        made = [n.format_node() for n in graphs[0].graph.nodes if n.target in (
            torch.ops.aten.sym_size.int, torch.ops.aten.new_zeros.default, torch.ops.dflash.block_attention.default)]
        self.assertExpectedInline("\n".join(made), """\
%sym_size_int_1 : [num_users=1] = call_function[target=torch.ops.aten.sym_size.int](args = (%arg1_1, 0), kwargs = {})
%new_zeros_default : [num_users=1] = call_function[target=torch.ops.aten.new_zeros.default](args = (%arg4_1, [%sym_size_int_1, 3]), kwargs = {})
%block_attention_default : [num_users=1] = call_function[target=torch.ops.dflash.block_attention.default](args = (%arg1_1, %select, %select_1, %arg2_1, %arg4_1, %new_zeros_default, None, None, 4, False, 0, 0.5, 0), kwargs = {})""")

    def test_block_attention_draft_form(self):
        target = tiny_target("qwen3", hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=3, target_layer_ids=[1, 3], seed=0)
        attn = draft.layers[0].self_attn
        h, pos = torch.randn(2, 3, 16), torch.tensor([[5, 6, 7], [2, 3, 4]])
        pool, table, lens = torch.randn(1, 2, 4 * 2 + 2, 1, 8), torch.tensor([[1, 0], [0, 1]]), torch.tensor([5, 2])

        def draft_attention(h, pos, pool, table, lens):
            read, _ = read_slots(table, lens, 4)
            kv = pool[:, :, read]
            cos, sin = draft.rotary_emb(h, pos)
            mask = draft.attention_mask(lens, read.shape[1], pos)[0]
            return attn(h, cos, sin, kv[:, 0][0], kv[:, 1][0], mask)

        traced, state = _with_state(draft, draft_attention)
        args = (h, pos, pool, table, lens)
        gm = _trace(traced, *state, *args)
        n, count = _run_pass(BlockAttentionPass(), gm)
        self.assertEqual((n, count), (1, {"block_attention": 1}))
        self.assertNotIn("scaled_dot_product_attention", str(gm.graph))
        torch.testing.assert_close(gm(*state, *args), draft_attention(*args))

    def test_block_attention_across_a_region_boundary(self):
        # A decoder layer compiled as a nested region reads the mask and the read slots the step made once around
        # the layers: the pass follows those inputs to where they were made, reads the table, lengths and positions
        # into the region as new inputs, and drops the inputs nothing reads any more (the graph around stops making
        # the mask and the slots). Layers of one subgraph called with different masks (Gemma's sliding and full
        # layers) get a copy of it per mask, each rewritten under its own rule. A float mask (no visibility rule;
        # dynamo inlines those calls) keeps its SDPA.
        from dflash_compile.backends import dflash_passes
        from dflash_compile.passes import graph_modules

        @torch.compiler.nested_compile_region
        def layer(q, pool, read, mask):
            k, v = pool[0][read].transpose(1, 2), pool[1][read].transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5) + q

        def step(q, pools, table, kv_lens, positions, windows):
            read, key_pos = read_slots(table, kv_lens, 4)
            masks = []
            for w in windows:
                m = context_visibility(positions, kv_lens, key_pos, MaskSpec(window=w if w != "float" else None))
                masks.append(m[:, None] if w != "float" else torch.zeros(m[:, None].shape).masked_fill(~m[:, None],
                                                                                                     -1e9))
            for i, pool in enumerate(pools):
                q = layer(q, pool, read, masks[i % len(masks)])
            return q

        args = (torch.randn(2, 1, 2, 8), [torch.randn(2, 4 * 4 + 2, 1, 8) for _ in range(3)],
                torch.tensor([[2, 0], [3, 1]]), torch.tensor([6, 3]), torch.tensor([[4, 5], [1, 2]]))
        for windows, parts, splits, rewritten in (((3,), 1, 0, 1), ((3, None), 2, 1, 2), ((3, "float"), 1, 0, 1)):
            passed = []

            def capture(gm, example_inputs):
                passed.append(dflash_passes(gm, example_inputs))
                return passed[-1]

            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(functools.partial(step, windows=windows), backend=capture, fullgraph=True)
            torch.testing.assert_close(compiled(*args), step(*args, windows))
            top, *subs = graph_modules(passed[0])
            self.assertEqual(len(subs), parts, windows)
            self.assertEqual(counters["dflash"]["region_splits"], splits, windows)
            self.assertEqual(counters["dflash"]["block_attention"], rewritten, windows)
            self.assertFalse(any("scaled_dot_product_attention" in sub.code for sub in subs))
            self.assertEqual("scaled_dot_product_attention" in top.code, windows[-1] == "float")
            calls = top.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
            self.assertEqual(len({call.args[1] for call in calls}), parts)  # an identifier per copy
            if windows != (3,):
                continue
            self.assertExpectedInline(subs[0].code.strip(), """\
def forward(self, arg0_1, arg2_1, outer_arg0_1, outer_arg1_1, outer_arg2_1):
    select = torch.ops.aten.select.int(arg0_1, 0, 0)
    select_1 = torch.ops.aten.select.int(arg0_1, 0, 1);  arg0_1 = None
    block_attention_default = torch.ops.dflash.block_attention.default(arg2_1, select, select_1, outer_arg0_1, outer_arg1_1, outer_arg2_1, None, None, 4, True, 3, 0.5, 0);  select = select_1 = outer_arg0_1 = outer_arg1_1 = outer_arg2_1 = None
    add = torch.ops.aten.add.Tensor(block_attention_default, arg2_1);  block_attention_default = arg2_1 = None
    return (add,)""")
            # around the region: no mask, no read slots, just the three calls (and their outputs) on the step's inputs
            self.assertEqual(Counter(str(n.target) for n in top.graph.nodes if n.op == "call_function"),
                             {"invoke_subgraph": 3, "<built-in function getitem>": 3})

    def test_float_mask_is_left_alone(self):
        def eager_mask(q, pool, table, kv_lens, positions):
            read, key_pos = read_slots(table, kv_lens, 4)
            k, v = pool[0][read].transpose(1, 2), pool[1][read].transpose(1, 2)
            mask = context_visibility(positions, kv_lens, key_pos, MaskSpec())[:, None]
            bias = torch.zeros(mask.shape).masked_fill(~mask, -1e9)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

        args = (torch.randn(2, 1, 2, 8), torch.randn(2, 18, 1, 8), torch.tensor([[2, 0], [3, 1]]),
                torch.tensor([6, 3]), torch.tensor([[4, 5], [1, 2]]))
        gm = _trace(eager_mask, *args)
        self.assertEqual(_run_pass(BlockAttentionPass(), gm), (0, {}))

    def test_uuid_tracks_the_source(self):
        # The FX graph cache keys on uuid(): editing any one pass's module must change it and the combined one.
        import inspect
        from unittest import mock

        passes = build_passes()
        before = [p.uuid() for p in passes]
        assert len(set(before)) == 3
        combined = passes_uuid()
        real = inspect.getsource
        for edited in passes:
            module = inspect.getmodule(type(edited))
            with mock.patch.object(inspect, "getsource",
                                   lambda obj, m=module: real(obj) + ("\n# edited\n" if obj is m else "")):
                assert [p.uuid() != b for p, b in zip(passes, before)] == [p is edited for p in passes]
                assert passes_uuid() != combined
        assert passes_uuid() == combined  # and nothing else moves it
