"""examples/generate.py: runs offline with the random pair (says so), greedy and sampled/streamed; clear errors."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "generate.py")


def _cli():
    spec = importlib.util.spec_from_file_location("generate_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.8", "--seed", "1", "--stream"]], ids=["greedy", "stream"])
def test_cli_runs(extra):
    r = _run("--prompt", "def fib(n):", "--max-new-tokens", "32", *extra)
    assert r.returncode == 0, r.stderr
    assert ("default pair" if _cli()._default_pair_dirs() else "RANDOMLY INITIALISED random pair") in r.stdout
    assert "tokens/s" in r.stdout and "acceptance length" in r.stdout and "accepted per draft position" in r.stdout
    assert "new tokens in" in r.stdout


def test_cli_reproducible_sampling():
    args = ("--prompt", "abc", "--max-new-tokens", "8", "--temperature", "0.9", "--seed", "3")
    a, b = _run(*args), _run(*args)
    assert a.returncode == 0, a.stderr
    text = [r.stdout.split("new tokens in")[0] for r in (a, b)]  # everything before the timings
    assert text[0] == text[1] and "--- [0]" in text[0]


def test_check_backend():
    cli = _cli()
    for name in ("eager", "dflash", "dflash_neuron"):
        assert cli.check_backend(name) == name
    with pytest.raises(ValueError, match="unknown backend 'tensorrt'"):
        cli.check_backend("tensorrt")
    r = _run("--backend", "tensorrt")
    assert r.returncode != 0 and "unknown backend" in r.stderr


def test_cli_errors(tmp_path):
    r = _run("--prompt", "")
    assert r.returncode != 0 and "empty" in r.stderr
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ab"}\n"cd"\n')
    r = _run("--prompts-file", str(f), "--max-new-tokens", "4", "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    assert "--- [1]" in r.stdout


DEMO = os.path.join(ROOT, "examples", "demo.py")


def test_demo_shows_both_methods_side_by_side():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, DEMO, "--backend", "eager", "--max-new-tokens", "24", "--runs", "1"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "the shipped default pair" in out and "identical output: yes" in out
    assert "HF generate, greedy" in out and "DFlash, eager" in out and "speed-up" in out
    assert "def read_lines(path):" in out  # the prompt and its completion, printed once
    bars = [line for line in out.splitlines() if line.strip().startswith("draft ")]
    from dflash_compile import DFlashDraftModel
    from dflash_compile.assets import default_pair_paths

    assert len(bars) == DFlashDraftModel.from_pretrained(default_pair_paths()[1]).config.block_size - 1


def test_demo_errors():
    r = subprocess.run([sys.executable, DEMO, "--target", "x"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--target and --draft go together" in r.stderr
