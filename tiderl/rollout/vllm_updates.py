"""How the vLLM engine's weights change and make room (a part of :class:`tiderl.rollout.vllm_engine.VllmEngine`).

- **In place, requests kept.** A version is loaded between two steps of the engine thread: vLLM's scheduler
  stops with its requests kept, the tokens it sampled before the stop are taken (each carries the weights that
  sampled it), the weights load (from files, `reload_weights`, or from the trainer's weight server through
  vLLM's weight-transfer API, `receive_weights`), the prefix cache is dropped with the requests' KV, and the
  scheduler resumes: the requests recompute their contexts on the new weights.
- **Room for the trainer.** A rank that moves to the trainer puts the engine to sleep (`release_memory`,
  vLLM's sleep level 1: the weights to host memory, the KV cache freed) and wakes it back in rollout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tiderl.rollout.engine import EngineError, WeightsNotReceived, WeightsUpdate
from tiderl.rollout.vllm_worker import checkpoint_tensors

TRANSFER_TIMEOUT_S = 300.0  # a weights transfer's connection and data timeout


class EngineWeights:
    """The weights' part of VllmEngine; it relies on the engine's thread (`_call`, `_take_queued`) and state."""

    _llm: Any
    _engine: Any
    _waiters: dict[str, Any]
    _tensor_names: set[str]
    _transfer_address: str | None
    _updating: asyncio.Lock | None
    _max_images: int
    _version: int
    _failure: BaseException | None
    _sleep_mode: bool
    _asleep: bool
    last_update: WeightsUpdate | None
    _call: Callable[[Callable[[], Any]], Any]  # the engine thread's: run a function between two steps
    _take_queued: Callable[[], None]  # the engine thread's: take the outputs vLLM's core sampled already
    _clock: Any  # the engine's IterationClock

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def memory_released(self) -> bool:
        return self._asleep

    async def release_memory(self) -> bool:
        """vLLM's sleep, level 1: the weights to host memory, the KV cache dropped (no request may be in
        flight: the rank has left rollout). False on a CPU, where vLLM has no sleep mode."""
        if not self._sleep_mode or self._asleep:
            return self._asleep
        if self._waiters:
            raise EngineError(f"release_memory: {len(self._waiters)} requests are in flight")
        await self._call(lambda: self._llm.sleep(level=1))
        self._asleep = True
        return True

    async def restore_memory(self) -> None:
        if self._asleep:
            await self._call(self._llm.wake_up)
            self._asleep = False

    async def reload_weights(self, weights_dir: str | Path, version: int) -> None:
        weights_dir = Path(weights_dir)
        if not any(weights_dir.glob("*.safetensors")):
            raise EngineError(f"reload_weights: no *.safetensors in {weights_dir}")
        lacking = sorted(self._tensor_names - checkpoint_tensors(weights_dir))
        if lacking:  # refused before anything is loaded: the engine keeps serving its weights
            raise EngineError(f"reload_weights: {weights_dir} lacks {len(lacking)} of the model's tensors "
                              f"({', '.join(lacking[:5])}{', ...' if len(lacking) > 5 else ''})")

        def load() -> WeightsUpdate:
            results = self._llm.collective_rpc("tiderl_reload_weights", kwargs={"weights_path": str(weights_dir)})
            self._check_loaded(results, str(weights_dir))
            return WeightsUpdate(version, "files", nbytes=sum(p.stat().st_size for p in weights_dir.glob("*.safetensors")))

        await self._update(load)

    async def receive_weights(self, address: str, min_version: int) -> int:
        """Receive the newest committed version (at least `min_version`) from the trainer's weight server at
        `address` (``host:port``) through vLLM's weight-transfer API (:mod:`tiderl.rollout.vllm_transfer`)
        and load it in place, in-flight requests kept (as :meth:`reload_weights`). Returns the version
        loaded. Raises :class:`WeightsNotReceived` where nothing was loaded (the engine keeps its weights)."""

        def transfer() -> WeightsUpdate:
            llm = self._llm
            if self._transfer_address != address:
                init = {"address": address, "timeout_s": TRANSFER_TIMEOUT_S}
                llm.collective_rpc("init_weight_transfer_engine", args=(init,))
                self._transfer_address = address
            llm.collective_rpc("start_weight_update")
            try:
                llm.collective_rpc("update_weights", args=({"min_version": min_version,
                                                            "expected": sorted(self._tensor_names)},))
            finally:
                llm.collective_rpc("finish_weight_update")
            results = llm.collective_rpc("tiderl_transfer_result")
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                self._transfer_address = None  # connect afresh next time
                if any(r.get("mixed") for r in results):  # a damaged bucket found while loading
                    raise EngineError(f"weights transfer: {errors[0]}")
                if len(errors) < len(results):  # some workers loaded, some did not: a mix of versions
                    raise EngineError(f"weights transfer: {len(errors)} of {len(results)} workers did not "
                                      f"receive the version ({errors[0]}): the engine would serve a mix")
                raise WeightsNotReceived(errors[0])
            versions = {int(r["version"]) for r in results}
            if len(versions) != 1:
                raise EngineError(f"weights transfer: the workers received different versions {sorted(versions)}")
            self._check_loaded(results, f"weights transfer from {address}")
            r = results[0]
            return WeightsUpdate(versions.pop(), "transfer", nbytes=int(r["nbytes"]), digest=str(r["digest"]),
                                 receive_s=float(r["receive_s"]), via=str(r.get("via", "")))

        return (await self._update(transfer)).version

    def _check_loaded(self, results: list[dict[str, list[str]]], source: str) -> None:
        if missing := sorted({name for r in results for name in r["missing"]}):
            raise EngineError(f"reload_weights: {source} holds no values for {len(missing)} of the model's parameters "
                              f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): a mix of versions")

    async def _update(self, load: Callable[[], WeightsUpdate]) -> WeightsUpdate:
        """Run `load` on the engine thread between two steps, with the requests in flight kept: they are
        preempted (their KV cache freed, the tokens they sampled kept) and resume on the new weights, which
        recompute their contexts; every token sampled from then on carries the new version. The prefix
        cache (the old weights' KV) is dropped."""
        if self._updating is None:
            self._updating = asyncio.Lock()
        async with self._updating:

            def update() -> WeightsUpdate:
                t0 = time.monotonic()
                in_flight = len(self._waiters)
                # vLLM's engine core steps on its own, ahead of this thread: stop its scheduler (requests kept),
                # then take the tokens it sampled before the stop, so each carries the weights that sampled it.
                self._llm.sleep(level=0, mode="keep")
                try:
                    self._take_queued()
                    done = load()  # raises before anything is loaded, or leaves the engine unusable (below)
                    if self._max_images:
                        # The vision tower changed too: its cached outputs are stale, and the front end's record
                        # of which images the engine holds is dropped with them (it would send hashes only).
                        self._engine.reset_encoder_cache()
                        self._llm.reset_mm_cache()
                    if not self._llm.reset_prefix_cache(reset_running_requests=True):
                        raise EngineError("reload_weights: vLLM refused to reset its prefix cache after loading")
                    self._version = done.version
                finally:
                    self._clock.skip()  # the core stood still: the next batch's time is not an iteration's
                    self._llm.wake_up(tags=["scheduling"])
                return replace(done, stall_s=time.monotonic() - t0, in_flight=in_flight)

            try:
                done = await self._call(update)
            except WeightsNotReceived:
                raise
            except EngineError as e:
                self._failure = e  # part old, part new: nothing more is generated on these weights
                raise
            self.last_update = done
            return done

