"""Compiling several step graphs at once, one forked process per graph.

A cold start compiles a few graphs (``auto``: two per sampling mode for one row, two for every batch from 2 rows),
each tens of seconds of mostly single-threaded Python (dynamo, the DFlash passes, AOTAutograd, Inductor's code
generation), and ``CompiledSteps`` compiled them one after the other on one core. Each graph is saved to the
compile cache anyway, and a saved graph loads in under a second: so the missing graphs are compiled by child
processes forked from this one, up to ``workers`` at a time, each compiling one key and saving it, and this process
loads what they saved. A fork shares the models (copy-on-write): the children need no paths and load nothing.

Used where it is safe and pays (``parallel_workers``): Linux (``os.fork``), a compile cache (a backend given by name),
models on the CPU (a CUDA context does not survive a fork), no tensor parallelism (a collective group does not
either), two or more graphs to compile and two or more workers. Before forking, this thread's idle OpenMP workers
are released (``openmp.release_idle_team``: a forked child has none of them) and the process-wide tracing lock is
held, so no other thread of this process is inside a trace at the fork; a child compiles with Inductor's compile
pool off (its worker processes belong to the parent) and the heap it inherited frozen (``gc.freeze``: Python's
collector does not walk the parent's objects again in every full collection of a short-lived child). A child that
fails (an exception, a crash) leaves its key missing: it is compiled here as before, and the failure is said in one
line.

``workers``: ``spec.compile(..., workers=N)``; default ``$DFLASH_COMPILE_WORKERS``, else the CPUs this process may
run on.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import sys
import time


log = logging.getLogger(__name__)

WORKERS_ENV = "DFLASH_COMPILE_WORKERS"


def default_workers() -> int:
    """``$DFLASH_COMPILE_WORKERS``, else the CPUs this process may run on."""
    env = os.environ.get(WORKERS_ENV)
    if env:
        return check_workers(int(env) if env.strip().isdigit() else env, WORKERS_ENV)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_workers(workers, name: str = "workers") -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"{name} must be a positive number of processes, got {workers!r}")
    return workers


def parallel_workers(steps, keys: list) -> int:
    """How many child processes compile ``keys`` (1: compile them here, one after the other)."""
    if len(keys) < 2 or steps.workers < 2 or sys.platform != "linux" or not hasattr(os, "fork"):
        return 1
    spec = steps.spec
    if steps.folder() is None or spec.tp is not None:
        return 1
    if any(p.device.type != "cpu" for m in (spec.target, spec.draft) for p in m.parameters()):
        return 1
    return min(steps.workers, len(keys))


def compile_in_workers(steps, keys: list, workers: int, done) -> dict:
    """Compile and save ``keys`` in up to ``workers`` forked children at a time, longest first as listed; ``done(key,
    seconds or None)`` is called as each ends (None: it failed). Returns ``{key: the child's seconds}`` for the keys
    whose graph a child saved."""
    from . import openmp

    steps.folder()  # settled before the fork: children save where this process loads
    if steps.vec_isa_record() is not None:
        from . import vec_isa

        vec_isa.probe()  # here, once, rather than in every child (vec_isa.py)
    queue, running, saved = list(keys), {}, {}
    try:
        while queue or running:
            while queue and len(running) < workers:
                key = queue.pop(0)
                read, write = os.pipe()
                openmp.release_idle_team()
                sys.stdout.flush()  # else the child would write this process's buffered output a second time
                sys.stderr.flush()
                with steps.tracing():  # no other thread of this process is inside a trace at the fork
                    pid = os.fork()
                if pid == 0:  # the child: never returns
                    os.close(read)
                    _child(steps, key, write)
                os.close(write)
                running[pid] = (key, read)
            poll = select.poll()  # not select(): a server's pipes may be numbered past FD_SETSIZE
            for _, r in running.values():
                poll.register(r, select.POLLIN | select.POLLHUP)
            ready = poll.poll()
            pid = next(p for p, (_, r) in running.items() if r == ready[0][0])
            key, read = running.pop(pid)
            with os.fdopen(read, "rb") as f:  # the child's reply, then end of file when it exits
                reply = f.read()
            _, status = os.waitpid(pid, 0)  # this child alone: the process's other children are not reaped here
            seconds = None
            try:
                answer = json.loads(reply) if reply else {"error": f"the process ended ({_status(status)})"}
            except ValueError:
                answer = {"error": f"unreadable reply ({_status(status)})"}
            if answer.get("seconds") is not None and os.waitstatus_to_exitcode(status) == 0:
                seconds = saved[key] = answer["seconds"]
                _merge(answer["metrics"])
            else:
                log.warning("dflash: compiling %s in a worker process failed (%s); compiling it here", key,
                            answer.get("error", _status(status)))
            done(key, seconds)
    finally:
        for pid, (_, read) in running.items():  # interrupted: the children go too
            try:
                os.kill(pid, signal.SIGKILL)  # not SIGTERM: a handler installed here (a server's) runs there too
                os.waitpid(pid, 0)
            except OSError:
                pass
            os.close(read)
    return saved


def _metrics() -> dict:
    """What a compile adds to, as plain data: dynamo's counters (the DFlash passes count under ``"dflash"``) and
    torch's compile-phase timers (``compilation_time_metrics``)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"counters": {c: dict(v) for c, v in counters.items()},
            "times": {k: list(v) for k, v in compilation_time_metrics.items()}}


def _since(before: dict) -> dict:
    """What this process's compile added to ``_metrics()`` since ``before``."""
    now = _metrics()
    counts = {c: {k: n - before["counters"].get(c, {}).get(k, 0) for k, n in v.items()}
              for c, v in now["counters"].items()}
    times = {k: v[len(before["times"].get(k, ())):] for k, v in now["times"].items()}
    return {"counters": {c: {k: n for k, n in v.items() if n} for c, v in counts.items() if any(v.values())},
            "times": {k: v for k, v in times.items() if v}}


def _merge(added: dict) -> None:
    """A child's compile counted here, as if it had run here: the counters and phase timers a user or test reads."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    for c, v in added["counters"].items():
        for k, n in v.items():
            counters[c][k] += n
    for k, v in added["times"].items():
        compilation_time_metrics.setdefault(k, []).extend(v)


def _status(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _child(steps, key, write: int) -> None:
    """In a forked child: compile ``key`` (which saves it), write ``{"seconds": ...}`` or ``{"error": ...}`` to
    ``write``, and leave without running the parent's exit handlers."""
    code = 1
    try:
        steps.renew_tracing()  # held by the parent's forking thread: a fresh one here
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1  # the parent's compile pool is not this process's
        gc.freeze()  # the heap inherited from the parent lives until this process ends: no collection walks it
        steps.listeners = []  # the parent's scheduler is not here
        args, kwargs = steps.keys.example(key)
        before = _metrics()
        start = time.perf_counter()
        steps._compile(key, args, kwargs)
        seconds = time.perf_counter() - start
        saved = (steps.folder() / key.filename).exists()
        reply = {"seconds": seconds, "metrics": _since(before)} if saved else {"error": "the graph was not saved"}
        code = 0
    except BaseException as e:  # said by the parent
        reply = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    try:
        os.write(write, json.dumps(reply).encode())
        os.close(write)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
