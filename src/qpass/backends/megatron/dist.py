"""Process layout of a tensor-parallel Megatron learner: the calling process is TP rank 0 and drives;
ranks 1..TP-1 are spawned worker processes that execute rank 0's commands in lockstep.

::

    rank 0 (the qpass process: trainer, rollout engine)      ranks 1..TP-1 (spawned, daemon)
      send(("forward", args))  --- control group (gloo) --->   recv() -> same handler
      handler(...)             <== compute group (gloo/NCCL) ==> handler(...)   (Megatron's collectives)

* **Groups.** The default process group (``gloo`` on CPU, ``nccl`` on CUDA; rendezvous through a
  file in a private temporary directory) carries Megatron's collectives and has the collective
  timeout ``timeout_s``; a second ``gloo`` group carries the pickled commands and has a long
  timeout (a worker waits there while rank 0 samples rollouts).
* **A rank that dies.** Before every command rank 0 checks that its workers are alive, and a
  failed or timed-out collective is reported the same way: :class:`MegatronRankError` naming the
  rank(s) and their exit codes. Rank 0 then kills the remaining workers (its own child processes,
  by process handle). Workers exit on their own when rank 0 goes away (a watchdog thread polls
  the parent pid) or when a collective times out.
* Workers are ``python -m qpass.backends.megatron.dist RANK DEVICE WORKDIR`` subprocesses (not
  ``multiprocessing``: nothing of the caller's ``__main__`` is re-imported); their stderr is the
  caller's.
* TP = 1 runs in-process (world size 1, no workers).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from qpass.errors import QpassError

__all__ = ["MegatronRankError", "TPRuntime", "start_tp"]

log = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 24 * 3600.0


class MegatronRankError(QpassError, RuntimeError):
    """A tensor-parallel rank died or a collective timed out (the message names the rank)."""


class TPRuntime:
    """One rank's view of the tensor-parallel group (see module docstring).

    Attributes:
        rank, world: this rank and the TP size.
        device: ``cpu`` or ``cuda:<local rank>``.
        workdir: private temporary directory (rendezvous file, initial weights); rank 0 removes it.
    """

    def __init__(self, rank: int, world: int, device: torch.device, workdir: str, timeout_s: float) -> None:
        self.rank, self.world, self.device, self.workdir, self.timeout_s = rank, world, device, workdir, timeout_s
        self.procs: list[Any] = []  # rank 0: worker processes, index r-1 = rank r
        self.control = None
        self.closed = False

    # ------------------------------------------------------------------ setup
    def init(self) -> None:
        """Join the process groups and initialize Megatron's model-parallel state (TP = world)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if dist.is_initialized():
            raise QpassError("torch.distributed is already initialized in this process; the Megatron learner "
                             "starts its own tensor-parallel group (close the other one first)")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{os.path.join(self.workdir, 'rendezvous')}", rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=self.timeout_s))
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
        ps.initialize_model_parallel(tensor_model_parallel_size=self.world)

    def shutdown(self) -> None:
        """Leave the groups (idempotent); rank 0 also stops its workers and removes ``workdir``."""
        if self.closed:
            return
        self.closed = True
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.rank == 0 and self.world > 1 and self.alive_workers() == self.world - 1:
            try:
                self.send(("stop", ()))
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        for p in self.procs:
            _wait(p, 10)
        self._abort()
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.rank == 0:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ liveness
    def alive_workers(self) -> int:
        return sum(1 for p in self.procs if p.poll() is None)

    def dead_ranks(self) -> list[str]:
        """``"rank R (exit code C)"`` for every worker that has exited (rank 0 only)."""
        return [f"rank {r + 1} (exit code {p.returncode})" for r, p in enumerate(self.procs) if p.poll() is not None]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..world-1 (rank 0 only)."""
        return [p.pid for p in self.procs]

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise :class:`MegatronRankError` if a worker has exited (waits up to ``grace_s`` for one to
        be reaped after a failed collective)."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = self.dead_ranks()
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if dead:
            self.shutdown()
            raise MegatronRankError(f"Megatron tensor-parallel {', '.join(dead)} died; the learner is stopped "
                                    f"(TP={self.world})")

    def _abort(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            _wait(p, 5)

    def guard(self, what: str) -> "_Guard":
        """Context manager for rank 0: a failing collective becomes :class:`MegatronRankError`."""
        return _Guard(self, what)

    # ------------------------------------------------------------------ commands
    def send(self, msg: Any) -> None:
        """Rank 0: broadcast a command to the workers (no-op at TP = 1)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        self.check_alive()
        with self.guard(f"sending {msg[0]!r}"):
            dist.broadcast_object_list([msg], src=0, group=self.control)

    def recv(self) -> Any:
        """Workers: the next command from rank 0."""
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


