"""Whether vLLM's engine core is alive, for :class:`tiderl.rollout.vllm_engine.VllmEngine`.

vLLM's in-process client (0.32, ``LLM``) marks itself dead and shuts down when its monitor sees the engine-core
process gone, but a ``step()`` already waiting for the core's outputs is never woken: the client's output thread
leaves on the shutdown signal without a word. The engine thread, and every request of its rank, would then wait
for ever (the chaos campaign's ``engine_kill`` stalled a run so). :func:`watch_core` puts an error in that wait's
queue, and the engine fails as on any other error; :func:`engine_processes` names the processes to kill after.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

CORE_WATCH_S = 0.5  # how often the watch checks that vLLM's engine core is alive

__all__ = ["CORE_WATCH_S", "engine_processes", "kill_processes", "watch_core"]


def watch_core(core: Any, done: Callable[[], bool]) -> threading.Thread | None:
    """Start a daemon thread that wakes a step waiting on `core` (vLLM's engine-core client) once the client
    says the core is dead; it ends then, or once `done()`. None where the client has no such queue (another
    vLLM client)."""
    resources, outputs = getattr(core, "resources", None), getattr(core, "outputs_queue", None)
    if resources is None or outputs is None:
        return None

    def watch() -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        while not done():
            if getattr(resources, "engine_dead", False):
                outputs.put_nowait(EngineDeadError())
                return
            time.sleep(CORE_WATCH_S)

    thread = threading.Thread(target=watch, name="vllm-engine-watch", daemon=True)
    thread.start()
    return thread


def engine_processes() -> list[Any]:
    """This process's vLLM processes (engine core, workers: their titles start with ``VLLM::``), with their
    descendants: a core that died leaves its workers behind (they are its children, not this process's)."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name().startswith("VLLM") or any(a.startswith("VLLM::") for a in proc.cmdline()[:1]):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_processes(procs: list[Any], timeout_s: float = 10.0) -> None:
    """SIGKILL those of `procs` still running and wait up to `timeout_s` for them to go."""
    import psutil

    alive = []
    for proc in procs:
        try:
            proc.kill()
            alive.append(proc)
        except psutil.Error:  # gone already, or not ours to kill
            continue
    psutil.wait_procs(alive, timeout=timeout_s)
