import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
# Without a GPU, Triton kernels run in its interpreter; that must be decided before anything imports triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiled artefacts shared across tests (and runs) in the repo's ignored build dir.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), "build", "inductor-cache")
)
# Compiled step graphs (and the Inductor cache they load from) in the same ignored dir, never in the user's home.
os.environ.setdefault(
    "DFLASH_COMPILE_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), "build", "dflash-cache")
)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
