"""The GPU check's device and memory metering (tools/gpu_check_stages.py): a stage's memory peaks (the
CUDA allocator, the device's used memory, host RSS), sampled while it runs, and its record, one JSON line
written as soon as the stage ends, with its figures or its error."""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_check_context import Context, Partial


class Meter:
    """A stage's memory peaks: this process's CUDA allocator (allocated, reserved), the device's used memory
    (every process: vLLM's engine core included) and host RSS (this process and its children), sampled every
    0.2 s by a thread."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda and _cuda_usable()
        self.device_used_start = self.device_used_peak = None
        self.rss_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, name="gpu-check-meter", daemon=True)

    def __enter__(self) -> Meter:
        if self.cuda:
            import torch

            try:
                torch.cuda.reset_peak_memory_stats()
                self.device_used_start = self.device_used_peak = device_used()
            except Exception:  # a device in an error state: the stage itself reports it
                self.cuda = False
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()

    def _sample_loop(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def _sample(self) -> None:
        self.rss_peak = max(self.rss_peak, host_rss())
        if self.cuda:
            try:
                used = device_used()
            except Exception:  # a device in an error state: the stage reports the error, the meter goes on
                return
            self.device_used_peak = max(self.device_used_peak or 0, used)

    def peaks(self) -> dict[str, Any]:
        out: dict[str, Any] = {"host_rss_peak_bytes": self.rss_peak, "gpu_allocated_peak_bytes": None,
                               "gpu_reserved_peak_bytes": None, "device_used_peak_bytes": self.device_used_peak,
                               "device_used_start_bytes": self.device_used_start}
        if self.cuda:
            import torch

            try:
                out["gpu_allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
                out["gpu_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
            except Exception as e:  # as above
                out["gpu_error"] = f"{type(e).__name__}: {e}"
        return out


def _cuda_usable() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken CUDA set-up: the stage itself reports it
        return False


def device_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def device_free() -> int | None:
    import torch

    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None


def host_rss() -> int:
    """This process's resident memory and its children's (vLLM's engine core), in bytes."""
    try:
        import psutil
    except ImportError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return int(total)


def synchronize(ctx: Context) -> None:
    if ctx.cuda:
        import torch

        torch.cuda.synchronize()


# ---- a stage's record ---------------------------------------------------------------------------


def record(out: Path, stage: str, cuda: bool, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one stage, write its record as a JSON line to `out` (at once) and return it."""
    t0 = time.perf_counter()
    error = tb = None
    figures: dict[str, Any] = {}
    with Meter(cuda) as meter:
        try:
            figures = fn()
        except Partial as e:
            figures, error, tb = e.figures, str(e), traceback.format_exc()
        except Exception as e:  # every failure is the stage's result; the next stage still runs
            error, tb = f"{type(e).__name__}: {e}", traceback.format_exc()
    rec = {"stage": stage, "ok": error is None, "seconds": round(time.perf_counter() - t0, 3), "error": error,
           **figures, "memory": meter.peaks()}
    if tb:
        rec["traceback"] = tb[-3000:]
    with out.open("a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    print(f"[gpu_check] {stage}: {'ok' if error is None else 'FAILED: ' + error} ({rec['seconds']:.1f} s)",
          file=sys.stderr, flush=True)
    return rec
