"""The tiny code pair as it was at any git revision, for benchmarks that compare figures across a change of that
pair (it lived in ``assets/default_pair`` until the chat pair became the default).

    python benchmarks/pairs.py REV          # extracts it, prints "TARGET_DIR DRAFT_DIR"
    python benchmarks/bench_humaneval.py --pair-revision REV ...

``REV`` is any revision of this repository (a commit, a branch, a tag); the pair's files at that revision are
extracted with ``git archive`` under ``build/pairs/<commit>/`` once and reused. README, "Training", names the
revisions of the earlier pairs.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAIRS = ("dflash_compile/assets/tiny_pair", "dflash_compile/assets/default_pair")  # its folder, newest name first


def _git(*args: str) -> bytes:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True).stdout
    except FileNotFoundError:
        raise SystemExit("git is not installed: --pair-revision reads the pair from the repository's history")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"git {' '.join(args)}: {e.stderr.decode().strip()}") from None


def pair_at_revision(rev: str) -> tuple[Path, Path]:
    """``(target_dir, draft_dir)`` of the default pair at revision ``rev`` (extracted under build/pairs/)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    listed = _git("ls-tree", "-d", "--name-only", commit, "dflash_compile/assets/").decode().split()
    PAIR = next((p for p in PAIRS if p in listed), PAIRS[0])
    out = REPO / "build" / "pairs" / commit
    target, draft = out / PAIR / "target", out / PAIR / "draft"
    if not ((target / "config.json").is_file() and (draft / "config.json").is_file()):
        archive = _git("archive", "--format=tar", commit, PAIR)
        tmp = out.with_name(commit + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted extraction
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        if not (tmp / PAIR / "target" / "config.json").is_file():
            shutil.rmtree(tmp)
            raise SystemExit(f"revision {rev} ({commit[:10]}) has no tiny pair under {PAIR}")
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
    return target, draft


def resolve_pair(target: str | None, draft: str | None, revision: str | None) -> tuple[Path, Path]:
    """A benchmark's ``--target/--draft`` (both or neither), ``--pair-revision`` or, with none, the shipped pair."""
    if (target is None) != (draft is None):
        raise SystemExit("give both --target and --draft, or neither")
    if revision and target:
        raise SystemExit("give --target/--draft or --pair-revision, not both")
    if revision:
        return pair_at_revision(revision)
    if target:
        return Path(target), Path(draft)
    from dflash_compile.assets import default_pair_paths

    return default_pair_paths()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(*pair_at_revision(sys.argv[1]))
