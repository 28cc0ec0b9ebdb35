import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
# Without a GPU, Triton kernels run in its interpreter; that must be decided before anything imports triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Converted real models (the SmolLM2 GGUF) once per machine, shared by every test and subprocess: each test's compile
# cache is its own (below), a 30 s conversion per test would not be.
os.environ.setdefault("DFLASH_MODELS_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), "build", "dflash-models"))
# Compiled artefacts shared across tests (and runs) in the repo's ignored build dir.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), "build", "inductor-cache")
)


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _compile_cache(tmp_path, monkeypatch):
    """Each test compiles into a compile cache of its own (never the user's home): what a test compiles, and
    the counters it reads, never depend on what another test left."""
    monkeypatch.setenv("DFLASH_COMPILE_CACHE_DIR", str(tmp_path / "dflash-cache"))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # tiny test targets have no tokenizer to choose a mask token from (test_draft_model checks the warning)
        warnings.filterwarnings("ignore", message="no mask_token_id and no tokenizer")
        yield
