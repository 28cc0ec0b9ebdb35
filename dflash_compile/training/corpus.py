"""A corpus of permissively licensed Python sources found on this machine, with licences recorded.

Two sources, chosen by a spec string (``"stdlib"`` or ``"stdlib+packages"``):

- ``stdlib``: the ``.py`` files of this interpreter's standard library (Python Software Foundation License).
- ``packages``: the ``.py`` files of every installed distribution whose licence, read from its metadata, is
  permissive (:func:`classify_license`). A distribution with an unknown or non-permissive licence (GPL, LGPL,
  MPL, no licence metadata, ...) is left out and listed as excluded in the manifest.

Left out everywhere: directories ``test``/``tests``/``testing``, vendored code (``_vendor``, ``vendor``,
``third_party``, ...), ``test_*.py``/``*_test.py``/``conftest.py``, files over ``max_bytes``, files with a line
over ``max_line`` characters (data tables), files that say they are generated in their first 2 KB, files that
are not UTF-8, empty files, and byte-identical duplicates (the first one in corpus order is kept: the stdlib,
then distributions by name, files by path).

Each file goes to the held-out split or not by a hash of ``(seed, package, path)`` alone, so the split is
deterministic given the seed and a file's assignment does not change when other packages come and go.
"""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# SPDX identifiers of permissive licences (and public-domain dedications).
PERMISSIVE_SPDX = frozenset({
    "0BSD", "APACHE-2.0", "BSD-2-CLAUSE", "BSD-3-CLAUSE", "BSD-3-CLAUSE-CLEAR", "BSL-1.0", "CC0-1.0",
    "CNRI-PYTHON", "HPND", "ISC", "MIT", "MIT-0", "MIT-CMU", "NCSA", "PSF-2.0", "PYTHON-2.0", "UNLICENSE",
    "X11", "ZLIB", "BSD",
})
# Exceptions that only add permissions.
_SPDX_EXCEPTIONS = frozenset({"LLVM-EXCEPTION"})
# Trove classifiers (after "License :: ") mapped to SPDX-like names.
_CLASSIFIERS = {
    "OSI Approved :: MIT License": "MIT",
    "OSI Approved :: MIT No Attribution License (MIT-0)": "MIT-0",
    "OSI Approved :: BSD License": "BSD",
    "OSI Approved :: Apache Software License": "Apache-2.0",
    "OSI Approved :: Python Software Foundation License": "PSF-2.0",
    "OSI Approved :: ISC License (ISCL)": "ISC",
    "OSI Approved :: zlib/libpng License": "Zlib",
    "OSI Approved :: Boost Software License 1.0 (BSL-1.0)": "BSL-1.0",
    "OSI Approved :: The Unlicense (Unlicense)": "Unlicense",
    "OSI Approved :: University of Illinois/NCSA Open Source License": "NCSA",
    "CC0 1.0 Universal (CC0 1.0) Public Domain Dedication": "CC0-1.0",
}
# Short free-text ``License:`` fields (lower-cased, "license" and punctuation removed) mapped to SPDX.
_FREE_TEXT = {
    "mit": "MIT", "bsd": "BSD", "new bsd": "BSD-3-Clause", "bsd 3clause": "BSD-3-Clause", "3clause bsd": "BSD-3-Clause",
    "bsd3clause": "BSD-3-Clause", "bsd 2clause": "BSD-2-Clause", "bsd2clause": "BSD-2-Clause", "isc": "ISC",
    "apache 20": "Apache-2.0", "apache20": "Apache-2.0", "apache": "Apache-2.0", "apache version 20": "Apache-2.0",
    "apache software": "Apache-2.0", "apache software 20": "Apache-2.0", "psf": "PSF-2.0", "psf20": "PSF-2.0",
    "python software foundation": "PSF-2.0", "zlib": "Zlib", "unlicense": "Unlicense", "cc0": "CC0-1.0",
}

SKIP_DIRS = frozenset({"test", "tests", "testing", "idlelib", "site-packages", "__pycache__", "_vendor", "vendor",
                       "vendored", "_vendored", "third_party", "thirdparty", "extern", "_distutils_hack"})
