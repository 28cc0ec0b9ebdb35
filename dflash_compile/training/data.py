"""Drafter training data: prompts from a text corpus, continued by the frozen target, cached to disk.

The drafter learns the target's own outputs, so each example is ``prompt + target continuation`` (greedy by
default). Prompts are random ``prompt_len``-token windows of corpus files and, for a ``signature_share`` of
them, the way people prompt code models: the ``prompt_len`` tokens that end with a documented function's
signature and docstring (as HumanEval's prompts do), so the drafter learns how the target writes a body. The
cache file name is a hash of the target (config + every byte of its weights), the corpus (file names and
contents) and every setting, so changing any of them regenerates the data and nothing stale is reused. Sampled
continuations are seeded from the settings, and the caller's global RNG state is left as it was.
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
    signature_share: float = 0.0  # share of prompts that end with a function's signature and docstring

    def __post_init__(self):
        if self.num_prompts < 1 or self.prompt_len < 1 or self.gen_len < 1 or self.gen_batch < 1:
            raise ValueError(f"num_prompts, prompt_len, gen_len and gen_batch must be >= 1: {self}")
        if not 0.0 <= self.signature_share <= 1.0:
            raise ValueError(f"signature_share must be in [0, 1], got {self.signature_share}")


@dataclass
class DraftDataset:
    """``tokens [N, max_len]`` (prompt then continuation, padded after an early eos), ``lengths [N]`` valid tokens
    per row (eos included), ``prompt_len``: where the target's tokens start, or ``prompt_lens [N]`` where they
    start row by row (chat data: prompts of every length)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_len: int
    prompt_lens: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def starts(self) -> torch.Tensor:
        """``[N]``: where each row's target tokens start."""
        return self.prompt_lens if self.prompt_lens is not None else torch.full((len(self),), self.prompt_len)

    def save(self, path) -> None:
        d = {"tokens": self.tokens, "lengths": self.lengths, "prompt_len": self.prompt_len}
        if self.prompt_lens is not None:
            d["prompt_lens"] = self.prompt_lens
        torch.save(d, path)

    @classmethod
    def load(cls, path) -> "DraftDataset":
        d = torch.load(path, weights_only=True)
        return cls(d["tokens"], d["lengths"], int(d["prompt_len"]), d.get("prompt_lens"))


def frequent_tokens(data: DraftDataset, n: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``n`` target tokens the target writes most often in ``data`` (its own tokens: after each row's prompt),
    ``always`` included (e.g. the end-of-turn token), sorted by id: a reduced draft vocabulary
    (``DFlashDraftModel.from_target(draft_vocab=...)``). Ties go to the lower id."""
    pos = torch.arange(data.tokens.shape[1])
    own = (pos[None] >= data.starts()[:, None]) & (pos[None] < data.lengths[:, None])
    counts = torch.bincount(data.tokens[own], minlength=vocab_size).double()
    always = torch.as_tensor(list(always), dtype=torch.long)
    if len(always) > n:
        raise ValueError(f"{len(always)} tokens must be in a draft vocabulary of {n}")
    counts[always] = float("inf")
    order = torch.argsort(-counts, stable=True)
    return order[:n].sort().values


def token_coverage(data: DraftDataset, vocab: torch.Tensor, vocab_size: int) -> float:
    """The share of the target's own tokens in ``data`` that ``vocab`` holds."""
    pos = torch.arange(data.tokens.shape[1])
    own = (pos[None] >= data.starts()[:, None]) & (pos[None] < data.lengths[:, None])
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab] = True
    return float(inside[data.tokens[own]].float().mean())


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


def _read(f: Path) -> str | None:
    try:
        return f.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def docstring_ends(source: str) -> list[int]:
    """Character offsets just past the line that closes the docstring of each documented function or method
    of ``source`` (the newline included): ``source[:offset]`` is a prompt like HumanEval's, a signature and its
    docstring with everything above. Empty for source that does not parse."""
    import ast
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes etc. in old sources
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    ends = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) is not None:
            doc = node.body[0]
            if len(node.body) > 1 and doc.end_lineno < len(line_starts) - 1:  # a body follows the docstring
                ends.append(line_starts[doc.end_lineno])
    return sorted(ends)


def corpus_prompts(tokenizer, files: list[Path], num_prompts: int, prompt_len: int, seed: int,
                   signature_share: float = 0.0) -> torch.Tensor:
    """``[num_prompts, prompt_len]`` prompts from the corpus files, reproducible from ``seed``: random token
    windows, and for ``round(signature_share * num_prompts)`` of them (in random rows) the last ``prompt_len``
    tokens of a file cut just after a documented function's docstring (``docstring_ends``), tokenized on their
    own as a user's prompt would be (distinct functions while the corpus has enough, then repeats); functions
    with fewer tokens above them than ``prompt_len`` are not used."""
    rng = random.Random(seed)
    texts = [t for t in map(_read, files) if t]
    docs = [ids for ids in (tokenizer(t)["input_ids"] for t in texts) if len(ids) >= prompt_len]
    if not docs:
        raise ValueError(f"no corpus file has {prompt_len} tokens")
    num_signatures = round(signature_share * num_prompts)
    signatures = []
    if num_signatures:
        cuts = [(i, end) for i, t in enumerate(texts) for end in docstring_ends(t)]
        rng.shuffle(cuts)
        for i, end in cuts:
            # Tokenize only the text just above the cut: ~8 characters per token is ample for code.
            ids = tokenizer(texts[i][max(0, end - 8 * prompt_len):end])["input_ids"]
            if len(ids) > prompt_len:  # the first token may be cut in half: never use it
                signatures.append(ids[-prompt_len:])
                if len(signatures) == num_signatures:
                    break
        if not signatures:
            raise ValueError(f"no documented function in the corpus has {prompt_len} tokens above its docstring's "
                             f"end: signature prompts are impossible (signature_share 0, or a shorter prompt_len)")
        # A small corpus repeats its functions, as windows repeat their files.
        signatures += rng.choices(signatures, k=num_signatures - len(signatures))
    weights = [len(d) - prompt_len + 1 for d in docs]
    out = []
    for d in rng.choices(docs, weights=weights, k=num_prompts - num_signatures):
        s = rng.randrange(len(d) - prompt_len + 1)
        out.append(d[s : s + prompt_len])
    if signatures:
        out += signatures
        rng.shuffle(out)  # mixed batches for generation
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
    prompts = corpus_prompts(tokenizer, files, cfg.num_prompts, cfg.prompt_len, cfg.seed, cfg.signature_share)
    ds = generate_continuations(target, prompts, cfg, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, progress=progress)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    ds.save(tmp)
    tmp.replace(cache)
    print(f"data: {len(ds)} sequences, mean length {ds.lengths.float().mean():.0f}, "
          f"{time.time() - t0:.0f}s -> {cache}", flush=True)
    return ds
