"""Loaded by every process of the generation engine (``EngineOptions.environment`` puts this folder on the
engine's ``PYTHONPATH``; it runs in the engine's own environment, never in the project's).

vLLM 0.32's engine worker busy-waits (``sched_yield`` in a loop) for one second after every message it
reads from the engine core (``shm_broadcast.SpinCondition``, ``busy_loop_s=1``, not configurable). On a GPU
box that second is spare CPU; here the engine and the trainer share the cores, and the trainer starts its
update right after the rollouts: measured on 2 cores (bench/grpo_vs_trl.py --engine vllm_server, 2 x 4 x
16), a GRPO step's update took 1.09 s under the spin against 0.16 s with it cut to 50 ms. 50 ms still
spans the gap between two decode steps (~10-20 ms here), so generation keeps its speed (with no spin at
all each step waited on a socket: 26x slower generation). ``RLRUN_ENGINE_BUSY_LOOP_S`` overrides it.

vLLM's server starts its engine core as a spawned process (its CLI sets ``VLLM_WORKER_MULTIPROC_METHOD=
spawn``, and ``CpuPlatform.check_and_update_config`` sets it again): a fresh interpreter that imports vLLM
again, ~4.5 s of each engine's start here. With the model in the engine core (``--distributed-executor-
backend uni``: no worker processes, whose OpenMP pools are what spawning protects) the core is forked
instead, as vLLM's library (``LLM``) does by default. Measured on tiny:llama-0.4m (2-core AMD EPYC, two runs
each): the engine answered /health after 7.5 s forked against 11.5-12.0 s spawned, and generated as fast.
At the fork the server runs two threads, its main one and the owner watch below (in a blocking wait,
holding nothing); the forked core starts its own watch.
``RLRUN_ENGINE_FORK_CORE=0``, or any ``VLLM_WORKER_MULTIPROC_METHOD`` given to the engine, keeps vLLM's way.

Both patches are applied when vLLM imports their module (an import hook), so processes that never import
vLLM pay nothing.

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

SPIN_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
CPU_PLATFORM_MODULE = "vllm.platforms.cpu"
BUSY_LOOP_S = float(os.environ.get("RLRUN_ENGINE_BUSY_LOOP_S", "0.05"))
FORK_CORE = os.environ.get("RLRUN_ENGINE_FORK_CORE", "1") != "0"
CHOSEN_METHOD = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")  # as the engine was started, before vLLM's


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


def fork_engine_core(module: Any) -> None:
    """Make ``CpuPlatform.check_and_update_config`` set the start method to fork when the model runs in the
    engine core (``distributed_executor_backend == "uni"``) and the engine's starter chose none (vLLM's CLI
    has set spawn by then; a ``VLLM_WORKER_MULTIPROC_METHOD`` given to the engine is kept); any other
    executor keeps vLLM's spawn."""
    platform = getattr(module, "CpuPlatform", None)
    original = getattr(getattr(platform, "check_and_update_config", None), "__func__", None)
    if platform is None or original is None or CHOSEN_METHOD is not None:
        return  # another vLLM, or a start method chosen by whoever started the engine

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        if getattr(vllm_config.parallel_config, "distributed_executor_backend", None) == "uni":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    platform.check_and_update_config = classmethod(check_and_update_config)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name]`` on module ``name`` right after vLLM's own code has run, once per module."""

    def __init__(self, patches: dict[str, Any]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        if not self.patches:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the real module, found by the other finders
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_patches: dict[str, Any] = {}
if BUSY_LOOP_S < 1:
    _patches[SPIN_MODULE] = shorten_busy_loop
if FORK_CORE:
    _patches[CPU_PLATFORM_MODULE] = fork_engine_core
if _patches:
    sys.meta_path.insert(0, _PatchOnImport(_patches))


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


def watch_owner() -> None:
    """Start the thread that ends this engine process with its owner (``end_with_owner``)."""
    owner = int(os.environ["RLRUN_ENGINE_OWNER_PID"])
    threading.Thread(target=end_with_owner, args=(owner,), name="rlrun-end-with-owner", daemon=True).start()


def forked() -> None:
    """In a process forked from an engine process (the engine core): say so in the engine's log, and start
    the owner watch (a forked child has no thread but the forking one)."""
    sys.stderr.write(f"rlrun engine_site: process {os.getpid()} forked from {os.getppid()}\n")
    sys.stderr.flush()
    watch_owner()


if os.environ.get("RLRUN_ENGINE_OWNER_PID", "").isdigit():
    watch_owner()
    os.register_at_fork(after_in_child=forked)