_GENERATED = re.compile(r"do not edit|auto-?generated|automatically generated|this file (?:is|was) generated",
                        re.IGNORECASE)
# The project's own sources are not training data (they change from branch to branch).
_SELF = frozenset({"dflash-compile", "dflash_compile"})


def _spdx_permissive(expr: str) -> bool:
    """A small SPDX expression check: ``A OR B`` needs one permissive side, ``A AND B`` needs both."""
    expr = expr.strip().strip("()").strip()
    if not expr:
        return False
    alternatives = re.split(r"\s+OR\s+", expr, flags=re.IGNORECASE)
    if len(alternatives) > 1:
        return any(_spdx_permissive(a) for a in alternatives)
    for term in re.split(r"\s+AND\s+", expr, flags=re.IGNORECASE):
        term = term.strip().strip("()").strip()
        base, _, exc = re.sub(r"\s+", " ", term.upper()).partition(" WITH ")
        if base.strip() not in PERMISSIVE_SPDX or (exc.strip() and exc.strip() not in _SPDX_EXCEPTIONS):
            return False
    return True


def classify_license(metadata) -> tuple[str, bool]:
    """``(licence, permissive)`` of a distribution from its core metadata (``importlib.metadata`` object or a
    mapping with ``get``/``get_all``): ``License-Expression`` first (SPDX), then the ``License ::`` trove
    classifiers (all must be permissive), then a short free-text ``License`` field. Unknown is not permissive."""
    expr = (metadata.get("License-Expression") or "").strip()
    if expr:
        return expr, _spdx_permissive(expr)
    classifiers = [c[len("License :: "):] for c in (metadata.get_all("Classifier") or [])
                   if c.startswith("License :: ") and c != "License :: OSI Approved"]
    known = [_CLASSIFIERS.get(c) for c in classifiers]
    if known:
        name = " AND ".join(k or c for k, c in zip(known, classifiers))
        return name, all(known)
    text = (metadata.get("License") or "").strip()
    if text and len(text) <= 80 and "\n" not in text:
        key = re.sub(r"\blicen[sc]e\b", "", text.lower())
        key = re.sub(r"[^a-z0-9 ]", "", key)
        key = re.sub(r"\s+", " ", key).strip()
        spdx = _FREE_TEXT.get(key)
        if spdx is None and _spdx_permissive(text):
            spdx = text
        if spdx:
            return spdx, True
        return text, False
    return "unknown", False


@dataclass(frozen=True)
class Document:
    package: str
    path: str  # relative to the package's install root (for the stdlib: to the stdlib directory)
    text: str
    held_out: bool


@dataclass
class PackageRecord:
    package: str
    version: str
    license: str
    permissive: bool
    files: int = 0
    held_out_files: int = 0
    bytes: int = 0
    tokens: int = 0
    skipped: dict = field(default_factory=dict)  # reason -> count


