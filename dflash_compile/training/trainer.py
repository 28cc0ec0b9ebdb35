"""The drafter training loop: frozen target, AdamW, warmup + cosine LR, clipping, checkpoints, exact resume.

Every source of randomness in the loop (batch order, anchors) is one ``torch.Generator`` whose state is saved
in each checkpoint with the drafter, the optimizer and the step, so ``resume=True`` continues exactly where
the checkpoint left off (same batches, same anchors, same weights as an uninterrupted run).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import pickle
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models.draft_model import DFlashDraftModel
from ..models.hidden_states import AuxHiddenStates
from .data import DraftDataset
from .objective import default_gamma, dflash_loss, sample_anchors

_CKPT_DIR = "checkpoints"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    blocks_per_seq: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: default_gamma(block_size)
    anchors_in_prompt: bool = False  # False: anchors only where the target's own tokens start (x_a generated)
    checkpoint_every: int = 200
    max_minutes: float | None = None  # stop (with a checkpoint) after this wall time
    cache_features: bool = False  # run the target once over the whole dataset and keep its features in memory
    autocast: str | None = None  # "bfloat16": the drafter's matmuls in bf16 (fp32 weights, optimizer and loss)
    seed: int = 0
    held_out: int = 0  # rows kept out of training (a seeded choice) and scored every ``eval_every`` steps
    eval_every: int = 0  # 0: only at the end (when ``held_out``)

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.blocks_per_seq < 1:
            raise ValueError(f"steps, batch_size and blocks_per_seq must be >= 1: {self}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"bad learning-rate schedule: {self}")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.held_out < 0 or self.eval_every < 0:
            raise ValueError(f"held_out and eval_every must be >= 0: {self}")
        if self.autocast not in (None, "bfloat16", "float16"):
            raise ValueError(f"autocast must be None, 'bfloat16' or 'float16', got {self.autocast!r}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def latest_checkpoint(out_dir) -> Path | None:
    ckpts = sorted(Path(out_dir, _CKPT_DIR).glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return ckpts[-1] if ckpts else None


def load_checkpoint(path) -> dict:
    """A training checkpoint, read with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers
    only. A file that would need anything else (a pickle that runs code) is refused with a ``ValueError``."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [x for x in str(e).splitlines() if "GLOBAL" in x or "global" in x]
        raise ValueError(
            f"refusing to load {path}: it holds more than tensors, numbers, strings and containers, so it is not a "
            f"checkpoint this trainer wrote ({(lines or [type(e).__name__])[0].strip()})"
        ) from None


def _save_checkpoint(out_dir, step, draft, opt, gen, cfg, history) -> Path:
    d = Path(out_dir, _CKPT_DIR)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"step": step, "draft": draft.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
         "config": asdict(cfg), "history": history},
        tmp,
    )
    tmp.replace(path)
    return path


def save_drafter(draft: DFlashDraftModel, path, dtype: torch.dtype | None = None) -> None:
    """``save_pretrained`` in the published format, optionally cast (the live drafter is left unchanged)."""
    if dtype is None or dtype == next(draft.parameters()).dtype:
        draft.save_pretrained(path)
        return
    copy = DFlashDraftModel(draft.config, draft.dflash_config)
    copy.load_state_dict(draft.state_dict())
    copy.to(dtype).save_pretrained(path)


