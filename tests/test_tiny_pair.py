"""The tiny code pair (7.35 M target, its drafter) loads offline and speculates well on code (a cheap check, not the benchmark)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.assets import tiny_pair_paths

# Prompts as a user writes them for a code model: a signature and its docstring, ending at the closing quotes
# (not at a newline: README, "Training", on why a bare newline token means column 0).
# prompt -> floor on its acceptance length τ over MAX_NEW greedy tokens: a little below what was measured
# (3.82, 3.50, 5.73 and 3.61; fp32, CPU), so that a drafting bug that only costs speed (a position off by one,
# a context row lost) fails.
TAU_FLOORS = {
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""': 3.6,
    'import os\n\n\ndef list_python_files(root):\n'
    '    """Return the paths of the .py files under ``root``, sorted."""': 3.3,
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n        self.items = []\n\n'
    '    def push(self, item):\n        """Put ``item`` on top of the stack."""': 5.4,
    'def parse_args(argv=None):\n    """Parse the command line."""': 3.4,
}
MAX_NEW = 64


@pytest.fixture(scope="module")
def pair():
    target_dir, draft_dir = tiny_pair_paths()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    return tok, target, draft


def test_tiny_pair_loads_fp32(pair):
    tok, target, draft = pair
    assert next(target.parameters()).dtype == torch.float32 and next(draft.parameters()).dtype == torch.float32
    assert tok.eos_token_id is not None and draft.config.vocab_size == target.config.vocab_size
    assert sum(p.numel() for p in target.parameters()) < 50e6


def test_tiny_pair_speculates_as_well_as_measured(pair):
    tok, target, draft = pair
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=1)  # the whole block, every step
    taus = {}
    for text in TAU_FLOORS:
        ids = torch.tensor([tok(text)["input_ids"]])
        out = spec.generate(ids, max_new_tokens=MAX_NEW, return_dict_in_generate=True)
        ref = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
        n = min(out.sequences.shape[1], ref.shape[1])
        assert torch.equal(out.sequences[:, :n], ref[:, :n]), text
        taus[text] = out.acceptance_length
    assert all(taus[t] >= floor for t, floor in TAU_FLOORS.items()), taus


def test_tiny_pair_fits_the_package_budget_and_records_its_licences():
    import json

    target_dir, draft_dir = tiny_pair_paths()
    files = [f for d in (target_dir, draft_dir) for f in d.iterdir() if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 25 * 2**20
    # the target was trained on permissively licensed Python only, and says so next to its weights
    manifest = json.loads((target_dir / "corpus_manifest.json").read_text())
    assert manifest["packages"] and manifest["tokens"] == sum(p["tokens"] for p in manifest["packages"])
    assert all(p["permissive"] and p["license"] for p in manifest["packages"]), manifest["packages"]
    assert (target_dir / "corpus_manifest.md").is_file()
