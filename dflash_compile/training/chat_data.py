"""Chat training data for a drafter of an instruction-tuned target: conversations the target itself writes.

No hub dataset is used. Each conversation is ``chat template + user turn + the target's own response``, where
the user turn comes from one of two sources:

- **self-prompts**: the target writes the user turn itself. Its chat template is rendered up to the point where a
  user's text would start (``user_turn_prefix``), and the target samples from there until its end-of-turn token;
  an instruction-tuned model then writes the kind of request it was tuned on.
- **code requests** from the licensed Python corpus (this interpreter's standard library, PSF licence): a
  documented function becomes one of a few requests (complete it from its signature and docstring, write it from
  a description, explain it, document it).

The response is the target's greedy continuation (or sampled, ``response_temperature > 0``) of
``template(user turn) + generation prompt``, until its end-of-turn token or ``response_max_new`` tokens.

Held-out separation: a user turn that equals (ignoring case and spacing) a prompt the benchmarks, the demo or the
tests measure on (``excluded``) is dropped, and code requests never use a function whose name is a HumanEval
task's entry point.

Generation is sharded and resumable: shard ``i`` is a function of ``(config, i)`` alone (its own seeded
generator), written as ``shard_{i:05d}.npz`` (token ids as uint16 when the vocabulary fits, offsets, where each
response starts, the source) once complete; a run skips shards already on disk.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

SELF, CODE = 0, 1  # the ``source`` of a conversation
_SENTINEL = "\u2063USER\u2063TEXT\u2063"


@dataclass(frozen=True)
class ChatDataConfig:
    shard_size: int = 64
    self_prompt_share: float = 0.5  # the rest are code requests from the corpus
    prompt_max_new: int = 96  # a self-written user turn longer than this is dropped
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    response_max_new: int = 320
    response_temperature: float = 0.0  # 0: greedy responses
    gen_batch: int = 32
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.self_prompt_share <= 1.0:
            raise ValueError(f"self_prompt_share must be in [0, 1], got {self.self_prompt_share}")
        if min(self.shard_size, self.prompt_max_new, self.response_max_new, self.gen_batch) < 1:
            raise ValueError(f"sizes must be >= 1: {self}")


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def user_turn_prefix(tokenizer) -> str:
    """The chat template rendered up to where a user's first message starts (system turn included if the template
    adds one by default)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: self-prompts need one")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render the user's message verbatim once")
    return text[: text.index(_SENTINEL)]


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end a turn: the tokenizer's eos and, if the template closes turns with another special
    token right after the message, that one."""
    ids = {tokenizer.eos_token_id} - {None}
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    after = text[text.index(_SENTINEL) + len(_SENTINEL):]
    first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    if first and first[0] in set(tokenizer.all_special_ids):
        ids.add(first[0])
    if not ids:
        raise ValueError("the tokenizer has no eos token and its template no end-of-turn token")
    return sorted(ids)


# ---------------------------------------------------------------------------------------------- code requests
_TEMPLATES = (
    "complete", "describe", "explain", "document",
)


def _functions(source: str):
    """``(name, signature line(s), docstring, whole source, source without the docstring)`` of documented
    top-level functions and methods with a body after the docstring, under 60 lines."""
    import ast
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno - node.lineno > 60 or node.name.startswith("_"):
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
        body0 = node.body[0]
        dedent = lambda chunk: "".join(l[indent:] if l[:indent].strip() == "" else l for l in chunk)
        whole = dedent(lines[start:node.end_lineno])
        head = dedent(lines[start:body0.end_lineno])  # signature + docstring
        nodoc = dedent(lines[start:body0.lineno - 1] + lines[body0.end_lineno:node.end_lineno])
        yield node.name, head, doc, whole, nodoc


def code_request(kind: str, name: str, head: str, doc: str, whole: str, nodoc: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if kind == "complete":
        return f"Complete the following Python function:\n```python\n{head.rstrip()}\n```"
    if kind == "describe":
        sig = head.split('"""')[0].split("'''")[0].strip().rstrip(":")
        return f"Write a Python function `{sig.removeprefix('def ').removeprefix('async def ')}`: {first}"
    if kind == "explain":
        return f"Explain what this Python function does:\n```python\n{whole.rstrip()}\n```"
    if kind == "document":
        return f"Write a docstring for this Python function:\n```python\n{nodoc.rstrip()}\n```"
    raise ValueError(f"unknown code request {kind!r}")


