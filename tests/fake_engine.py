"""A scripted engine (a test double) for unit tests of the agent loop and the schedulers.

It answers with the ids a test's ``respond`` function gives for a prompt, one fixed
logprob per token, after an optional delay, and keeps an honest model of a prefix
cache: an LRU of full-block prefix hashes holding ``kv_capacity_tokens`` tokens, so
schedulers that keep fewer contexts resident see more hits, as on vLLM.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiderl.envs.images import PngImage
from tiderl.rollout.engine import Engine, EngineError, EngineStats, Generation, Iteration, SamplingSpec, WeightsUpdate


class FakeEngine(Engine):
    receives_weights = True

    def __init__(
        self,
        respond: Callable[[Sequence[int]], Sequence[int]],
        *,
        kv_capacity_tokens: int = 1024,
        block_size: int = 32,
        delay_s: float = 0.0,
        logprob: float = -0.5,
        weights_version: int = 0,
    ) -> None:
        if kv_capacity_tokens < block_size:
            raise ValueError(f"kv_capacity_tokens: {kv_capacity_tokens} is less than one block ({block_size})")
        self._respond = respond
        self._capacity = kv_capacity_tokens
        self._block_size = block_size
        self._delay_s = delay_s
        self._logprob = logprob
        self._version = weights_version
        self._released = False  # release_memory: as a GPU engine's sleep, nothing generates until restored
        self._blocks: OrderedDict[int, None] = OrderedDict()  # LRU of prefix-block hashes
        self._counts = dict(prefix_cache_queries=0, prefix_cache_hits=0, prompt_tokens=0, generation_tokens=0)
        self._in_flight_tokens = 0
        self.reloads: list[tuple[str, int]] = []
        self.transfers: list[tuple[str, int, str]] = []  # (server, version, digest) of each version received
        self._client: Any = None
        self.last_update: WeightsUpdate | None = None
        self.prompts: list[tuple[int, ...]] = []
        self.images: list[tuple[PngImage, ...]] = []  # the images each prompt came with
        self.samplings: list[SamplingSpec] = []
        self.iterations: list[Iteration] = []  # one a generation: its delay, its prefill, the others generating
        self._generating = 0

    @property
    def kv_capacity_tokens(self) -> int:
        return self._capacity

    @property
    def kv_block_tokens(self) -> int:
        return self._block_size

    @property
    def weights_version(self) -> int:
        return self._version

    def _block_hashes(self, ids: Sequence[int]) -> list[int]:
        hashes, h = [], 0
        for start in range(0, len(ids) - len(ids) % self._block_size, self._block_size):
            h = hash((h, tuple(ids[start : start + self._block_size])))
            hashes.append(h)
        return hashes

    def _touch(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) * self._block_size > self._capacity:
            self._blocks.popitem(last=False)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSpec,
                       images: Sequence[PngImage] = ()) -> Generation:
        if not prompt_ids:
            raise EngineError("generate: empty prompt")
        if self._released:
            raise EngineError("generate: the engine's memory is released (restore_memory first)")
        prompt = tuple(prompt_ids)
        self.prompts.append(prompt)
        self.images.append(tuple(images))
        self.samplings.append(sampling)
        version = self._version
        hashes = self._block_hashes(prompt)
        cached = 0
        for h in hashes:
            if h not in self._blocks:
                break
            cached += 1
        self._counts["prefix_cache_queries"] += len(prompt)
        self._counts["prefix_cache_hits"] += cached * self._block_size
        self._counts["prompt_tokens"] += len(prompt)
        self._touch(hashes)
        self._in_flight_tokens += len(prompt)
        self._generating += 1
        self.iterations.append(Iteration(self._delay_s, len(prompt) - cached * self._block_size, self._generating))
        try:
            if self._delay_s:
                await asyncio.sleep(self._delay_s)
            else:
                await asyncio.sleep(0)
            ids = list(self._respond(prompt))[: sampling.max_new_tokens]
            finish = "length"
            if sampling.stop_token_ids and len(ids) < sampling.max_new_tokens:
                ids.append(sampling.stop_token_ids[0])
                finish = "stop"
        finally:
            self._in_flight_tokens -= len(prompt)
            self._generating -= 1
        self._counts["generation_tokens"] += len(ids)
        self._touch(self._block_hashes(prompt + tuple(ids)))
        return Generation(
            token_ids=tuple(ids),
            logprobs=tuple([self._logprob] * len(ids)),
            finish_reason=finish,
            weights_version=version,
            num_prompt_tokens=len(prompt),
            num_cached_tokens=cached * self._block_size,
        )

    def take_iterations(self) -> list[Iteration]:
        taken, self.iterations = self.iterations, []
        return taken

    async def stats(self) -> EngineStats:
        return EngineStats(
            num_preemptions=0,
            kv_usage=min(1.0, self._in_flight_tokens / self._capacity),
            **self._counts,
        )

    async def reload_weights(self, weights_dir: str | Path, version: int) -> None:
        self.reloads.append((str(weights_dir), version))
        self.last_update = WeightsUpdate(version, "files")
        self._blocks.clear()
        self._version = version

    async def receive_weights(self, address: str, min_version: int) -> int:
        """Receive the version from the weight server as a real engine does (every bucket checked), loading
        nothing: the scripted answers do not depend on weights."""
        from tiderl.weightsync.client import WeightClient
        from tiderl.weightsync.wire import TransferError

        def pull() -> Any:
            if self._client is None or self._client.address != address:
                self._client = WeightClient(address, timeout_s=60)
            return self._client.receive(min_version)

        try:
            received = await asyncio.to_thread(pull)
        except TransferError as e:
            self._client = None
            raise EngineError(str(e)) from e
        self.transfers.append((address, received.version, received.digest))
        self.last_update = WeightsUpdate(received.version, "transfer", nbytes=received.nbytes, digest=received.digest,
                                         receive_s=received.seconds, stall_s=received.seconds, via=received.via)
        self._blocks.clear()
        self._version = received.version
        return received.version

    @property
    def memory_released(self) -> bool:
        return self._released

    async def release_memory(self) -> bool:
        if self._in_flight_tokens:
            raise EngineError("release_memory: requests are in flight")
        self._blocks.clear()  # the KV cache goes; the weights wait
        self._released = True
        return True

    async def restore_memory(self) -> None:
        self._released = False

    def close(self) -> None:
        self._blocks.clear()


def for_job(job: Any, model_path: str | Path, weights_version: int = 0) -> FakeEngine:
    """`rollout.engine: fake_engine:for_job` (with tests/ on PYTHONPATH): a whole local run without vLLM. Each
    turn answers with a random number of the `hilo` range, tokenised by the run's model (every answer is a
    valid guess; some find the secret), one block per `rollout.kv_block_size`, the KV cache of
    `rollout.kv_cache_blocks` blocks (or 256)."""
    import random

    from tiderl.rollout.from_config import chat_format

    fmt = chat_format(model_path, job.model)
    rng = random.Random(job.seed * 1000 + weights_version)
    low, high = int(job.env.options.get("low", 1)), int(job.env.options.get("high", 16))
    block = job.rollout.kv_block_size
    engine = FakeEngine(lambda prompt: fmt.encode(str(rng.randint(low, high))), block_size=block,
                        kv_capacity_tokens=(job.rollout.kv_cache_blocks or 256) * block,
                        weights_version=weights_version)
    return engine


SCRIPTED_ENGINE = "fake_engine:for_job"  # `rollout.engine` of a run with this module's engine


def scripted_run_env(cache: Path | None = None) -> dict[str, str]:
    """The environment of a `tiderl` process whose ranks load `SCRIPTED_ENGINE` (tests/ on `PYTHONPATH`);
    with `cache`, its own model cache (`TIDERL_CACHE`)."""
    import os

    tests = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path} | ({"TIDERL_CACHE": str(cache)} if cache is not None else {})
