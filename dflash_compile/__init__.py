"""DFlash block-diffusion speculative decoding for Hugging Face causal LMs.

The public names load on first use (PEP 562), so ``import dflash_compile.backends`` — what
``torch.compile(..., backend="dflash")`` runs through its entry point — loads neither transformers nor the wrapper.

Layout: ``primitives/`` (slot, mask and K/V rules, written once), ``models/`` (the drafter, its config and
checkpoint formats), ``paged/`` (what the target caches, the pools, the HF cache adapter, recurrent states),
``step/`` (the one compiled step), ``runtime/`` (the wrapper and its rooms: requests, target checks, pools,
compiled steps, scheduler, speculation policy, tensor parallelism), ``passes/`` + ``lowerings/`` + ``backends.py``
(the compiler), ``serve/`` (the OpenAI-compatible server), ``training/`` (the drafter recipe).
"""

import importlib

_PUBLIC = {
    "DFlashConfig": "models.config",
    "default_target_layer_ids": "models.config",
    "DFlashDraftModel": "models.draft_model",
    "DFlashGenerateOutput": "runtime.generation",
    "DFlashStats": "runtime.generation",
    "DFlashSpecWrapper": "runtime.wrapper",
    "validate_pair": "runtime.target_check",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
