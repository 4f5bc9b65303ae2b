"""The parent's side of ``bench_node.py``'s processes: one measurement's rank processes, released
together, the weight-cache daemons an ``ipc_cache`` restart maps, and the page cache set for a row."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from node_forms import Shape, skip_reason

REPO = Path(__file__).resolve().parent.parent
BENCH_NODE = Path(__file__).with_name("bench_node.py")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a process the benchmark starts: this repository and the engine harness importable."""
    path = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(REPO), str(REPO / "tests" / "engines")])
    return {**os.environ, "PYTHONPATH": path, **extra}


#: Where ``--quick`` forks its processes from (node_zygote.py); ``None``: each a fresh interpreter.
ZYGOTE: Any = None


def launch(cmd: list[str], env: dict[str, str], err: Any, stdin: bool) -> subprocess.Popen:
    """``cmd`` (``python SCRIPT ARGS``) started: its stdout a pipe, its stderr ``err``, its stdin a pipe
    (or the parent's); forked from :data:`ZYGOTE` where there is one."""
    if ZYGOTE is not None:
        return ZYGOTE.spawn(cmd, env, err, stdin)
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE,
                            stderr=err, text=True)


def gpu_of(rank: int, gpus: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": str(rank % gpus)} if gpus else {}


class Ranks:
    """One measurement's rank processes: spawned with the rest of their batch, each reporting
    ready on its protocol pipe, then released at once. A form or ceiling this machine cannot run
    (:func:`node_forms.skip_reason`) starts no process: its rows say why."""

    #: Why the processes never became ready (:meth:`settle`), or ``None``.
    error: str | None = None

    def __init__(self, kind: str, shape: Shape, work: Path, gpus: int, n: int, threads: int,
                 fingerprint: bool) -> None:
        self.kind, self.shape, self.n = kind, shape, n
        self.procs: list[subprocess.Popen] = []
        self.skipped = skip_reason(kind)
        if self.skipped:
            return
        try:
            for rank in [0] if kind == "disk_read" else range(n):
                cmd = [sys.executable, str(BENCH_NODE), "--child", kind, "--rank", str(rank), "--shape",
                       shape.to_json(), *(["--fingerprint"] if fingerprint else [])]
                log = work / "logs" / f"{shape.name}-{kind}-r{rank}-{time.time_ns()}.err"
                with open(log, "w") as err:
                    proc = launch(cmd, child_env({"OMP_NUM_THREADS": str(threads), **gpu_of(rank, gpus)}), err, True)
                proc.err_path = str(log)  # type: ignore[attr-defined]
                self.procs.append(proc)
        except BaseException:
            self.kill()
            raise

    def _line(self, proc: subprocess.Popen, timeout: float = 900) -> str:
        if not select.select([proc.stdout], [], [], timeout)[0]:
            self.kill()
            raise RuntimeError(f"{self.kind}: no answer within {timeout:.0f} s (stopped)")
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            proc.wait()
            raise RuntimeError(f"{self.kind} rank process ended ({proc.returncode}):\n"
                               f"{Path(proc.err_path).read_text()[-3000:]}")  # type: ignore[attr-defined]
        return line

    def settle(self) -> None:
        """Wait until every rank is built and ready; a failure is kept (:attr:`error`), the
        processes stopped, for its measurement to report in its turn."""
        try:
            for proc in self.procs:
                if self._line(proc).strip() != "ready":
                    raise RuntimeError(f"{self.kind}: expected 'ready'")
        except RuntimeError as e:
            self.error = str(e)[-1500:]
            self.kill()

    def go(self, timeout: float) -> list[dict[str, Any]]:
        """Release every rank (each is blocked on its stdin: one write each) and collect their reports."""
        if self.skipped:
            return [{"rank": rank, "skipped": self.skipped} for rank in range(self.n)]
        for proc in self.procs:
            proc.stdin.write("go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        deadline = time.time() + timeout
        reports = [json.loads(self._line(proc, max(1.0, deadline - time.time()))) for proc in self.procs]
        for proc in self.procs:
            proc.wait()
        return reports

    def kill(self) -> None:
        stop(self.procs)


def daemons(shape: Shape, work: Path, gpus: int, n: int, restarts: list[str] | None = None) -> list[subprocess.Popen]:
    """One weight-cache daemon per rank: vLLM's loading the per-rank form (``megamoe preload``'s path), or
    SGLang's loading the source."""
    procs: list[subprocess.Popen] = []
    try:
        for rank, restart in [(r, k) for r in range(n) for k in restarts or ["ipc_cache"]]:
            cmd = [sys.executable, str(REPO / "benchmarks" / "bench_daemon.py"), "--role", "daemon", "--model",
                   str(shape.per_rank), "--rank", str(rank), "--ep-size", str(shape.ep_size),
                   "--socket-dir", shape.socket_dir(rank)]
            if shape.engine == "sglang":  # SGLang's daemon for that restart form (node_forms_sglang.daemon_main)
                cmd = [sys.executable, str(BENCH_NODE), "--child", restart, "--daemon", "--rank", str(rank),
                       "--shape", shape.to_json()]
            log = work / "logs" / f"{shape.name}-daemon-{restart}-r{rank}.err"
            with open(log, "w") as err:
                proc = launch(cmd, child_env(gpu_of(rank, gpus)), err, False)
            proc.err_path = str(log)  # type: ignore[attr-defined]
            procs.append(proc)
    except BaseException:
        stop(procs)
        raise
    return procs


def daemons_ready(procs: list[subprocess.Popen]) -> None:
    """Every daemon's first report (its experts loaded); on a failure, every daemon stopped."""
    from bench_daemon import first_json

    try:
        for proc in procs:
            first_json(proc, 600)
    except (RuntimeError, ValueError):
        stop(procs)
        raise


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def drop_page_cache() -> bool:
    from common import drop_page_cache as drop

    return drop()


def warm(files: list[Path], reads: int) -> None:
    """``files`` read ``reads`` times just before a warm row: with two, every warm row finds its files
    read before and read again, the same page-cache history whatever the step before it read."""
    from bench_startup import warm as read_all

    for _ in range(reads):
        read_all(files)
