"""Loaded by every process of the generation engine (``EngineOptions.environment`` puts this folder on the
engine's ``PYTHONPATH``; it runs in the engine's own environment, never in the project's).

vLLM 0.32's engine worker busy-waits (``sched_yield`` in a loop) for one second after every message it
reads from the engine core (``shm_broadcast.SpinCondition``, ``busy_loop_s=1``, not configurable). On a GPU
box that second is spare CPU; here the engine and the trainer share the cores, and the trainer starts its
update right after the rollouts: measured on 2 cores (bench/grpo_vs_trl.py --engine vllm_server, 2 x 4 x
16), a GRPO step's update took 1.09 s under the spin against 0.16 s with it cut to 50 ms. 50 ms still
spans the gap between two decode steps (~10-20 ms here), so generation keeps its speed (with no spin at
all each step waited on a socket: 26x slower generation). ``RLRUN_ENGINE_BUSY_LOOP_S`` overrides it.

The patch is applied when vLLM imports the module (an import hook), so processes that never import vLLM
pay nothing.

Every engine process also ends with the process that started the engine (``RLRUN_ENGINE_OWNER_PID``, set
by ``EngineOptions.environment``): a daemon thread waits on a pidfd of the owner (or polls it each second
where there are none) and then kills the engine's process group (the server and the engine core it spawned
share one). A worker or rank killed with -9, or a rank ended by the launcher, would otherwise leave its
engine holding memory, cores and a port.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import select
import signal
import sys
import threading
import time
from typing import Any

TARGET = "vllm.distributed.device_communicators.shm_broadcast"
BUSY_LOOP_S = float(os.environ.get("RLRUN_ENGINE_BUSY_LOOP_S", "0.05"))


def shorten_busy_loop(module: Any) -> None:
    """Make ``SpinCondition``'s default busy-wait ``BUSY_LOOP_S`` (callers pass none)."""
    condition = getattr(module, "SpinCondition", None)
    init = getattr(condition, "__init__", None)
    defaults = getattr(init, "__defaults__", None)
    code = getattr(init, "__code__", None)
    if init is None or code is None or not defaults:
        return  # another vLLM: leave it as it is
    if code.co_varnames[: code.co_argcount][-1:] != ("busy_loop_s",):
        return
    init.__defaults__ = (*defaults[:-1], BUSY_LOOP_S)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module with the other finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            shorten_busy_loop(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if BUSY_LOOP_S < 1:
    sys.meta_path.insert(0, _PatchOnImport())


def end_with_owner(owner: int) -> None:
    """Kill this process's group (the engine: ``EngineProcess`` starts it in a session of its own) once
    process ``owner`` has exited; only this process where the group is the owner's too (a process started
    with the engine's environment but not as an engine must not take its starter's group down)."""
    try:
        shared_group = os.getpgid(owner) == os.getpgid(0)
    except ProcessLookupError:
        shared_group = False
    try:
        fd = os.pidfd_open(owner)
    except (AttributeError, OSError):  # no pidfds (or the owner is already gone: the poll sees it)
        while True:
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            time.sleep(1)
    else:
        select.select([fd], [], [])
    if shared_group:
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os.killpg(os.getpgid(0), signal.SIGKILL)


if os.environ.get("RLRUN_ENGINE_OWNER_PID", "").isdigit():
    _owner = int(os.environ["RLRUN_ENGINE_OWNER_PID"])
    threading.Thread(target=end_with_owner, args=(_owner,), name="rlrun-end-with-owner", daemon=True).start()
