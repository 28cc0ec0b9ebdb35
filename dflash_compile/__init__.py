"""DFlash block-diffusion speculative decoding for Hugging Face causal LMs."""

from .config import DFlashConfig, default_target_layer_ids
from .draft_model import DFlashDraftModel
from .generation import DFlashGenerateOutput, DFlashStats
from .spec_wrapper import DFlashSpecWrapper, validate_pair

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashGenerateOutput",
    "DFlashSpecWrapper",
    "DFlashStats",
    "default_target_layer_ids",
    "validate_pair",
]
