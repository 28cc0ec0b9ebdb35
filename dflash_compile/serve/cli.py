"""``dflash-serve`` (and ``python -m dflash_compile.serve``): an OpenAI-compatible HTTP server over one DFlash pair.

    dflash-serve                                              # the shipped default pair on 127.0.0.1:8000
    dflash-serve --target TARGET_DIR --draft DRAFT_DIR --port 8080 --max-batch-size 16
    dflash-serve --target TARGET_DIR --speculative-config '{"method": "dflash", "model": "DRAFT_DIR"}'

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics. Bad arguments
are one line on stderr and exit status 2, checked before the pair is loaded. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

BACKENDS = ("dflash", "inductor", "dflash_neuron", "eager")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PAIR_NAME = "dflash-default"
SHUTDOWN_GRACE_S = 10  # seconds the server waits for requests in flight once told to stop, then cancels them


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dflash-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair = p.add_argument_group("the pair (default: the shipped default pair)")
    pair.add_argument("--target", help="HF causal LM directory (with its tokenizer)")
    pair.add_argument("--draft", help="DFlash drafter directory")
    pair.add_argument("--speculative-config", help='vLLM-style JSON instead of --draft, e.g. \'{"method": "dflash", '
                                                   '"model": "DRAFT_DIR", "num_speculative_tokens": 4}\'')
    pair.add_argument("--tokenizer", help="tokenizer directory (default: --target)")
    pair.add_argument("--chat-template", help="a Jinja chat template file (default: the tokenizer's own, if any)")
    pair.add_argument("--dtype", default="float32", choices=DTYPES)
    pair.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    pair.add_argument("--max-model-len", type=int, default=None,
                      help="tokens per request, prompt included (default: the wrapper's, min(target positions, 2048))")
    pair.add_argument("--backend", default="dflash", help=f"compile backend: one of {', '.join(BACKENDS)} "
                                                          f"(eager: no compile)")
    pair.add_argument("--precompile", action="store_true",
                      help="compile every step graph before serving (default: they all start compiling on a "
                           "background thread at start-up, and the eager step serves until each is ready)")
    pair.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                      help="reuse the KV pages of prompts' shared prefixes (default: on; off for targets with "
                           "recurrent-state layers, said in the log)")
    srv = p.add_argument_group("serving")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="0: any free port (the address is printed)")
    srv.add_argument("--served-model-name", help=f"the model name clients send (default: --target as given, or "
                                                 f"{DEFAULT_PAIR_NAME!r} for the shipped pair)")
    srv.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    srv.add_argument("--max-queued", type=int, default=256,
                     help="requests that may wait for a batch row; one more is answered 429 with Retry-After")
    srv.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DFLASH_API_KEY, else none)")
    srv.add_argument("--metrics-prefix", default="dflash",
                     help="prefix of the Prometheus metric names ('vllm' makes vLLM's dashboards read them)")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def _check(p: argparse.ArgumentParser, args) -> None:
    """Everything that can be checked without torch."""
    if args.backend not in BACKENDS:
        p.error(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    for flag, ok, wanted in (("--port", 0 <= args.port <= 65535, "in [0, 65535]"),
                             ("--max-batch-size", args.max_batch_size >= 1, "an integer >= 1"),
                             ("--max-queued", args.max_queued >= 0, "an integer >= 0"),
                             ("--max-model-len", args.max_model_len is None or args.max_model_len >= 2,
                              "an integer >= 2")):
        if not ok:
            p.error(f"{flag} must be {wanted}, got {getattr(args, flag[2:].replace('-', '_'))}")
    if args.draft and args.speculative_config:
        p.error("--draft and --speculative-config both name the drafter: give one")
    if (args.draft or args.speculative_config) and not args.target:
        p.error("--draft / --speculative-config need --target")
    if args.target and not (args.draft or args.speculative_config):
        p.error("--target needs --draft or --speculative-config")
    for flag in ("--target", "--draft", "--tokenizer"):
        path = getattr(args, flag[2:])
        if path and not os.path.isdir(path):
            p.error(f"{flag} {path}: no such directory")
    if args.speculative_config:
        try:
            json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            p.error(f"--speculative-config is not JSON: {e}")
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                args.chat_template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--chat-template {args.chat_template}: cannot read it: {e}")


def _require_serving_packages(p: argparse.ArgumentParser) -> None:
    missing = []
    for module in ("starlette", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        p.error(f"the server needs {', '.join(missing)}: pip install 'dflash_compile[serve]'")


def load_engine(p: argparse.ArgumentParser, args):
    """Load the pair and its tokenizer, build the wrapper (compiled with ``--backend``) and the ``Engine``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
    from dflash_compile.runtime.target_check import check_tokenizer

    from .engine import Engine
    from .metrics import Metrics

    name = args.served_model_name or args.target
    if not args.target:
        from dflash_compile.assets import default_pair_paths

        try:
            args.target, args.draft = (str(d) for d in default_pair_paths())
        except FileNotFoundError as e:
            p.error(f"no --target given and {e}")
        name = args.served_model_name or DEFAULT_PAIR_NAME
    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
        check_tokenizer(tokenizer, target)
    except (OSError, ValueError, RuntimeError) as e:
        p.error(f"--target {args.target}: cannot load it: {e}")
    wrapper = dict(max_batch_size=args.max_batch_size, max_seq_len=args.max_model_len,
                   prefix_caching=args.prefix_caching)
    try:
        if args.speculative_config:
            spec = DFlashSpecWrapper.from_speculative_config(target, args.speculative_config, **wrapper)
        else:
            draft = DFlashDraftModel.from_pretrained(args.draft, dtype=dtype, device=device)
            spec = DFlashSpecWrapper(target, draft, **wrapper)
    except (OSError, ValueError) as e:
        p.error(f"{'--speculative-config' if args.speculative_config else '--draft'}: {e}")
    if args.backend != "eager":
        spec.compile(backend=args.backend, on_miss="compile" if args.precompile else "background")
        # every graph the server may step through, before the first request: compiled or loaded now
        # (--precompile), or on background threads while the eager step serves
        spec.compiled_steps.ready(spec.max_batch_size, "both")
    return Engine(spec, tokenizer, name, max_queued=args.max_queued, chat_template=args.chat_template,
                  metrics=Metrics(name, prefix=args.metrics_prefix))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(engine, sock: socket.socket, *, api_key: str | None = None, log_level: str = "info") -> None:
    """Serve ``engine`` on ``sock`` until SIGINT/SIGTERM (uvicorn's handlers), then stop: requests still running
    after ``SHUTDOWN_GRACE_S`` are cancelled, and this returns once the wrapper's scheduler is idle (the wrapper stays
    open; a graph still compiling in the background is left to its daemon thread)."""
    import uvicorn

    from .app import create_app

    config = uvicorn.Config(create_app(engine, api_key=api_key), log_level=log_level,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.cancel_all()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while not engine.spec.scheduler.idle() and time.monotonic() < deadline:
            time.sleep(0.05)


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    _check(p, args)
    _require_serving_packages(p)
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        p.error(f"--host {args.host} --port {args.port}: cannot listen there: {e.strerror or e}")
    engine = load_engine(p, args)
    spec = engine.spec
    print(f"dflash-serve: serving {engine.model_name!r} (block size {spec.block_size}, max batch "
          f"{spec.max_batch_size}, {spec.max_seq_len} tokens per request, backend {args.backend}) on {url(sock)}",
          flush=True)
    try:
        serve(engine, sock, api_key=args.api_key, log_level=args.log_level)
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on: the shutdown is done, exit 0
        pass
