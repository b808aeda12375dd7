"""The GPU check's engine stages (tools/gpu_check_stages.py), in one process: ``vllm_engine`` (start,
generate, sleep and wake), ``logprob_agreement`` (the engine's sampled tokens scored by the trainer's
actor) and ``weight_transfer`` (trained versions to the engine through ``trainer.weight_sync: transfer``)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from gpu_check_context import Context, Partial
from gpu_check_env import ensure_vllm_plugins, use_model
from gpu_check_meter import device_free, record, synchronize
from gpu_check_trainer import make_actor, train_step, trainer_group

TRANSPORT = ("tiderl.weightsync: a TCPStore rendezvous; the engine on this host maps the server's shared-memory "
             "buckets (else they come over a TCP connection), then loads them onto its device; no NCCL path exists")


# ---- 3, 5, 6: the engine, the agreement, the transfer ---------------------------------------------


def _diff(a: list[float], b: list[float]) -> dict[str, Any]:
    gaps = [abs(x - y) for x, y in zip(a, b, strict=True)]
    if not gaps:
        raise RuntimeError("no tokens to compare")
    return {"max_abs": max(gaps), "mean_abs": sum(gaps) / len(gaps), "tokens": len(gaps)}


class EngineStages:
    """Stages 3, 5 and 6 in one process: one engine start serves all three."""

    def __init__(self, ctx: Context, out: Path) -> None:
        self.ctx = ctx
        self.out = out
        self.engine: Any = None
        self.engine_error: str | None = None
        self.prompts: list[list[int]] = []
        self.generations: list[Any] = []
        self.actor: Any = None
        self.comm: Any = None

    def run(self) -> None:
        from tiderl.trainer.group import leave_trainer_group

        try:
            started = record(self.out, "vllm_engine", self.ctx.cuda, self.vllm_engine)
            if not self.generations:
                self.engine_error = self.engine_error or started["error"]
            record(self.out, "logprob_agreement", self.ctx.cuda, self.logprob_agreement)
            record(self.out, "weight_transfer", self.ctx.cuda, self.weight_transfer)
        finally:
            if self.engine is not None:
                self.engine.close()
            leave_trainer_group()

    # -- 3 --
    def sampling(self, seed: int, tokens: int) -> Any:
        from tiderl.rollout.engine import SamplingSpec

        return SamplingSpec(max_new_tokens=tokens, temperature=1.0, seed=seed)

    def generate(self, prompts: list[list[int]], tokens: int) -> list[Any]:
        async def all_of() -> list[Any]:
            return await asyncio.gather(*(self.engine.generate(pr, self.sampling(100 + i, tokens))
                                          for i, pr in enumerate(prompts)))

        return asyncio.run(all_of())

    def vllm_engine(self) -> dict[str, Any]:
        import random

        ctx, p = self.ctx, self.ctx.preset
        use_model(ctx)
        figures: dict[str, Any] = {"plugins": ensure_vllm_plugins(ctx.work)}
        try:
            import vllm  # noqa: F401  (its own error, before the engine's)

            from tiderl.rollout.vllm_engine import VllmEngine
        except Exception as e:
            self.engine_error = f"vLLM does not import: {type(e).__name__}: {e}"
            raise Partial(self.engine_error, figures) from e
        kwargs: dict[str, Any] = {"block_size": 32, "max_model_len": p.max_model_len, "max_num_seqs": p.max_num_seqs,
                                  "dtype": "bfloat16" if ctx.cuda else "float32", "num_kv_blocks": p.kv_blocks,
                                  "gpu_memory_utilization": 0.5, "seed": 0}
        if ctx.engine_eager:
            kwargs["enforce_eager"] = True
        figures["settings"] = {**kwargs, "enforce_eager": kwargs.get("enforce_eager", not ctx.cuda)}
        free_before = device_free() if ctx.cuda else None
        t0 = time.perf_counter()
        try:
            self.engine = VllmEngine(ctx.model_dir, **kwargs)
        except Exception as e:
            self.engine_error = f"the engine did not start: {type(e).__name__}: {e}"
            raise
        figures["start_s"] = round(time.perf_counter() - t0, 2)
        figures["kv_capacity_tokens"] = self.engine.kv_capacity_tokens
        if ctx.cuda:
            figures["engine_device_bytes"] = free_before - device_free()
        from transformers import AutoTokenizer

        # Prompts of ids both the tokenizer and the model have.
        top = min(len(AutoTokenizer.from_pretrained(ctx.model_dir)), self.vocab_size())
        rng = random.Random(0)
        self.prompts = [[rng.randrange(3, top) for _ in range(p.prompt_tokens)] for _ in range(p.requests)]
        t0 = time.perf_counter()
        self.generate(self.prompts[:1], p.new_tokens)  # the first steps are slow (warm-up)
        figures["first_request_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        self.generations = self.generate(self.prompts, p.new_tokens)
        seconds = time.perf_counter() - t0
        generated = sum(len(g.token_ids) for g in self.generations)
        figures.update({"requests": len(self.prompts), "prompt_tokens": p.prompt_tokens, "new_tokens": p.new_tokens,
                        "generated_tokens": generated, "generate_s": round(seconds, 3),
                        "tokens_per_s": round(generated / seconds, 1)})
        figures.update(self.sleep_and_wake())
        again = self.generate(self.prompts[:1], p.new_tokens)
        figures["generates_after_wake"] = len(again[0].token_ids) > 0  # (a request may sample its end early)
        return figures

    def sleep_and_wake(self) -> dict[str, Any]:
        free0 = device_free()
        t0 = time.perf_counter()
        released = asyncio.run(self.engine.release_memory())
        sleep_s = time.perf_counter() - t0
        free1 = device_free()
        t0 = time.perf_counter()
        asyncio.run(self.engine.restore_memory())
        wake_s = time.perf_counter() - t0
        free2 = device_free()
        out: dict[str, Any] = {"sleep_supported": bool(released), "sleep_s": round(sleep_s, 3),
                               "wake_s": round(wake_s, 3), "freed_bytes": None, "restored_bytes": None}
        if free0 is not None:
            out["freed_bytes"] = free1 - free0
            out["restored_bytes"] = free1 - free2
        if not released:
            out["sleep_note"] = "vLLM has no sleep mode on this platform: release_memory keeps the memory"
        return out

    def vocab_size(self) -> int:
        return int(json.loads((self.ctx.model_dir / "config.json").read_text())["vocab_size"])

    # -- 5 --
    def ensure_actor(self) -> None:
        if self.actor is None:
            use_model(self.ctx)
            self.comm, _ = trainer_group(self.ctx, "engine")
            self.actor = make_actor(self.ctx, self.comm)

    def release_engine(self) -> bool:
        return self.engine is not None and bool(asyncio.run(self.engine.release_memory()))

    def restore_engine(self) -> None:
        if self.engine is not None:
            if self.ctx.cuda:  # the actor's cached blocks back to the device, for the engine to take again
                import torch

                torch.cuda.empty_cache()
            asyncio.run(self.engine.restore_memory())

    def samples(self, prompts: list[list[int]], gens: list[Any], version: int) -> list[Any]:
        from tiderl.advantages import group_advantages
        from tiderl.trainer.batch import TrainSample

        rewards = [float(i % 2) for i in range(len(gens))]
        return [TrainSample(trajectory_id=f"t{i}", group_id="g0", token_ids=tuple(pr) + tuple(g.token_ids),
                            loss_mask=(0,) * len(pr) + (1,) * len(g.token_ids),
                            rollout_logprobs=(0.0,) * len(pr) + tuple(g.logprobs),
                            token_versions=(-1,) * len(pr) + (version,) * len(g.token_ids), advantage=adv,
                            reward=rewards[i])
                for i, (pr, g, adv) in enumerate(zip(prompts, gens, group_advantages(rewards), strict=True))]

    def micro_batches(self, samples: list[Any]) -> list[Any]:
        from tiderl.trainer.batch import collate

        per = self.ctx.preset.seqs
        return [collate(samples[i:i + per], index=i // per) for i in range(0, len(samples), per)]

    def scored(self, mbs: list[Any]) -> dict[str, list[float]]:
        """The trainer's log-probabilities of each micro-batch's model tokens (the actor's forward: bf16
        autocast on a GPU), the same in fp32 (its fp32 weights, no autocast), and the engine's."""
        import torch

        from tiderl.trainer.grpo import token_logprobs

        out: dict[str, list[float]] = {"trainer": [], "fp32": [], "engine": []}
        device = self.ctx.device
        with torch.no_grad():
            for mb in mbs:
                mask = mb.loss_mask > 0
                out["trainer"] += self.actor.forward(mb).float().cpu()[mask].tolist()
                ids = mb.input_ids.to(device)
                logits = self.actor.model(input_ids=ids, attention_mask=mb.attention_mask.to(device),
                                          use_cache=False).logits
                fp32 = token_logprobs(logits.float(), ids, temperature=self.actor.temperature,
                                      banned=self.actor.banned)
                out["fp32"] += fp32.float().cpu()[mask].tolist()
                out["engine"] += mb.old_logprobs[mask].tolist()
        return out

    def logprob_agreement(self) -> dict[str, Any]:
        n = self.ctx.preset.agreement_seqs
        figures: dict[str, Any] = {"engine_released": self.release_engine()}  # room for the actor on the device
        self.ensure_actor()
        figures["compute_dtype"] = str(self.actor.compute_dtype).replace("torch.", "")
        if self.generations:
            figures["engine_dtype"] = "bfloat16" if self.ctx.cuda else "float32"
            mbs = self.micro_batches(self.samples(self.prompts[:n], self.generations[:n], 0))
        else:  # no engine: the trainer's own precision against fp32, on random tokens
            from tiderl.trainer.synthetic import random_samples

            p = self.ctx.preset
            samples = random_samples(1, n, vocab_size=int(self.actor.model.config.vocab_size),
                                     min_tokens=p.prompt_tokens + p.new_tokens,
                                     max_tokens=p.prompt_tokens + p.new_tokens)
            mbs = self.micro_batches(samples)
        scored = self.scored(mbs)
        figures["trainer_vs_fp32"] = _diff(scored["trainer"], scored["fp32"])
        if not self.generations:
            raise Partial(f"no engine samples ({self.engine_error}): only the trainer's precision was measured",
                          figures)
        figures["engine_vs_trainer"] = _diff(scored["engine"], scored["trainer"])
        figures["engine_vs_fp32"] = _diff(scored["engine"], scored["fp32"])
        figures["max_abs"] = figures["engine_vs_trainer"]["max_abs"]
        figures["mean_abs"] = figures["engine_vs_trainer"]["mean_abs"]
        return figures

    # -- 6 --
    def weight_transfer(self) -> dict[str, Any]:
        import torch

        from tiderl.weightsync.server import WeightServer

        ctx, p = self.ctx, self.ctx.preset
        self.ensure_actor()
        wire = torch.bfloat16 if ctx.cuda else torch.float32  # the engines' dtype (tiderl.run.weights.wire_dtype)
        n = p.agreement_seqs
        prompts = self.prompts[:n]
        gens = self.generations[:n]
        if not gens:
            from tiderl.trainer.synthetic import random_samples

            train_on = random_samples(1, n, vocab_size=int(self.actor.model.config.vocab_size),
                                      min_tokens=p.prompt_tokens + p.new_tokens,
                                      max_tokens=p.prompt_tokens + p.new_tokens)
        engine = self.engine if gens else None  # an engine that started but sampled nothing is not trusted
        versions = []
        server = WeightServer("127.0.0.1", commit_wait_s=5.0)  # the engine is on this host
        client = None
        try:
            for version in range(1, p.transfer_versions + 1):
                row: dict[str, Any] = {"version": version}
                self.release_engine()  # the step's optimizer state where the engine's cache was
                samples = self.samples(prompts, gens, version - 1) if gens else train_on
                row["train_step_s"] = round(train_step(ctx, self.actor, self.micro_batches(samples), version - 1)
                                            ["step_s"], 4)
                t0 = time.perf_counter()
                self.restore_engine()
                row["wake_s"] = round(time.perf_counter() - t0, 3)
                t0 = time.perf_counter()
                state = self.actor.full_weights()  # host memory, as the leader publishes
                row["gather_s"] = round(time.perf_counter() - t0, 3)
                t0 = time.perf_counter()
                staged = server.stage(version, state.items(), wire)
                server.commit(version)
                row["stage_s"] = round(time.perf_counter() - t0, 3)
                row["bytes"] = staged.nbytes
                if engine is not None:
                    t0 = time.perf_counter()
                    got = asyncio.run(engine.receive_weights(server.address, version))
                    row["receive_and_load_s"] = round(time.perf_counter() - t0, 3)
                    up = engine.last_update
                    row.update({"received_version": got, "receive_s": round(up.receive_s, 3), "via": up.via,
                                "stall_s": round(up.stall_s, 3), "engine_bytes": up.nbytes})
                    fresh = self.generate(prompts, p.new_tokens)
                    row["after_transfer"] = _diff(*self._after(prompts, fresh, version))
                else:  # the wire alone: what an engine worker receives, then onto the device
                    if client is None:
                        from tiderl.weightsync.client import WeightClient

                        client = WeightClient(server.address)
                    t0 = time.perf_counter()
                    received = client.receive(version)
                    row["receive_s"] = round(time.perf_counter() - t0, 3)
                    row["via"] = received.via
                    t0 = time.perf_counter()
                    on_device = [t.to(ctx.device) for _, t in received.tensors]
                    synchronize(ctx)
                    row["to_device_s"] = round(time.perf_counter() - t0, 3)
                    del on_device
                parts = ("receive_and_load_s",) if engine is not None else ("receive_s", "to_device_s")
                row["total_s"] = round(sum(row[k] for k in ("gather_s", "stage_s", *parts)), 3)
                versions.append(row)
        finally:
            server.close()
        figures: dict[str, Any] = {
            "weight_sync": "transfer", "transport": TRANSPORT, "wire_dtype": str(wire).replace("torch.", ""),
            "versions": versions, "bytes": versions[-1]["bytes"],
            "seconds_per_version": round(statistics.median(v["total_s"] for v in versions), 3),
        }
        if engine is None:
            figures["path"] = "wire only (no engine): server -> WeightClient -> device"
            raise Partial(f"no engine ({self.engine_error}): the wire alone was measured", figures)
        figures["path"] = "trainer full_weights -> WeightServer -> vLLM weight-transfer backend 'tiderl' -> engine"
        figures["receive_and_load_s"] = round(statistics.median(v["receive_and_load_s"] for v in versions), 3)
        figures["after_transfer_max_abs"] = max(v["after_transfer"]["max_abs"] for v in versions)
        return figures

    def _after(self, prompts: list[list[int]], gens: list[Any], version: int) -> tuple[list[float], list[float]]:
        """The engine's log-probabilities of what it sampled on the transferred version, and the trainer's."""
        if any(g.weights_version != version for g in gens):
            raise RuntimeError(f"the engine sampled on version {[g.weights_version for g in gens]}, not {version}")
        scored = self.scored(self.micro_batches(self.samples(prompts, gens, version)))
        return scored["engine"], scored["trainer"]
