"""Paged K/V pools shared by the target and the drafter, and the host-side block allocator with prefix caching.

Layout. Each target decoder layer has its own pool, sized from what that layer actually caches (``layout.py``): an
attention layer whose K and V have the same per-token shape gets one tensor ``[2 (K, V), num_slots + 2, kv_heads,
head_dim]``, one whose K and V differ (MLA caches a latent and a rotary key of different widths) a ``(K pool, V
pool)`` pair, a recurrent layer (linear attention, Mamba, short convolution: any conv or recurrent state) a dict of
state pools with one slot per running request (``recurrent.py``), a layer holding both gets both (its attention pool
in the dict under ``ATTENTION``), and a layer that caches nothing (MLP only) no pool. Separate tensors, so a compiled
step writes each in place rather than through a view of a larger one. The drafter has one pool for all its layers,
``[num_layers, 2, num_slots + 2, kv_heads, head_dim]`` (written whole). Slots come in KV blocks of ``page_size``
(``primitives/slots.py``) and every request owns one block table that indexes BOTH pools: position ``p`` of a
request lives in the same slot of the target pool and of the drafter pool (vLLM allocates block tables spanning the
target's and the draft's layers the same way).

Rollback of rejected tokens is by length only: a request's ``seq_len`` moves back and later writes overwrite
the stale slots; nothing is copied.
"""

from __future__ import annotations

import hashlib
import mmap
from collections import Counter, OrderedDict

import torch
from torch.utils._pytree import tree_leaves

from ..primitives.slots import pages
from .layout import ATTENTION, AttentionLayout, StateLayout

