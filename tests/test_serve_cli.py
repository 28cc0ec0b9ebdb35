"""The ``dflash-serve`` command line: its refusals, and a subprocess serving a saved pair until SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from serve_support import (  # noqa: F401  (tok: fixtures)
    AutoModelForCausalLM, cli, httpx, MAX_SEQ_LEN, MODEL, openai, PROMPTS, ROOT, tok, _models,
)


# ---------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("args, message", [
    (["--max-batch-size", "0"], "--max-batch-size must be an integer >= 1, got 0"),
    (["--max-queued", "-1"], "--max-queued must be an integer >= 0"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--backend", "tvm"], "--backend must be one of"),
    (["--target", "no/such/dir", "--draft", "no/such/dir"], "--target no/such/dir: no such directory"),
    (["--draft", "."], "--draft / --speculative-config need --target"),
    (["--target", "."], "--target needs --draft or --speculative-config"),
    (["--target", ".", "--speculative-config", "{not json"], "--speculative-config is not JSON"),
    (["--chat-template", "no/such/file.jinja"], "--chat-template no/such/file.jinja: cannot read it"),
])
def test_cli_refuses_bad_arguments(args, message, capsys):
    """One line on stderr and exit status 2, before anything is loaded."""
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_serves_a_saved_pair(tok, tmp_path):
    """``python -m dflash_compile.serve --target T --draft D --port 0``: prints its address, answers, and stops cleanly
    on SIGINT."""
    target, draft = _models(tok)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")  # as the server loads it
    ids = tok(PROMPTS[0]).input_ids
    expected = tok.decode(target.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):],
                          skip_special_tokens=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_compile.serve", "--target", str(tmp_path / "target"),
                             "--draft", str(tmp_path / "draft"), "--port", "0", "--backend", "eager",
                             "--served-model-name", MODEL, "--max-model-len", str(MAX_SEQ_LEN),
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving 'tiny'" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        base = line.split(" on ")[-1].strip()
        assert base.startswith("http://127.0.0.1:")
        assert httpx.get(base + "/health").status_code == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert out.choices[0].text == expected
        assert json.loads(httpx.get(base + "/v1/models").text)["data"][0]["max_model_len"] == MAX_SEQ_LEN
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
