"""Train a DFlash drafter for a frozen Hugging Face target (see README, "Training")."""

from .data import DataConfig, DraftDataset, build_dataset, corpus_files, corpus_prompts, generate_continuations
from .objective import (
    block_inputs,
    block_mask,
    default_gamma,
    dflash_loss,
    layer_masks,
    position_weights,
    sample_anchors,
)
from .trainer import TrainConfig, latest_checkpoint, save_drafter, train_drafter

__all__ = [
    "DataConfig",
    "DraftDataset",
    "TrainConfig",
    "block_inputs",
    "block_mask",
    "layer_masks",
    "build_dataset",
    "corpus_files",
    "corpus_prompts",
    "default_gamma",
    "dflash_loss",
    "generate_continuations",
    "latest_checkpoint",
    "position_weights",
    "sample_anchors",
    "save_drafter",
    "train_drafter",
]
