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

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.blocks_per_seq < 1:
            raise ValueError(f"steps, batch_size and blocks_per_seq must be >= 1: {self}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"bad learning-rate schedule: {self}")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
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
    Returns a summary: ``step`` reached, ``history`` (per-step loss and tau estimate), ``wall_s``.
    """
    from tqdm import tqdm

    t0 = time.time()
    out_dir = Path(out_dir)
    draft.bind_target(target)
    target.eval().requires_grad_(False)
    draft.train()
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(draft.block_size)
    decay = [p for p in draft.parameters() if p.dim() >= 2]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    step, history = 0, []
    if resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is not None:
            state = load_checkpoint(ckpt)
            draft.load_state_dict(state["draft"])
            opt.load_state_dict(state["optimizer"])
            gen.set_state(state["generator"])
            step, history = state["step"], state["history"]
            print(f"resumed from {ckpt} at step {step}", flush=True)

    aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}
    device = next(draft.parameters()).device
    min_anchor = torch.ones(len(data), dtype=torch.long) if cfg.anchors_in_prompt else data.starts()
    if features is not None and cfg.cache_features:
        raise ValueError("features= and cache_features=True both give the target's features: choose one")
    width = len(draft.dflash_config.target_layer_ids) * target.config.get_text_config().hidden_size
    if features is not None and features.width != width:
        raise ValueError(f"the feature store has rows of {features.width}, the drafter's target layers {width}")
    if cfg.cache_features:  # N * T * n_ids * H floats: for small targets only
        with torch.no_grad():
            chunks = []
            for i in tqdm(range(0, len(data), cfg.batch_size), desc="target features", disable=not progress,
                          mininterval=5):
                target(input_ids=data.tokens[i : i + cfg.batch_size].to(device), use_cache=False, **extra)
                chunks.append(aux.read().cpu())
            features = torch.cat(chunks)
    bar = tqdm(total=cfg.steps, initial=step, desc="drafter", disable=not progress, mininterval=5)
    stopped_early = False
    try:
        while step < cfg.steps:
            idx = torch.randint(0, len(data), (cfg.batch_size,), generator=gen)
            lengths = data.lengths[idx]
            T = int(lengths.max())
            tokens = data.tokens[idx, :T].to(device)
            anchors, valid = sample_anchors(lengths, cfg.blocks_per_seq, draft.block_size, min_anchor[idx], gen)
            if isinstance(features, torch.Tensor):
                hidden = features[idx, :T].to(device)
            elif features is not None:
                hidden = features.batch(idx, T).to(device)
            else:
                with torch.no_grad():
                    target(input_ids=tokens, use_cache=False, **extra)
                    hidden = aux.read()
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            amp = (torch.autocast(device.type, dtype=getattr(torch, cfg.autocast)) if cfg.autocast
                   else contextlib.nullcontext())
            with amp:
                loss, m = dflash_loss(draft, hidden, tokens, anchors.to(device), valid.to(device), gamma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            history.append({"step": step, "loss": round(loss.item(), 5), "tau": round(m["tau"], 4),
                            "acc": [round(a, 4) for a in m["acc"].tolist()]})
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", tau=f"{m['tau']:.2f}", lr=f"{cfg.lr_at(step - 1):.1e}")
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
    wall = time.time() - t0
    recent = history[-20:]
    summary = {
        "step": step,
        "steps": cfg.steps,
        "stopped_early": stopped_early,
        "final_loss": sum(h["loss"] for h in recent) / max(1, len(recent)),
        "final_tau_estimate": sum(h["tau"] for h in recent) / max(1, len(recent)),
        "gamma": gamma,
        "config": asdict(cfg),
        "wall_s": round(wall, 1),
    }
    (out_dir / "training_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["history"] = history
    return summary
