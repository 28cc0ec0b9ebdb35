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


def _run(*args, default_pair=False):
    """The CLI on the tiny code pair (a fast trained pair), or with ``default_pair`` on what it picks by itself."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not default_pair and "--target" not in args:
        from dflash_compile.assets import tiny_pair_paths

        args = ("--target", str(tiny_pair_paths()[0]), "--draft", str(tiny_pair_paths()[1]), *args)
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.8", "--seed", "1", "--stream"]], ids=["greedy", "stream"])
def test_cli_runs(extra):
    r = _run("--prompt", "def fib(n):", "--max-new-tokens", "32", *extra, default_pair=True)
    assert r.returncode == 0, r.stderr
    assert ("default pair" if _cli()._default_pair_dirs() else "RANDOMLY INITIALISED random pair") in r.stdout
    assert "tokens/s" in r.stdout and "acceptance length" in r.stdout and "accepted per draft position" in r.stdout
    assert "new tokens in" in r.stdout


def test_cli_greedy_text_is_the_targets():
    """What the CLI prints for a greedy request is the target's own greedy continuation, decoded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_compile.assets import tiny_pair_paths

    prompt, new = "def fib(n):", 32
    r = _run("--prompt", prompt, "--max-new-tokens", str(new))
    assert r.returncode == 0, r.stderr
    target_dir = tiny_pair_paths()[0]
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.tensor([tok(prompt).input_ids])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    printed = r.stdout.split("--- [0] finish reason: ")[1].split("\n", 1)[1].split("\n\n" + str(ref.shape[1] - ids.shape[1]))[0]
    assert printed == tok.decode(ref[0].tolist(), skip_special_tokens=True)


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


def _bad_input(*args):
    """Runs the CLI on bad input: exit status 2, no traceback, and one line on stderr (after the progress bars of
    weight loading, for errors found once the pair is loaded), which is returned."""
    r = _run(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("generate.py: error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be an integer >= 1, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value: 'many'"),
    (["--temperature", "-2"], "--temperature must be a number >= 0 (0: greedy), got -2.0"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--top-k", "-1"], "--top-k must be an integer >= 0 (0: off), got -1"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1] (1: off), got 1.5"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--block-size", "1"], "--block-size must be an integer >= 2, got 1"),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be an integer >= 0"),
    (["--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (["--backend", "tensorrt"], "--backend: unknown backend 'tensorrt'"),
    (["--prompt", ""], "--prompt is empty"),
    (["--target", "/no/such/dir", "--draft", "/no/such/dir"], "--target /no/such/dir: no such directory"),
    (["--prompts-file", "/no/such/prompts.jsonl"], "--prompts-file /no/such/prompts.jsonl: cannot read it: No such"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_cli_bad_arguments(args, message):
    assert message in _bad_input(*args)


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "ab"}\n{"prompt": "cd"\n', ':2: not JSON: Expecting \',\' delimiter'),
    ('{"prompt": "ab"}\n\n{"text": "cd"}\n', ':3: no "prompt" field'),
    ('{"prompt": 5}\n', ':1: expected {"prompt": "..."} or a JSON string, got int'),
    ('["ab"]\n', ':1: expected {"prompt": "..."} or a JSON string, got list'),
    ('"ab"\n{"prompt": ""}\n', ":2: the prompt is empty"),
    ("\n\n", ": no prompts in it"),
    (b"\xff\xfe\n", ": not UTF-8 text"),
    (None, ": cannot read it: Is a directory"),
], ids=["bad-json", "no-prompt", "not-a-string", "a-list", "empty-prompt", "empty-file", "not-utf8", "a-directory"])
def test_cli_bad_prompts_file(tmp_path, content, message):
    f = tmp_path / "prompts.jsonl"
    if content is None:
        f.mkdir()
    elif isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content)
    assert f"--prompts-file {f}{message}" in _bad_input("--prompts-file", str(f))


def test_cli_bad_input_found_once_loaded(tmp_path):
    """Errors that need the pair: K beyond the drafter's block, a directory without a model, a prompt too long."""
    assert "--num-speculative-tokens must be in [0, " in _bad_input("--num-speculative-tokens", "99")
    assert "--target: cannot load it: " in _bad_input("--target", str(tmp_path), "--draft", str(tmp_path))
    assert "--prompt: prompt 0 has" in _bad_input("--prompt", "a" * 5000, "--max-new-tokens", "2")


DEMO = os.path.join(ROOT, "examples", "demo.py")


def test_demo_shows_both_methods_side_by_side():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, DEMO, "--backend", "eager", "--max-new-tokens", "24", "--runs", "1"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "the shipped default pair (SmolLM2-135M-Instruct" in out and "identical output: yes" in out
    assert "HF generate, greedy" in out and "DFlash, eager" in out and "speed-up" in out
    assert "user: Explain how photosynthesis works" in out and "assistant: " in out  # the chat, printed once
    bars = [line for line in out.splitlines() if line.strip().startswith("draft ")]
    from dflash_compile import DFlashDraftModel
    from dflash_compile.assets import default_pair_paths

    assert len(bars) == DFlashDraftModel.from_pretrained(default_pair_paths()[1]).block_size - 1


def test_demo_errors():
    r = subprocess.run([sys.executable, DEMO, "--target", "x"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--target and --draft go together" in r.stderr