class _Guard:
    def __init__(self, rt: TPRuntime, what: str) -> None:
        self.rt, self.what = rt, what

    def __enter__(self) -> "_Guard":
        return self

    def __exit__(self, et, ev, tb) -> bool:  # noqa: ANN001
        if ev is None or self.rt.rank != 0 or self.rt.world == 1 or isinstance(ev, MegatronRankError):
            return False
        if isinstance(ev, (RuntimeError, OSError)) or type(ev).__name__ in ("DistBackendError", "DistNetworkError"):
            self.rt.check_alive(grace_s=5.0)
            self.rt.shutdown()
            raise MegatronRankError(f"Megatron tensor-parallel collective failed while {self.what} "
                                    f"(TP={self.rt.world}; no rank has exited, likely a timeout after "
                                    f"{self.rt.timeout_s:.0f} s): {ev}") from ev
        return False


def _wait(p: Any, timeout: float) -> None:
    import subprocess

    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def _watch_parent(ppid: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != ppid:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="qpass-megatron-parent-watch").start()


def worker_main(argv: list[str] | None = None) -> None:
    """Entry of a worker process: ``python -m qpass.backends.megatron.dist RANK DEVICE WORKDIR``
    (the rest of its arguments are in ``WORKDIR/launch.pkl``, written by :func:`start_tp`)."""
    import pickle

    rank_s, device, workdir = (sys.argv[1:] if argv is None else argv)[:3]
    with open(os.path.join(workdir, "launch.pkl"), "rb") as f:
        launch = pickle.load(f)  # noqa: S301 - written by our own parent process in its private directory
    _worker_entry(int(rank_s), launch["world"], device, workdir, launch["timeout_s"], launch["ppid"], launch["target"],
                  launch["payload"])


def _worker_entry(rank: int, world: int, device: str, workdir: str, timeout_s: float, ppid: int,
                  target: Callable[[TPRuntime, Any], None], payload: Any) -> None:
    _watch_parent(ppid)
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, int(os.environ.get("QPASS_MEGATRON_THREADS", "1"))))
    rt = TPRuntime(rank, world, torch.device(device), workdir, timeout_s)
    code = 0
    try:
        rt.init()
        target(rt, payload)
    except BaseException:  # noqa: BLE001 - the traceback goes to stderr, the exit code to rank 0
        traceback.print_exc(file=sys.stderr)
        code = 1
    finally:
        try:
            rt.shutdown()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def start_tp(tp: int, *, device: str | torch.device, timeout_s: float, worker: Callable[[TPRuntime, Any], None],
             payload: Any) -> TPRuntime:
    """Start a TP group with this process as rank 0.

    Args:
        tp: tensor-parallel size (>= 1); ``tp - 1`` worker processes are started.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL; rank r uses ``cuda:r``).
        timeout_s: collective timeout (seconds).
        worker: ``worker(runtime, payload)`` run on each worker rank after it joined the groups (a
            module-level function: it is pickled).
        payload: picklable argument of ``worker``.
    Returns:
        rank 0's :class:`TPRuntime` (joined, Megatron state initialized).
    Raises:
        MegatronRankError: a worker died while the group formed.
    """
    import pickle
    import subprocess

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    if dev.type == "cuda" and tp > torch.cuda.device_count():
        raise QpassError(f"TP={tp} needs {tp} CUDA devices, {torch.cuda.device_count()} visible")
    workdir = tempfile.mkdtemp(prefix="qpass-megatron-")
    atexit.register(shutil.rmtree, workdir, True)  # also when the caller never closes the learner
    rt = TPRuntime(0, tp, dev, workdir, timeout_s)
    try:
        with open(os.path.join(workdir, "launch.pkl"), "wb") as f:
            pickle.dump({"world": tp, "timeout_s": timeout_s, "ppid": os.getpid(), "target": worker, "payload": payload}, f)
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = os.pathsep.join([src, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        for r in range(1, tp):
            wdev = f"cuda:{r}" if dev.type == "cuda" else "cpu"
            rt.procs.append(subprocess.Popen([sys.executable, "-m", "qpass.backends.megatron.dist", str(r), wdev, workdir],
                                             env=env, stdin=subprocess.DEVNULL))
        with rt.guard("forming the group"):
            rt.init()
    except BaseException:
        rt._abort()  # noqa: SLF001
        if rt.procs and rt.dead_ranks():
            shutil.rmtree(workdir, ignore_errors=True)
            raise MegatronRankError(f"Megatron tensor-parallel {', '.join(rt.dead_ranks())} died while the group formed") from None
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return rt


if __name__ == "__main__":
    worker_main()