def train_drafter(
    target,
    draft: DFlashDraftModel,
    data: DraftDataset,
    cfg: TrainConfig,
    out_dir,
    resume: bool = False,
    save_dtype: torch.dtype | None = None,
    progress: bool = True,
    features=None,
) -> dict:
    """Train ``draft`` (bound to the frozen ``target``) on ``data``; write checkpoints under
    ``out_dir/checkpoints`` and the final drafter to ``out_dir`` (``DFlashDraftModel.save_pretrained``).

    ``features``: a ``features.FeatureStore`` of the target over ``data`` (the target is then not run per step).
    ``cfg.held_out`` rows (a seeded choice) are kept out of training and scored every ``cfg.eval_every`` steps and at
    the end: per-position acceptance and acceptance length of greedy verification on their blocks (teacher-forced on
    the target's own tokens). Returns ``step``, ``history`` (loss, tau, ``held_out`` scores), ``held_out``, ``wall_s``.
    """
    from tqdm import tqdm

    t0, out_dir = time.time(), Path(out_dir)
    _check_autocast(cfg, next(draft.parameters()).device)
    draft.bind_target(target)
    target.eval().requires_grad_(False)
    draft.train()
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(draft.block_size)
    opt = _optimizer(draft, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, history = _resume(out_dir, draft, opt, gen) if resume else (0, [])
    if draft.draft_vocab_size is not None:  # the map it trains with: chosen from the data, --init's or resumed
        from .data import token_coverage

        V = target.config.get_text_config().vocab_size
        print(f"draft vocabulary: {draft.draft_vocab_size} of {V} tokens, "
              f"{token_coverage(data, draft.d2t, V):.2%} of the target's own tokens in the data", flush=True)
    aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids)
    batches = _Batches(target, draft, data, cfg, features, aux, progress)
    bar = tqdm(total=cfg.steps, initial=step, desc="drafter", disable=not progress, mininterval=5)
    stopped_early = False
    try:
        while step < cfg.steps:
            tokens, hidden, anchors, valid = batches.next(gen)
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            with _autocast(cfg, tokens.device):
                loss, m = dflash_loss(draft, hidden, tokens, anchors, valid, gamma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            history.append(_record(step, loss, m, batches, draft, gamma, cfg, bar))
            out_of_time = cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or out_of_time:
                _save_checkpoint(out_dir, step, draft, opt, gen, cfg, history)
            if out_of_time and step < cfg.steps:
                print(f"stopping at step {step}: max_minutes={cfg.max_minutes} reached (resume to continue)",
                      flush=True)
                stopped_early = True
                break
    finally:
        bar.close()
        aux.remove()
    draft.eval()
    save_drafter(draft, out_dir, save_dtype)
    return _summary(out_dir, step, cfg, stopped_early, gamma, history, time.time() - t0)


def _record(step: int, loss, m: dict, batches: "_Batches", draft, gamma: float, cfg: TrainConfig, bar) -> dict:
    """The step's history entry (scored on the held-out rows every ``eval_every`` steps and at the last)."""
    entry = {"step": step, "loss": round(loss.item(), 5), "tau": round(m["tau"], 4),
             "acc": [round(a, 4) for a in m["acc"].tolist()]}
    held = {}
    if batches.held.numel() and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps):
        entry["held_out"] = batches.score(draft, gamma)
        held = {"held_tau": f"{entry['held_out']['tau']:.2f}"}
    bar.update(1)
    bar.set_postfix(loss=f"{loss.item():.3f}", tau=f"{m['tau']:.2f}", lr=f"{cfg.lr_at(step - 1):.1e}", **held)
    return entry


def _optimizer(draft: DFlashDraftModel, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in draft.parameters() if p.dim() >= 2]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )


def _resume(out_dir: Path, draft, opt, gen) -> tuple[int, list]:
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        return 0, []
    state = load_checkpoint(ckpt)
    draft.load_state_dict(state["draft"])
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    print(f"resumed from {ckpt} at step {state['step']}", flush=True)
    return state["step"], state["history"]


def _check_autocast(cfg: TrainConfig, device: torch.device) -> None:
    """Warn when bf16 autocast is asked of a CPU without bf16 hardware: torch's bf16 matrix products then take slow
    generic loops (the backward's input-gradient products among them, measured), and fp32 trains faster there."""
    from ..lowerings.cpu.host import native_bf16

    if cfg.autocast == "bfloat16" and device.type == "cpu" and not native_bf16():
        warnings.warn("autocast='bfloat16' on a CPU without bf16 instructions (AVX512-BF16, AMX or Arm's BF16): "
                      "torch runs bf16 matrix products through generic loops there, many times slower than fp32 "
                      "(a 2-layer SmolLM2 drafter on an AVX2 core: ~70 s a step against ~5 s in fp32); train "
                      "without autocast on this machine", stacklevel=3)


def _autocast(cfg: TrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=getattr(torch, cfg.autocast)) if cfg.autocast else contextlib.nullcontext()