class PagedKVCache:
    """Host-side owner of the pools, of the KV blocks of each request and of its recurrent-state slot."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_seq_len: int,
        page_size: int,
        target_layout: list[AttentionLayout | StateLayout | None],
        draft_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str,
        num_blocks: int | None = None,  # KV blocks in all; default: max_batch_size requests of max_seq_len tokens
        prefix_caching: bool = False,
    ):
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.blocks_per_seq = pages(max_seq_len, page_size)
        self.num_blocks = num_blocks or max_batch_size * self.blocks_per_seq
        slots = self.num_blocks * page_size + 2  # + ZERO_SLOT, TRASH_SLOT
        self.target_layout = tuple(target_layout)
        self.target_pools = tuple(_layer_pool(lay, slots, max_batch_size + 2, device) for lay in self.target_layout)
        self.has_states = any(isinstance(lay, StateLayout) for lay in self.target_layout)
        Ld, Hd, Dd = draft_shape
        self.draft_pool = zeroed((Ld, 2, slots, Hd, Dd), dtype, device)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        # Prefix caching (``match`` / ``register``): full prompt pages, hashed as a chain, stay readable after their
        # requests finish, and a request whose prompt starts with them adopts them instead of prefilling them.
        self.prefix_caching = prefix_caching
        self._refs: dict[int, int] = {}  # block -> how many requests hold it
        self._hash_of: dict[int, bytes] = {}  # block -> the hash of the page chain it holds
        self._block_of: dict[bytes, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no request holds, least recent first
        self.prefix_stats: Counter = Counter()  # queries, query_tokens, hit_tokens, evicted_blocks
        self._owned: dict[int, list[int]] = {}
        self._free_states = list(range(max_batch_size - 1, -1, -1)) if self.has_states else []
        self._state_slot: dict[int, int] = {}

    @property
    def device(self) -> torch.device:
        return self.draft_pool.device

    def grow(self, num_blocks: int) -> None:
        """Hold ``num_blocks`` KV blocks, keeping every block's contents and owner (requests keep running)."""
        if num_blocks <= self.num_blocks:
            return
        kept = self.num_blocks * self.page_size  # the blocks' slots; ZERO_SLOT and TRASH_SLOT are made anew

        def bigger(pool: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(pool.shape)
            shape[dim] = num_blocks * self.page_size + 2
            new = zeroed(shape, pool.dtype, pool.device)
            new.narrow(dim, 0, kept).copy_(pool.narrow(dim, 0, kept))
            return new

        def bigger_attention(pool):
            return tuple(bigger(p, 0) for p in pool) if isinstance(pool, tuple) else bigger(pool, 1)

        self.target_pools = tuple(
            None if pool is None
            else {n: bigger_attention(p) if n == ATTENTION else p for n, p in pool.items()} if isinstance(pool, dict)
            else bigger_attention(pool)
            for pool in self.target_pools
        )
        self.draft_pool = bigger(self.draft_pool, 2)
        self._free = list(range(num_blocks - 1, self.num_blocks - 1, -1)) + self._free  # low ids still go first
        self.num_blocks = num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take: never used, or holding a cached page no request holds (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def page_hashes(self, tokens: list[int], pages: int) -> list[bytes]:
        """The chained hashes of the first ``pages`` full pages of ``tokens``: each covers its page's token ids and
        the hash before it, so equal hashes mean equal prefixes (sha256: the same on every rank and process)."""
        out, h = [], b""
        for i in range(pages):
            page = tokens[i * self.page_size:(i + 1) * self.page_size]
            h = hashlib.sha256(h + b"|" + ",".join(map(str, page)).encode()).digest()
            out.append(h)
        return out

    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks holding the longest run of ``tokens``' first full pages (at least one token is left
        to prefill: its logits start the generation); [] without prefix caching."""
        if not self.prefix_caching:
            return []
        blocks = []
        for h in self.page_hashes(tokens, (len(tokens) - 1) // self.page_size):
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        self.prefix_stats.update(queries=1, query_tokens=len(tokens), hit_tokens=len(blocks) * self.page_size)
        return blocks

    def register(self, request: int, tokens: list[int]) -> None:
        """``request``'s prompt ``tokens`` are in its blocks now: cache its full pages (a page whose chain is
        cached in another block already stays uncached)."""
        if not self.prefix_caching:
            return
        owned = self._owned.get(request, [])
        for b, h in zip(owned, self.page_hashes(tokens, min(len(tokens) // self.page_size, len(owned)))):
            if b not in self._hash_of and h not in self._block_of:
                self._hash_of[b], self._block_of[h] = h, b

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        if self._evictable:  # the least recently used cached page no request holds
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(b)]
            self.prefix_stats["evicted_blocks"] += 1
            return b
        raise RuntimeError("the KV pool is out of blocks")  # sized so this cannot happen

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_states)

    @property
    def nbytes(self) -> int:
        """Bytes of all the pools (build the cache on the ``meta`` device to know them before allocating)."""
        return sum(t.nbytes for t in tree_leaves((self.target_pools, self.draft_pool)) if t is not None)

    def ensure(self, request: int, num_tokens: int, prefix: list[int] = ()) -> None:
        """Make ``request``'s blocks cover positions ``[0, min(num_tokens, max_seq_len))``; a new request first
        adopts the cached ``prefix`` blocks (``match``), shared with whoever else holds them."""
        need = pages(min(num_tokens, self.max_seq_len), self.page_size)
        owned = self._owned.setdefault(request, [])
        if not owned:
            for b in prefix:
                self._evictable.pop(b, None)
                self._refs[b] = self._refs.get(b, 0) + 1
                owned.append(b)
        while len(owned) < need:
            b = self._take()
            self._refs[b] = 1
            owned.append(b)

    def free(self, request: int) -> None:
        for b in reversed(self._owned.pop(request, [])):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                if b in self._hash_of:
                    self._evictable[b] = None  # most recently used last
                else:
                    self._free.append(b)
        if request in self._state_slot:
            self._free_states.append(self._state_slot.pop(request))

    def state_slot(self, request: int) -> int:
        """``request``'s slot in every recurrent-state pool (allocated on first use; 0 for a target without any)."""
        if not self.has_states:
            return 0
        if request not in self._state_slot:
            if not self._free_states:
                raise RuntimeError("the state pool is out of slots")  # one per running request: cannot happen
            self._state_slot[request] = self._free_states.pop()
        return self._state_slot[request]

    def blocks(self, request: int) -> list[int]:
        return list(self._owned.get(request, []))

    def block_table(self, requests: list[int | None]) -> torch.Tensor:
        """``[len(requests), blocks_per_seq]`` int64 table; ``None`` rows (bucket padding) are all -1."""
        table = torch.full((len(requests), self.blocks_per_seq), -1, dtype=torch.long)
        for row, request in enumerate(requests):
            owned = self._owned.get(request, []) if request is not None else []
            table[row, : len(owned)] = torch.tensor(owned, dtype=torch.long)
        return table.to(self.device)

    def slots_of(self, request: int) -> torch.Tensor:
        """Every slot of ``request``'s blocks (for tests and debugging)."""
        blocks = torch.tensor(self.blocks(request), dtype=torch.long)
        return (blocks[:, None] * self.page_size + torch.arange(self.page_size)).flatten().to(self.device)


def _layer_pool(layout, slots: int, state_slots: int, device):
    if layout is None:  # the layer caches nothing
        return None
    if isinstance(layout, StateLayout):  # one slot per running request + ZERO_SLOT, TRASH_SLOT
        pools = {name: zeroed((state_slots, *shape), dtype, device) for name, shape, dtype in layout.states}
        if layout.attention is not None:  # the same layer caches K/V too
            pools[ATTENTION] = _layer_pool(layout.attention, slots, state_slots, device)
        return pools
    if layout.key == layout.value:
        return zeroed((2, slots, *layout.key), layout.dtype, device)
    return zeroed((slots, *layout.key), layout.dtype, device), zeroed((slots, *layout.value), layout.dtype, device)


#: Pools from this size on are mapped rather than written (``zeroed``).
MAPPED_BYTES = 1 << 20


def zeroed(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU, from ``MAPPED_BYTES`` on, the memory of an
    anonymous mapping, which the OS hands out zero-filled page by page at first touch: allocating costs nothing up
    front, and the pages no request ever writes take no memory. (``torch.zeros`` wrote every byte: SmolLM2's pools for
    16 requests of 2048 tokens are 1.6 GB, 2.0 s of a warm start.) The tensor holds the mapping; the mapping goes
    with the last tensor that views it."""
    device = torch.device(device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MAPPED_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def available_memory(device) -> int | None:
    """Bytes that can still be allocated on ``device``: free memory on CUDA, ``MemAvailable`` on Linux CPUs;
    None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            pass
    return None
