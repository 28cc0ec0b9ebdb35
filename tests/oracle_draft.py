"""A drafter that is partly right on real sequences by construction, and acceptance recounted from first principles.

``OracleDrafter`` is a real ``DFlashDraftModel`` (its layers, context injection and paged reads all run, eager or
compiled) whose logits get a large boost on the target's own greedy continuation for the first ``k`` block
positions, ``k = (position of the bonus token) % block_size``: so steps accept 0, 1, ..., block_size - 1 drafts by
design, and the drafts after the first ``k`` are the random drafter's own (context-dependent) choices. The right
continuation comes from a table ``oracle[position, token] -> next token`` built from the target's greedy output
for the prompts under test (``greedy_continuations``).
"""

from __future__ import annotations

import torch

from dflash_compile import DFlashDraftModel
from dflash_compile.runtime.speculation import Plan, SpeculationPolicy

UNKNOWN = -1
_CONFLICT = -2  # two sequences disagree on the next token after (position, token): no oracle there
BOOST = 1e4


class OracleDrafter(DFlashDraftModel):
    def set_oracle(self, sequences: list[list[int]], prompt_lens: list[int], max_len: int) -> "OracleDrafter":
        """``sequences``: prompt + greedy continuation of each prompt; ``max_len`` > every position used."""
        table = torch.full((max_len, self.config.vocab_size), UNKNOWN, dtype=torch.long)
        for seq, L in zip(sequences, prompt_lens):
            for p in range(L, len(seq) - 1):
                old, new = int(table[p, seq[p]]), seq[p + 1]
                table[p, seq[p]] = new if old in (UNKNOWN, new) else _CONFLICT
        self.register_buffer("oracle", table.clamp(min=UNKNOWN), persistent=False)
        return self

    def oracle_chain(self, position: int, bonus: int) -> list[int]:
        """The tokens this drafter forces after ``bonus`` at ``position`` (host side; UNKNOWN ends the chain)."""
        K = self.block_size - 1
        out, tok = [], bonus
        for i in range(position % self.block_size):
            tok = int(self.oracle[min(position + i, self.oracle.shape[0] - 1), tok]) if tok >= 0 else UNKNOWN
            if tok == UNKNOWN:
                break
            out.append(tok)
        return out[:K]

    def forward(self, block_ids, block_positions, *args, **kwargs):  # either form of the context (dense, paged)
        logits = super().forward(block_ids, block_positions, *args, **kwargs)  # [Bk, K, V]
        K, V = logits.shape[1:]
        pos = block_positions[:, 0]
        forced = pos % self.block_size  # how many leading drafts are the oracle's
        vocab = torch.arange(V, device=logits.device)
        tok, boosts = block_ids[:, 0], []
        for i in range(K):
            nxt = self.oracle[(pos + i).clamp(0, self.oracle.shape[0] - 1), tok.clamp(0, V - 1)]
            tok = torch.where((tok >= 0) & (forced > i), nxt, UNKNOWN)
            boosts.append(vocab[None, :] == tok[:, None])
        return logits + BOOST * torch.stack(boosts, dim=1).to(logits.dtype)


def greedy_continuations(target, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """prompt + ``max_new`` greedy tokens of ``target`` (HF ``generate``), per prompt."""
    out = []
    for p in prompts:
        with torch.no_grad():
            out.append(target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new)[0].tolist())
    return out


def oracle_pair(target, prompts: list[list[int]], max_new: int, max_len: int, **draft_kw):
    """An ``OracleDrafter`` for ``target`` right on ``prompts``' greedy continuations, and those continuations."""
    K = draft_kw.get("block_size", 4) - 1
    full = greedy_continuations(target, prompts, max_new + K + 1)
    draft = OracleDrafter.from_target(target, **draft_kw)
    return draft.set_oracle(full, [len(p) for p in prompts], max_len + K + 1), full


def recount(draft: OracleDrafter, prompt_len: int, full: list[int], drafts: list[list[int]]):
    """Replay one request's steps from its verified ``drafts`` and the target's greedy sequence ``full``.

    Returns ``(accepted per step, forced per step)``: the accepted count the rule "longest prefix of drafts equal
    to the target's tokens" gives, and how many leading drafts the oracle got right by construction (the drafter
    must then accept at least that many, whatever the random part proposed)."""
    accepted, forced, p = [], [], prompt_len  # p: position of the step's bonus token
    for d in drafts:
        truth = full[p + 1 : p + 1 + len(d)]
        a = 0
        while a < len(d) and a < len(truth) and d[a] == truth[a]:
            a += 1
        chain = draft.oracle_chain(p, full[p])
        f = 0
        while f < len(chain) and f < len(truth) and chain[f] == truth[f]:
            f += 1
        accepted.append(a)
        forced.append(f)
        p += a + 1
    return accepted, forced


def check_drafting(draft: OracleDrafter, prompts, fulls, out) -> tuple[int, int]:
    """Every row's recorded acceptance equals the replayed one and reaches the oracle's forced prefix.

    Returns ``(accepted drafts, forced drafts)`` over the batch, for the caller's non-vacuity checks."""
    total_a = total_f = 0
    for i, (prompt, full) in enumerate(zip(prompts, fulls)):
        accepted, forced = recount(draft, len(prompt), full, out.drafts[i])
        stats = out.per_request[i]
        # one entry per step, each as long as that step's K (K = 0: plain decoding, nothing verified)
        assert [len(d) for d in out.drafts[i]] == stats.step_ks == out.step_ks[i]
        assert stats.num_drafts == sum(k > 0 for k in stats.step_ks)
        hist = [sum(a > j for a in accepted) for j in range(len(stats.num_accepted_tokens_per_pos))]
        assert (stats.num_accepted_tokens, stats.num_accepted_tokens_per_pos) == (sum(accepted), hist), (
            i, stats, accepted)
        assert all(a >= f for a, f in zip(accepted, forced)), (i, accepted, forced, out.drafts[i])
        total_a, total_f = total_a + sum(accepted), total_f + sum(forced)
    return total_a, total_f


class CyclePolicy(SpeculationPolicy):
    """Forces the K sequence ``ks`` (repeated): each step proposes exactly when the next one verifies drafts."""

    def __init__(self, ks):
        self.seq, self.i = list(ks), 0

    def ks(self, block_size):
        return tuple(sorted(set(self.seq)))

    def choose(self, view):
        k = self.seq[self.i % len(self.seq)]
        self.i += 1
        return Plan(k, self.seq[self.i % len(self.seq)] > 0)


SWITCHING = [0, 1, 3, 7, 0, 0, 2, 7, 1, 0, 5, 3]  # K at every step: each value, and every kind of transition