@dataclass
class Corpus:
    documents: list[Document]
    packages: list[PackageRecord]  # included ones first, then the excluded distributions (files == 0)
    spec: str
    seed: int
    held_out_fraction: float

    def manifest(self) -> dict:
        inc = [p for p in self.packages if p.permissive]
        exc = [p for p in self.packages if not p.permissive]
        return {
            "spec": self.spec,
            "seed": self.seed,
            "held_out_fraction": self.held_out_fraction,
            "python": sys.version.split()[0],
            "files": sum(p.files for p in inc),
            "held_out_files": sum(p.held_out_files for p in inc),
            "bytes": sum(p.bytes for p in inc),
            "tokens": sum(p.tokens for p in inc),
            "fingerprint": self.fingerprint(),
            "packages": [vars(p) for p in inc],
            "excluded": [{"package": p.package, "version": p.version, "license": p.license} for p in exc],
        }

    def fingerprint(self) -> str:
        """A hash of every document's package, path, split and content (what resume checks)."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(f"{d.package}\0{d.path}\0{int(d.held_out)}\0".encode())
            h.update(hashlib.sha256(d.text.encode()).digest())
        return h.hexdigest()[:16]


def _skip_reason(path: Path, rel_parts: tuple[str, ...], max_bytes: int, max_line: int) -> tuple[str | None, str]:
    if SKIP_DIRS & set(rel_parts[:-1]):
        return "tests/vendored dir", ""
    name = rel_parts[-1]
    if name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py":
        return "test file", ""
    try:
        if path.stat().st_size > max_bytes:
            return "too large", ""
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return "not utf-8", ""
    except OSError:
        return "unreadable", ""
    if not text.strip():
        return "empty", ""
    if _GENERATED.search(text[:2048]):
        return "generated", ""
    if max(map(len, text.splitlines())) > max_line:
        return "long line", ""
    return None, text


def _held_out(seed: int, package: str, path: str, fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}\0{package}\0{path}".encode()).digest()
    return int.from_bytes(h[:8], "big") < fraction * 2**64


def _stdlib_source(root=None):
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if f.is_file())
    return [(f, f.relative_to(root).parts) for f in files]


def _dist_sources(dist):
    out = []
    for f in dist.files or []:
        parts = Path(str(f)).parts
        if not str(f).endswith(".py") or ".." in parts or any(p.endswith((".dist-info", ".egg-info")) for p in parts):
            continue
        out.append((Path(dist.locate_file(f)), parts))
    return sorted(out, key=lambda x: x[1])


def build_corpus(spec: str = "stdlib+packages", seed: int = 0, held_out_fraction: float = 0.02,
                 max_bytes: int = 256_000, max_line: int = 1000, stdlib_root=None, distributions=None) -> Corpus:
    """Collect the corpus described by ``spec`` (``"stdlib"``, ``"packages"`` or ``"stdlib+packages"``).

    ``distributions`` (default: ``importlib.metadata.distributions()``) and ``stdlib_root`` exist for tests.
    """
    parts = set(spec.split("+"))
    if not parts or parts - {"stdlib", "packages"}:
        raise ValueError(f"corpus spec must be 'stdlib', 'packages' or 'stdlib+packages', got {spec!r}")
    sources: list[tuple[PackageRecord, list]] = []
    if "stdlib" in parts:
        rec = PackageRecord("python-stdlib", sys.version.split()[0], "PSF-2.0", True)
        sources.append((rec, _stdlib_source(stdlib_root)))
    excluded = []
    if "packages" in parts:
        if distributions is None:
            import importlib.metadata as md

            distributions = md.distributions()
        seen = set()
        for dist in sorted(distributions, key=lambda d: (d.metadata["Name"] or "").lower()):
            name = dist.metadata["Name"] or "?"
            key = re.sub(r"[-_.]+", "-", name.lower())
            if key in seen or key in _SELF:
                continue
            seen.add(key)
            lic, ok = classify_license(dist.metadata)
            rec = PackageRecord(name, dist.version, lic, ok)
            if ok:
                sources.append((rec, _dist_sources(dist)))
            else:
                excluded.append(rec)
    docs, hashes, records = [], set(), []
    for rec, files in sources:
        for path, rel in files:
            reason, text = _skip_reason(path, rel, max_bytes, max_line)
            if reason is None:
                digest = hashlib.sha256(text.encode()).digest()
                if digest in hashes:
                    reason = "duplicate"
                else:
                    hashes.add(digest)
            if reason is not None:
                rec.skipped[reason] = rec.skipped.get(reason, 0) + 1
                continue
            rel_s = "/".join(rel)
            held = _held_out(seed, rec.package, rel_s, held_out_fraction)
            docs.append(Document(rec.package, rel_s, text, held))
            rec.files += 1
            rec.held_out_files += held
            rec.bytes += len(text.encode())
        if rec.files:
            records.append(rec)
        else:
            rec.license += " (no usable files)"
            rec.permissive = False
            excluded.append(rec)
    return Corpus(docs, records + excluded, spec, seed, held_out_fraction)


def manifest_markdown(manifest: dict) -> str:
    """The manifest as a Markdown table (for the README)."""
    lines = ["| package | version | licence | files | tokens |", "|---|---|---|---:|---:|"]
    for p in manifest["packages"]:
        lines.append(f"| {p['package']} | {p['version']} | {p['license']} | {p['files']} | {p['tokens']:,} |")
    lines.append(f"| **total** | | | {manifest['files']} | {manifest['tokens']:,} |")
    return "\n".join(lines)
