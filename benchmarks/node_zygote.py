"""``bench_node.py --quick``'s processes, forked from one that imported the engine once.

A CPU smoke run times nothing; what it proves is that every form's rank processes are built, released
together and load the same bytes. Each of them importing the engine afresh costs seconds of CPU apiece,
and a smoke run starts a dozen: here one process (the zygote) imports the engine's modules once, then
forks every rank process and daemon the run asks for. Each fork is still a process of its own: its own
stdin, stdout and log, its environment, its script run as ``__main__`` from the top (so every patch and
plugin registration of a form happens in it, never in the zygote). A full run starts fresh interpreters
(node_procs), as a node's ranks start, and times their imports.

The protocol, on a Unix socket: a request is one JSON line with the file descriptors the fork gets as
stdin, stdout, stderr and its exit-status pipe (``socket.send_fds``); the zygote answers the pid. A
``{"kill": pid}`` request ends a fork the zygote has not yet reaped (a pid reaped is never signalled).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any, Iterator

#: engine -> the modules its forms' processes import (their import is what the forks share).
PRELOAD = {"vllm": ("vllm_harness", "bench_daemon", "vllm.config", "vllm.model_executor.model_loader",
                    "vllm.plugins", "megamoe_convert.engines.vllm"),
           "sglang": ("node_forms_sglang",)}


def preload(engine: str) -> None:
    """The engine's modules, imported as its rank processes import them."""
    import importlib

    for name in PRELOAD[engine]:
        importlib.import_module(name)
    if engine == "sglang":
        sys.modules["node_forms_sglang"].import_sglang()  # imported as without CUDA, as each rank does


# --------------------------------------------------------------------------------------
# The zygote's side
# --------------------------------------------------------------------------------------

class Zygote:
    """Forks on request; reaps its forks, writing each one's exit code into its status pipe."""

    def __init__(self) -> None:
        self.status: dict[int, int] = {}  # pid -> its status pipe, until reaped
        self.lock = threading.Lock()
        threading.Thread(target=self.reap, daemon=True).start()

    def reap(self) -> None:
        while True:
            try:  # a fork that ended, left unreaped: kill() may still signal it (a zombie) meanwhile
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                threading.Event().wait(0.05)
                continue
            if ended is None:
                continue
            with self.lock:  # reaped and forgotten at once: kill() never signals a reaped pid
                pid, status = os.waitpid(ended.si_pid, 0)
                fd = self.status.pop(pid, None)
            if fd is not None:
                os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
                os.close(fd)

    def fork(self, request: dict[str, Any], fds: list[int], listener: socket.socket, conn: socket.socket) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        with self.lock:  # recorded before the reaper can see it end
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for fd in self.status.values():  # the other forks' status pipes
                    os.close(fd)
                run_child(request, fds)  # never returns
            self.status[pid] = fds[3]
        for fd in fds[:3]:
            os.close(fd)
        return pid

    def kill(self, pid: int) -> None:
        with self.lock:
            if pid in self.status:
                os.kill(pid, signal.SIGKILL)


def run_child(request: dict[str, Any], fds: list[int]) -> None:
    """In the fork: its descriptors, environment and arguments, then its script as ``__main__``."""
    code = 1
    try:
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("OMP_NUM_THREADS"):  # read by torch at its import, in the zygote: set again
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.argv = list(request["argv"][1:])
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def zygote_main(engine: str, path: str) -> None:
    """Import, then serve requests on ``path`` until the parent ends this process."""
    preload(engine)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    zygote = Zygote()
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
            request = json.loads(message)
            if "kill" in request:
                zygote.kill(request["kill"])
                conn.sendall(b"{}\n")
            else:
                conn.sendall((json.dumps({"pid": zygote.fork(request, fds, listener, conn)}) + "\n").encode())


# --------------------------------------------------------------------------------------
# The parent's side
# --------------------------------------------------------------------------------------

class Forked:
    """A fork of the zygote, with the part of ``subprocess.Popen``'s surface the benchmark uses."""

    def __init__(self, args: list[str], pid: int, stdin: IO[str] | None, stdout: IO[str] | None, status: int,
                 zygote: "Client") -> None:
        self.args, self.pid, self.stdin, self.stdout = args, pid, stdin, stdout
        self.returncode: int | None = None
        self._status, self._zygote = status, zygote

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            import select

            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            text = os.read(self._status, 16).decode()
            os.close(self._status)
            self.returncode = int(text) if text else -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self._zygote.request({"kill": self.pid})


class Client:
    """The zygote process and the requests made of it."""

    def __init__(self, engine: str, work: Path, env: dict[str, str]) -> None:
        self.path = str(work / "zygote.sock")
        Path(self.path).unlink(missing_ok=True)
        self.log = work / "logs" / "zygote.err"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.started = False
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, engine, self.path], env=env, text=True,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)

    def ready(self) -> None:
        """Wait for the zygote's imports (it imports while the parent converts)."""
        if self.started:
            return
        self.started = True
        if self.proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            self.proc.wait()
            raise RuntimeError(f"the zygote ended ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")

    def request(self, message: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps(message).encode()], fds or [])
            return json.loads(conn.makefile().readline())

    def spawn(self, cmd: list[str], env: dict[str, str], stderr: IO[Any], stdin: bool) -> Forked:
        """``cmd`` (``python SCRIPT ARGS``) forked: its stdin a pipe (or nothing), its stdout a pipe."""
        self.ready()
        stdin_r, stdin_w = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        stdout_r, stdout_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            pid = self.request({"argv": cmd, "env": env}, [stdin_r, stdout_w, stderr.fileno(), status_w])["pid"]
        finally:
            for fd in (stdin_r, stdout_w, status_w):
                os.close(fd)
        return Forked(cmd, pid, os.fdopen(stdin_w, "w") if stdin else None, os.fdopen(stdout_r), status_r, self)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        Path(self.path).unlink(missing_ok=True)


@contextlib.contextmanager
def forking(engine: str, work: Path) -> Iterator[Client]:
    """Every process node_procs starts, forked from a zygote of ``engine`` until the block ends."""
    import node_procs

    client = Client(engine, work, node_procs.child_env({}))
    node_procs.ZYGOTE = client
    try:
        yield client
    finally:
        node_procs.ZYGOTE = None
        client.stop()


if __name__ == "__main__":
    zygote_main(sys.argv[1], sys.argv[2])
