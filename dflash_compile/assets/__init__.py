"""The shipped default pair: a small Python code-completion target and its DFlash drafter.

Trained here from scratch on permissively licensed Python (the standard library and 56 installed packages; the
licence of each is in ``default_pair/target/corpus_manifest.md``) by ``examples/train_target.py`` and
``examples/train_drafter.py`` (commands, seeds and wall times in README, "Training"). Stored in fp16; load as
fp32 on CPU.
"""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent / "default_pair"


def default_pair_paths() -> tuple[Path, Path]:
    """``(target_dir, draft_dir)``: ``target_dir`` loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``, ``draft_dir`` with ``DFlashDraftModel.from_pretrained``."""
    target, draft = _ROOT / "target", _ROOT / "draft"
    for d in (target, draft):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"the default pair is not installed: {d / 'config.json'} is missing")
    return target, draft
