"""The running requests' step inputs as persistent device buffers (``Batch``)."""

from __future__ import annotations

import torch

from ..step.step import SamplingInputs


class Batch:
    """The running requests' step inputs as persistent device buffers: row ``i`` of every buffer belongs to
    ``rows[i]``; rows ``len(rows)..`` are free (inactive, empty table). A step runs on the first ``bucket`` rows;
    its results update the buffers in place (one host read per step), and a row is rewritten only when a request
    joins, leaves (the last row moves into the hole) or needs another KV block (one table entry). ``grow`` makes
    room for more rows (contents kept)."""

    def __init__(self, num_rows: int, block_size: int, blocks_per_seq: int, device):
        long = dict(dtype=torch.long, device=device)
        self.rows: list = []  # the requests (``handles.Request``) in rows 0..
        self.block = torch.zeros(num_rows, block_size, **long)  # the bonus and the drafts after it
        self.seq_lens = torch.zeros(num_rows, **long)
        self.tables = torch.full((num_rows, blocks_per_seq), -1, **long)
        self.active = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.do_sample = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.temperature = torch.ones(num_rows, device=device)
        self.top_k = torch.zeros(num_rows, **long)
        self.top_p = torch.ones(num_rows, device=device)
        self.state_slots = torch.zeros(num_rows, **long)  # each row's slot in the recurrent-state pools
        self.seeds = torch.zeros(num_rows, **long)  # each sampled row's noise seed

    _BUFFERS = ("block", "seq_lens", "tables", "active", "do_sample", "temperature", "top_k", "top_p", "state_slots",
                "seeds")

    @property
    def capacity(self) -> int:
        return self.block.shape[0]

    def grow(self, num_rows: int) -> None:
        """At least ``num_rows`` rows; new rows are free."""
        for name in self._BUFFERS:
            old = getattr(self, name)
            if old is None:
                continue
            fill = -1 if name == "tables" else (1 if name in ("temperature", "top_p") else 0)
            new = torch.full((num_rows, *old.shape[1:]), fill, dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def clear_row(self, i: int) -> None:
        self.block[i] = 0
        self.seq_lens[i] = 0
        self.tables[i] = -1
        self.active[i] = False
        self.do_sample[i] = False

    def remove(self, i: int) -> None:
        """Drop row ``i``: the last row moves into it."""
        last = len(self.rows) - 1
        if i != last:
            for name in self._BUFFERS:
                buf = getattr(self, name)
                if buf is not None:
                    buf[i] = buf[last]
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.clear_row(last)

    def start_row(self, i: int, r, cache) -> None:
        """Row ``i`` for request ``r`` joining with its prompt (``r.seq_len`` tokens): its blocks, its recurrent-state
        slot and its sampling parameters."""
        self.cover(i, r, r.seq_len, cache)
        self.seq_lens[i] = r.seq_len
        self.active[i] = True
        self.state_slots[i] = cache.state_slot(r.index)
        a = r.args
        self.do_sample[i], self.temperature[i], self.top_k[i], self.top_p[i] = (a.do_sample, a.temperature, a.top_k,
                                                                                a.top_p)
        self.seeds[i] = r.sampling_seed() if a.do_sample else 0

    def cover(self, i: int, r, num_tokens: int, cache) -> None:
        """Allocate KV blocks so row ``i`` (request ``r``) covers ``num_tokens`` positions (capped at capacity)."""
        if r.pages * cache.page_size < min(num_tokens, cache.max_seq_len):
            cache.ensure(r.index, num_tokens)
            owned = cache.blocks(r.index)
            self.tables[i, r.pages : len(owned)] = torch.tensor(owned[r.pages :], dtype=torch.long)
            r.pages = len(owned)

    def sampling(self, bucket: int) -> SamplingInputs:
        """The step's ``SamplingInputs`` for the first ``bucket`` rows."""
        return SamplingInputs(self.do_sample[:bucket], self.temperature[:bucket], self.top_k[:bucket],
                              self.top_p[:bucket], self.seeds[:bucket])