def corpus_functions(files, excluded_names=frozenset()) -> list[tuple]:
    """Every usable documented function of the corpus files (see ``_functions``), in file order."""
    funcs = []
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        funcs += [fn for fn in _functions(text) if fn[0] not in excluded_names]
    if not funcs:
        raise ValueError("no documented function in the corpus")
    return funcs


def code_requests(funcs: list[tuple], seed: int):
    """An endless, reproducible stream of code requests over ``corpus_functions`` (``seed`` orders them)."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(funcs)))
        rng.shuffle(order)
        for i in order:
            yield code_request(rng.choice(_TEMPLATES), *funcs[i])


# ---------------------------------------------------------------------------------------------- generation
def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        p, idx = probs.sort(-1, descending=True)
        keep = p.cumsum(-1) - p < top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, p * keep)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def continue_rows(model, rows: list[list[int]], max_new: int, stop_ids, pad_id: int, temperature: float = 0.0,
                  top_p: float = 1.0, gen: torch.Generator | None = None) -> list[tuple[list[int], bool]]:
    """Continue each token list with ``model`` (left-padded batch, HF cache), dropping each row from the batch
    as it ends: ``(new tokens, ended with a stop id)`` per row."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    B, L = len(rows), max(map(len, rows))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.tensor(r)
        mask[i, L - len(r):] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    stop = torch.tensor(sorted(set(stop_ids)), device=device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    alive = torch.arange(B, device=device)
    next_pos = pos[:, -1] + 1
    new = [[] for _ in rows]
    ended = [False] * B
    for step in range(max_new):
        tok = _pick(out.logits[:, -1], temperature, top_p, gen)
        for i, t in zip(alive.tolist(), tok.tolist()):
            new[i].append(t)
        done = torch.isin(tok, stop)
        for i in alive[done].tolist():
            ended[i] = True
        keep = (~done).nonzero().squeeze(-1)
        if keep.numel() == 0 or step == max_new - 1:
            break
        if keep.numel() < alive.numel():
            cache.batch_select_indices(keep)
            mask, tok, next_pos, alive = mask[keep], tok[keep], next_pos[keep], alive[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        next_pos = next_pos + 1
    return list(zip(new, ended))


def chat_ids(tokenizer, user: str) -> list[int]:
    """The token ids of ``template([user]) + generation prompt``."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_shard(model, tokenizer, cfg: ChatDataConfig, index: int, code_stream, excluded: set[str],
               progress=None) -> dict:
    """Conversations of shard ``index``: ``{"tokens": [...], "prompt_lens": [...], "sources": [...], "users": [...]}``."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
    rng = random.Random(cfg.seed * 1_000_003 + index)
    stop = end_of_turn_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    n_self = sum(rng.random() < cfg.self_prompt_share for _ in range(cfg.shard_size))
    users: list[tuple[int, str]] = []
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    while len(users) < n_self:  # self-prompts: sample user turns until enough are usable
        batch = min(cfg.gen_batch, 2 * (n_self - len(users)))
        for toks, ok in continue_rows(model, [prefix] * batch, cfg.prompt_max_new, stop, pad,
                                      cfg.prompt_temperature, cfg.prompt_top_p, gen):
            text = tokenizer.decode(toks[:-1] if ok else toks, skip_special_tokens=True).strip()
            if ok and len(text) >= 8 and _norm(text) not in excluded and len(users) < n_self:
                users.append((SELF, text))
        if progress is not None:
            progress.set_postfix_str(f"shard {index}: {len(users)}/{n_self} self-prompts")
    while len(users) < cfg.shard_size:
        text = next(code_stream)
        if _norm(text) not in excluded:
            users.append((CODE, text))
    rng.shuffle(users)
    out = {"tokens": [], "prompt_lens": [], "sources": [], "users": []}
    for i in range(0, len(users), cfg.gen_batch):
        chunk = users[i:i + cfg.gen_batch]
        prompts = [chat_ids(tokenizer, u) for _, u in chunk]
        replies = continue_rows(model, prompts, cfg.response_max_new, stop, pad, cfg.response_temperature, 1.0, gen)
        for (src, u), p, (r, _) in zip(chunk, prompts, replies):
            out["tokens"].append(p + r)
            out["prompt_lens"].append(len(p))
            out["sources"].append(src)
            out["users"].append(u)
        if progress is not None:
            progress.set_postfix_str(f"shard {index}: {min(i + cfg.gen_batch, len(users))}/{len(users)} responses")
    return out


def save_shard(path: Path, shard: dict, vocab_size: int) -> None:
    dtype = np.uint16 if vocab_size <= 65536 else np.int32
    flat = np.concatenate([np.asarray(t, dtype=dtype) for t in shard["tokens"]])
    offsets = np.cumsum([0] + [len(t) for t in shard["tokens"]]).astype(np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, tokens=flat, offsets=offsets, prompt_lens=np.asarray(shard["prompt_lens"], np.int32),
                        sources=np.asarray(shard["sources"], np.int8))
    tmp.replace(path)


def load_shards(folder) -> list[dict]:
    """Every complete shard in ``folder``, in order: ``{"tokens": [list[int]], "prompt_lens": [...], "sources": [...]}``."""
    shards = []
    for f in sorted(Path(folder).glob("shard_*.npz")):
        if f.name.endswith(".tmp.npz"):
            continue
        z = np.load(f)
        flat, off = z["tokens"].astype(np.int64), z["offsets"]
        shards.append({"tokens": [flat[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)],
                       "prompt_lens": z["prompt_lens"].tolist(), "sources": z["sources"].tolist()})
    return shards


def generate_shards(model, tokenizer, out_dir, cfg: ChatDataConfig, num_shards: int, functions: list[tuple],
                    excluded_prompts=(), max_minutes: float | None = None,
                    progress: bool = True) -> int:
    """Write shards ``0 .. num_shards - 1`` that are not in ``out_dir`` yet; returns how many exist at the end.
    ``out_dir/config.json`` pins the config: a folder made with another one is refused."""
    from tqdm import tqdm

    from ..lowerings.cpu.onednn_linear import onednn_linears

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = out_dir / "config.json"
    want = {"data": asdict(cfg), "vocab_size": len(tokenizer),
            "target_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    if meta.is_file():
        have = json.loads(meta.read_text())
        if have != want:
            raise ValueError(f"{out_dir} holds shards made with another config: {have} (this run: {want})")
    else:
        meta.write_text(json.dumps(want, indent=1))
    excluded = {_norm(p) for p in excluded_prompts}
    todo = [i for i in range(num_shards) if not (out_dir / f"shard_{i:05d}.npz").is_file()]
    t0 = time.time()
    bar = tqdm(todo, desc="chat data shards", unit="shard", disable=not progress)
    for i in bar:
        if max_minutes is not None and time.time() - t0 > 60 * max_minutes:
            break
        # The code stream is seeded per shard, so a shard does not depend on which shards ran before it.
        stream = code_requests(functions, cfg.seed * 7919 + i)
        with onednn_linears(model, cfg.gen_batch):  # ~1.8x on AMD CPUs (lowerings/cpu/onednn_linear.py)
            shard = make_shard(model, tokenizer, cfg, i, stream, excluded, bar)
        save_shard(out_dir / f"shard_{i:05d}.npz", shard, len(tokenizer))
        with (out_dir / "users.jsonl").open("a") as fh:  # readable record of the prompts (not needed to train)
            for src, u in zip(shard["sources"], shard["users"]):
                fh.write(json.dumps({"shard": i, "source": src, "user": u}) + "\n")
    return sum(1 for i in range(num_shards) if (out_dir / f"shard_{i:05d}.npz").is_file())


def to_dataset(folders, pad_id: int, max_len: int | None = None, shards: int | None = None):
    """The conversations of each folder's first ``shards`` shards (all by default; ``folders``: one or a list) as a
    ``DraftDataset`` with per-row ``prompt_lens`` (a response starts after its chat prompt), cut at ``max_len``."""
    from .data import DraftDataset

    folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
    convs, starts = [], []
    for shard in [s for f in folders for s in load_shards(f)[:shards]]:
        for t, p in zip(shard["tokens"], shard["prompt_lens"]):
            t = t[:max_len] if max_len else t
            if len(t) > p:  # a response token at least
                convs.append(t)
                starts.append(p)
    if not convs:
        raise ValueError(f"no conversation in {folders}")
    L = max(map(len, convs))
    tokens = torch.full((len(convs), L), pad_id, dtype=torch.long)
    for i, t in enumerate(convs):
        tokens[i, :len(t)] = torch.tensor(t)
    return DraftDataset(tokens, torch.tensor([len(t) for t in convs]), min(starts), torch.tensor(starts))
