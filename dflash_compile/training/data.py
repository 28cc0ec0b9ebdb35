"""Drafter training data: prompts from a text corpus, continued by the frozen target, cached to disk.

The drafter learns the target's own outputs, so each example is ``prompt + target continuation`` (greedy by
default). Prompts are random ``prompt_len``-token windows of corpus files. The cache file name is a hash of
the target (config + every byte of its weights), the corpus (file names and contents) and every setting, so
changing any of them regenerates the data and nothing stale is reused. Sampled continuations are seeded from the
settings, and the caller's global RNG state is left as it was.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DataConfig:
    num_prompts: int = 1024
    prompt_len: int = 64
    gen_len: int = 192
    do_sample: bool = False  # greedy by default
    temperature: float = 1.0
    gen_batch: int = 32
    seed: int = 0

    def __post_init__(self):
        if self.num_prompts < 1 or self.prompt_len < 1 or self.gen_len < 1 or self.gen_batch < 1:
            raise ValueError(f"num_prompts, prompt_len, gen_len and gen_batch must be >= 1: {self}")


@dataclass
class DraftDataset:
    """``tokens [N, prompt_len + gen_len]`` (prompt then continuation, padded after an early eos),
    ``lengths [N]`` valid tokens per row (eos included), ``prompt_len``: where the target's tokens start."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_len: int

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def save(self, path) -> None:
        torch.save({"tokens": self.tokens, "lengths": self.lengths, "prompt_len": self.prompt_len}, path)

    @classmethod
    def load(cls, path) -> "DraftDataset":
        d = torch.load(path, weights_only=True)
        return cls(d["tokens"], d["lengths"], int(d["prompt_len"]))


def corpus_files(corpus, pattern: str = "*.py") -> list[Path]:
    """A file, a directory (``pattern`` searched recursively), or ``"stdlib"`` (this interpreter's Python
    standard library sources, without tests, idlelib and site-packages). Sorted."""
    if str(corpus) == "stdlib":
        import sysconfig

        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
        return sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))
    p = Path(corpus)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob(pattern) if f.is_file())
    raise FileNotFoundError(f"corpus {corpus!r} is neither a file, a directory nor 'stdlib'")


def corpus_prompts(tokenizer, files: list[Path], num_prompts: int, prompt_len: int, seed: int) -> torch.Tensor:
    """``[num_prompts, prompt_len]`` random token windows of the corpus files (reproducible from ``seed``)."""
    rng = random.Random(seed)
    docs = []
    for f in files:
        try:
            ids = tokenizer(f.read_text(encoding="utf-8"))["input_ids"]
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= prompt_len:
            docs.append(ids)
    if not docs:
        raise ValueError(f"no corpus file has {prompt_len} tokens")
    weights = [len(d) - prompt_len + 1 for d in docs]
    out = []
    for d in rng.choices(docs, weights=weights, k=num_prompts):
        s = rng.randrange(len(d) - prompt_len + 1)
        out.append(d[s : s + prompt_len])
    return torch.tensor(out, dtype=torch.long)


@torch.no_grad()
def generate_continuations(target, prompts: torch.Tensor, cfg: DataConfig, eos_token_id=None,
                           pad_token_id: int | None = None, progress: bool = True) -> DraftDataset:
    """Continue every prompt with ``target.generate`` (greedy unless ``cfg.do_sample``), in batches."""
    from tqdm import tqdm

    eos = eos_token_id if eos_token_id is not None else target.generation_config.eos_token_id
    eos_set = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    pad = pad_token_id if pad_token_id is not None else target.generation_config.pad_token_id
    pad = pad if pad is not None else (min(eos_set) if eos_set else 0)
    g = torch.Generator().manual_seed(cfg.seed)
    rows, lengths = [], []
    P = prompts.shape[1]
    for i in tqdm(range(0, len(prompts), cfg.gen_batch), desc="target continuations", disable=not progress,
                  mininterval=5):
        x = prompts[i : i + cfg.gen_batch].to(next(target.parameters()).device)
        kw = dict(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0) if cfg.do_sample else dict(do_sample=False)
        # HF samples from torch's global RNG: seed it from cfg.seed for this batch and give the caller's state back.
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            if cfg.do_sample:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
            out = target.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.gen_len, min_new_tokens=0,
                eos_token_id=list(eos_set) or None, pad_token_id=pad, **kw,
            ).cpu()
        full = torch.full((out.shape[0], P + cfg.gen_len), pad, dtype=torch.long)
        full[:, : out.shape[1]] = out
        for row in full:
            new = row[P:].tolist()
            n = next((j + 1 for j, t in enumerate(new) if t in eos_set), len(new))
            lengths.append(P + n)
        rows.append(full)
    return DraftDataset(torch.cat(rows), torch.tensor(lengths), P)


def _hash_file(h, f: Path, name: str) -> None:
    """Fold ``name``, ``f``'s size and its whole content into the hash ``h``."""
    with f.open("rb") as fh:
        h.update(f"{name}:{f.stat().st_size}:{hashlib.file_digest(fh, 'sha256').hexdigest()}".encode())


def fingerprint_dir(path) -> str:
    """A fingerprint of a saved HF model directory: its config.json and every byte of its weight files."""
    path = Path(path)
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        _hash_file(h, f, f.name)
    return h.hexdigest()


def cache_key(target_fingerprint: str, files: list[Path], cfg: DataConfig) -> str:
    h = hashlib.sha256()
    h.update(target_fingerprint.encode())
    for f in files:
        _hash_file(h, f, str(f))
    h.update(json.dumps(asdict(cfg), sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_dataset(target, tokenizer, target_dir, corpus, cfg: DataConfig, cache_dir, pattern: str = "*.py",
                  progress: bool = True) -> DraftDataset:
    """Load the cached dataset for (target, corpus, cfg) from ``cache_dir`` or build and cache it."""
    files = corpus_files(corpus, pattern)
    key = cache_key(fingerprint_dir(target_dir), files, cfg)
    cache = Path(cache_dir) / f"dflash_data_{key}.pt"
    if cache.is_file():
        print(f"data: cached {cache}", flush=True)
        return DraftDataset.load(cache)
    t0 = time.time()
    prompts = corpus_prompts(tokenizer, files, cfg.num_prompts, cfg.prompt_len, cfg.seed)
    ds = generate_continuations(target, prompts, cfg, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, progress=progress)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    ds.save(tmp)
    tmp.replace(cache)
    print(f"data: {len(ds)} sequences, mean length {ds.lengths.float().mean():.0f}, "
          f"{time.time() - t0:.0f}s -> {cache}", flush=True)
    return ds
