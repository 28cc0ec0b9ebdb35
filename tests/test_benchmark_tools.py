"""benchmarks/pairs.py: the default pair at a git revision, for figures comparable across a change of the pair."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _git_checkout(), reason="needs git and a git checkout of the repository")
def test_pair_at_revision_extracts_the_committed_pair():
    from pairs import PAIRS, pair_at_revision

    target, draft = pair_at_revision("HEAD")
    root = next(p for p in target.parents if p.parent.name == "pairs")  # build/pairs/<commit>
    PAIR = target.parent.relative_to(root).as_posix()
    assert PAIR in PAIRS  # the tiny pair's folder, by the name it had at that revision
    for d, name in ((target, "target"), (draft, "draft")):
        for f in ("config.json", "model.safetensors"):
            committed = subprocess.run(["git", "-C", ROOT, "show", f"HEAD:{PAIR}/{name}/{f}"], capture_output=True,
                                       check=True).stdout
            assert (d / f).read_bytes() == committed
    stamp = (target / "config.json").stat().st_mtime_ns
    assert pair_at_revision("HEAD") == (target, draft)
    assert (target / "config.json").stat().st_mtime_ns == stamp  # reused, not extracted again
    with pytest.raises(SystemExit, match="Needed a single revision"):
        pair_at_revision("no-such-revision")


def test_resolve_pair_takes_one_source():
    from pairs import resolve_pair

    from dflash_compile.assets import default_pair_paths

    assert resolve_pair(None, None, None) == default_pair_paths()
    assert resolve_pair("t", "d", None) == (Path("t"), Path("d"))
    with pytest.raises(SystemExit, match="both --target and --draft"):
        resolve_pair("t", None, None)
    with pytest.raises(SystemExit, match="not both"):
        resolve_pair("t", "d", "HEAD")
