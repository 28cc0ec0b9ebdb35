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


@pytest.fixture(scope="session", autouse=True)
def _shared_inductor_cache(tmp_path_factory):
    """One Inductor cache for every compile cache of the run (``$DFLASH_INDUCTOR_CACHE_DIR``; the variable, if set, is
    kept): a graph another test compiled is traced again, through the DFlash passes (their counters count), but not
    code-generated and built again. xdist's workers share the run's directory (Inductor's caches write atomically and
    build under a lock). Tests about Inductor's cache inside a compile cache are marked ``own_inductor_cache``."""
    if "DFLASH_INDUCTOR_CACHE_DIR" in os.environ:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is a folder of the run's
        shared = tmp_path_factory.getbasetemp().parent / "inductor"
        shared.mkdir(exist_ok=True)
    else:
        shared = tmp_path_factory.mktemp("inductor")
    os.environ["DFLASH_INDUCTOR_CACHE_DIR"] = str(shared)


@pytest.fixture(autouse=True)
def _compile_cache(request, tmp_path, monkeypatch):
    """Each test compiles into a compile cache of its own (never the user's home): which graphs a test compiles or
    loads, and the DFlash passes' counters it reads, never depend on what another test left (Inductor's cache is the
    run's, above, unless the test is marked ``own_inductor_cache``)."""
    monkeypatch.setenv("DFLASH_COMPILE_CACHE_DIR", str(tmp_path / "dflash-cache"))
    if request.node.get_closest_marker("own_inductor_cache"):
        monkeypatch.delenv("DFLASH_INDUCTOR_CACHE_DIR", raising=False)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # tiny test targets have no tokenizer to choose a mask token from (test_draft_model checks the warning)
        warnings.filterwarnings("ignore", message="no mask_token_id and no tokenizer")
        yield