class _Batches:
    """Training batches (rows drawn from the training rows, anchors, the target's features from the store, from
    memory or from a target forward) and the held-out rows' score."""

    def __init__(self, target, draft, data: DraftDataset, cfg: TrainConfig, features, aux, progress: bool):
        self.target, self.draft, self.data, self.cfg, self.aux = target, draft, data, cfg, aux
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}
        self.device = next(draft.parameters()).device
        self.min_anchor = torch.ones(len(data), dtype=torch.long) if cfg.anchors_in_prompt else data.starts()
        if cfg.held_out >= len(data):
            raise ValueError(f"held_out={cfg.held_out} leaves no training rows of {len(data)}")
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed + 1))
        self.held = order[:cfg.held_out].sort().values
        self.train_rows = torch.arange(len(data)) if not cfg.held_out else order[cfg.held_out:].sort().values
        if features is not None and cfg.cache_features:
            raise ValueError("features= and cache_features=True both give the target's features: choose one")
        width = len(draft.dflash_config.target_layer_ids) * target.config.get_text_config().hidden_size
        if features is not None and features.width != width:
            raise ValueError(f"the feature store has rows of {features.width}, the drafter's target layers {width}")
        self.features = self._cached(progress) if cfg.cache_features else features

    @torch.no_grad()
    def _cached(self, progress: bool) -> torch.Tensor:  # N * T * n_ids * H floats: for small targets only
        from tqdm import tqdm

        chunks, bs = [], self.cfg.batch_size
        for i in tqdm(range(0, len(self.data), bs), desc="target features", disable=not progress, mininterval=5):
            self.target(input_ids=self.data.tokens[i : i + bs].to(self.device), use_cache=False, **self.extra)
            chunks.append(self.aux.read().cpu())
        return torch.cat(chunks)

    def rows(self, idx: torch.Tensor, gen: torch.Generator, num_blocks: int):
        """``(tokens, target features, anchors, valid)`` of rows ``idx``."""
        lengths = self.data.lengths[idx]
        T = int(lengths.max())
        tokens = self.data.tokens[idx, :T].to(self.device)
        anchors, valid = sample_anchors(lengths, num_blocks, self.draft.block_size, self.min_anchor[idx], gen)
        if isinstance(self.features, torch.Tensor):
            hidden = self.features[idx, :T].to(self.device)
        elif self.features is not None:
            hidden = self.features.batch(idx, T).to(self.device)
        else:
            with torch.no_grad():
                self.target(input_ids=tokens, use_cache=False, **self.extra)
                hidden = self.aux.read()
        return tokens, hidden, anchors.to(self.device), valid.to(self.device)

    def next(self, gen: torch.Generator):
        pick = torch.randint(0, len(self.train_rows), (self.cfg.batch_size,), generator=gen)
        return self.rows(self.train_rows[pick], gen, self.cfg.blocks_per_seq)

    @torch.no_grad()
    def score(self, draft, gamma: float) -> dict:
        """The held-out rows' per-position acceptance and acceptance length (the same anchors every time)."""
        gen = torch.Generator().manual_seed(self.cfg.seed + 2)
        was_training = draft.training
        draft.eval()
        hits, taus, n = None, 0.0, 0
        try:
            for i in range(0, len(self.held), self.cfg.batch_size):
                idx = self.held[i : i + self.cfg.batch_size]
                tokens, hidden, anchors, valid = self.rows(idx, gen, self.cfg.blocks_per_seq)
                with _autocast(self.cfg, tokens.device):
                    _, m = dflash_loss(draft, hidden, tokens, anchors, valid, gamma)
                k = int(valid.sum())
                hits = m["acc"] * k if hits is None else hits + m["acc"] * k
                taus, n = taus + (m["tau"] - 1.0) * k, n + k
        finally:
            draft.train(was_training)
        n = max(n, 1)
        return {"tau": round(1.0 + taus / n, 4), "acc": [round(float(a) / n, 4) for a in hits], "rows": len(self.held)}


def _summary(out_dir: Path, step: int, cfg: TrainConfig, stopped_early: bool, gamma: float, history: list,
             wall: float) -> dict:
    recent = history[-20:]
    scored = [h["held_out"] for h in history if "held_out" in h]
    summary = {
        "step": step,
        "steps": cfg.steps,
        "stopped_early": stopped_early,
        "final_loss": sum(h["loss"] for h in recent) / max(1, len(recent)),
        "final_tau_estimate": sum(h["tau"] for h in recent) / max(1, len(recent)),
        "held_out": scored[-1] if scored else None,
        "gamma": gamma,
        "config": asdict(cfg),
        "wall_s": round(wall, 1),
    }
    (out_dir / "training_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["history"] = history
    return summary
