"""Every causal-LM model type of transformers' auto mapping, built tiny from its config: greedy output through the
wrapper equals HF ``generate``'s (each prompt alone and in a left-padded batch), or the wrapper refuses it before any
work with a message. ``model_sweep.py`` builds, runs and classifies; as a script it writes the report
(``benchmarks/results/model_sweep.md``).

Skipped: encoder-decoder, non-text and duplicate entries of the mapping, and models HF itself cannot build tiny or
``generate`` with (the reason says which)."""

import pytest
import transformers

from model_sweep import check, model_types, sweep_plan


@pytest.fixture
def quiet_transformers():
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("model_type", model_types())
def test_lossless_or_refused(model_type, quiet_transformers):
    why = sweep_plan()[1].get(model_type)
    if why is not None:
        pytest.skip(why)
    r = check(model_type)
    if r.outcome in ("unbuildable", "no generate support"):
        pytest.skip(f"{r.outcome}: {r.message}")
    assert r.outcome in ("lossless", "refused"), f"{r.cls}: {r.message}"
    if r.outcome == "refused":
        assert r.message, f"{r.cls} refused without saying why"
