"""Weights from the trainer to a vLLM engine: files against the transfer, side by side, per model size.

For each size of ``--params`` (``0.5M,150M,1B``) a random-init Qwen2 of about that many parameters is built,
one vLLM engine starts on it (eager), and this process plays the trainer: a transformers model whose weights
move by noise before each version, the :class:`~tiderl.trainer.publish.WeightPublisher` that writes
``weights/vN`` with its SHA256SUMS (both paths: the trainer writes the files for checkpoints and late
joiners either way) and, for the transfer, the :class:`~tiderl.weightsync.server.WeightServer`. Each round
publishes two versions per path (``files``: read from this host's page cache, as a rank on the trainer leader's
node; ``files_cold``: the files evicted from it first, as a rank on another node reads them from the shared
filesystem; ``transfer``: the engine on the server's host maps the version's shared-memory files;
``transfer_sent``: the server keeps the version in its own memory and sends the bytes over the connection, as
to an engine on another host): one with nothing in flight, one while ``--in-flight`` requests run. Per path it
reports (medians over ``--rounds``):

- ``publish_s``: the trainer's side until the version is published (files: write and hash; transfer: the
  same, then staging the buckets in the server);
- ``to_first_token_s``: from the publication to the first token sampled on the version, nothing else in
  flight (files: the rank checks every file against SHA256SUMS as :class:`~tiderl.run.weights.WeightsSource`
  does, then the engine reloads them; transfer: the engine receives the version, every bucket checked, and
  loads it); ``update_s``: the engine's own part of it (the reload, or receive and load), ``receive_s``: the
  transfer's receive;
- ``bytes``: what reached the engine (the safetensors files, or the buckets);
- ``stall_s``: how long the ``--in-flight`` requests running during the other update stood still, ``kept``:
  whether every one of them finished with all its tokens (none dropped or restarted), ``versions_split``:
  how many carry tokens of both versions;
- ``max_logprob_diff``: engine against transformers on the new weights, over ``--tokens`` tokens sampled
  after the update; ``base_max_logprob_diff`` (per size): the same on the weights the engine started from,
  before any update, what the two implementations' kernels differ by without a version moving at all.

``ratios`` gives each files path over each transfer path per size. Prints one JSON line per size, then a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import model_size, parse_params  # noqa: E402

# `files`: the version's files in this host's page cache (a rank on the trainer leader's node); `files_cold`:
# evicted first (a rank on another node, reading the shared filesystem); `transfer`: trainer.weight_sync: transfer,
# the engine on the server's host (it maps the server's shared-memory files); `transfer_sent`: the same with the
# bytes sent over the connection, as to an engine on another host.
PATHS = ("files", "files_cold", "transfer", "transfer_sent")
TRANSFERS = ("transfer", "transfer_sent")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="0.5M,150M,1B", help="comma-separated model sizes, e.g. 0.5M,150M,1B")
    p.add_argument("--rounds", type=int, default=2, help="versions published per path and size")
    p.add_argument("--in-flight", type=int, default=4, help="requests running while each version lands")
    p.add_argument("--tokens", type=int, default=16, help="tokens sampled after each update, scored by transformers")
    p.add_argument("--work-dir", type=Path, default=None, help="keep the models here (default: a temp dir)")
    args = p.parse_args(argv)
    try:
        args.sizes = [parse_params(s) for s in args.params.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if not args.sizes or args.rounds < 1 or args.in_flight < 0 or args.tokens < 1:
        p.error("--params needs a size; --rounds and --tokens at least 1, --in-flight at least 0")
    return args


def shape_for(params: int) -> tuple[int, int]:
    """(hidden, vocab) for a model of about `params` parameters: small ones small throughout."""
    if params < 5_000_000:
        return 64, 2000
    return (768, 32000) if params < 500_000_000 else (1536, 32000)


class _Actor:
    """What the publisher needs from an actor: the weights written as a Hugging Face directory."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def save_weights(self, directory: Path) -> None:
        self.model.save_pretrained(directory)


def perturb(model: Any, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)


def scored(model: Any, ids: list[int], start: int, banned: tuple[int, ...]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logits[:, list(banned)] -= 100.0
    lp = torch.log_softmax(logits[start - 1:-1], dim=-1)
    return lp[torch.arange(len(ids) - start), torch.tensor(ids[start:])].tolist()


async def first_token(engine: Any, update: Any, published_at: float, prompt: list[int], args: argparse.Namespace,
                      banned: tuple[int, ...]) -> dict[str, Any]:
    """Nothing in flight: the update, then the first token and `--tokens` more on the new weights."""
    from tiderl.rollout.engine import SamplingSpec

    version = await update
    first = await engine.generate(prompt, SamplingSpec(max_new_tokens=1, temperature=1.0, seed=1, banned_token_ids=banned))
    to_first = time.monotonic() - published_at
    sample = await engine.generate(prompt, SamplingSpec(max_new_tokens=args.tokens, temperature=1.0, seed=2,
                                                        banned_token_ids=banned))
    assert first.weights_version == version == sample.weights_version
    up = engine.last_update
    return {"to_first_token_s": to_first, "update_s": up.stall_s, "receive_s": up.receive_s, "bytes": up.nbytes,
            "sample": sample}


async def in_flight(engine: Any, update: Any, prompt: list[int], args: argparse.Namespace,
                    banned: tuple[int, ...]) -> dict[str, Any]:
    """The update while `--in-flight` requests run (each has sampled a token): how long they stood still,
    and whether each finished with all its tokens."""
    from tiderl.rollout.engine import SamplingSpec

    long = SamplingSpec(max_new_tokens=48, temperature=1.0, seed=7, banned_token_ids=banned)
    running = [asyncio.ensure_future(engine.generate(prompt, long)) for _ in range(args.in_flight)]
    # Until every request has sampled a token (what the engine took so far; vLLM's counters are per process).
    while running and sum(1 for w in engine._waiters.values() if w.token_ids) < args.in_flight:
        await asyncio.sleep(0.005)
    await update
    done = await asyncio.gather(*running)
    up = engine.last_update
    return {"stall_s": up.stall_s, "in_flight": up.in_flight, "kept": all(len(g.token_ids) == 48 for g in done),
            "versions_split": sum(1 for g in done if len(set(g.versions)) > 1)}


def evict(directory: Path) -> None:
    """Drop a version's files from this host's page cache (they are fsynced): the rank reads them as a rank
    on another node reads them from the shared filesystem."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _update(engine: Any, path: str, pub: Any, version: int, address: str, verify: Any) -> Any:
    """The rank's side of a version: files (every file checked against SHA256SUMS, as WeightsSource.resolve,
    then reloaded) or the transfer."""
    async def files() -> int:
        if verify(pub.path) != pub.checksum:
            raise RuntimeError(f"{pub.path}: checksum mismatch")
        await engine.reload_weights(pub.path, version)
        return version

    return engine.receive_weights(address, version) if path in TRANSFERS else files()


def bench_size(params: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from tiderl.rollout.vllm_engine import VllmEngine
    from tiderl.trainer.publish import WeightPublisher, verify
    from tiderl.trainer.synthetic import make_model_dir
    from tiderl.weightsync.server import WeightServer

    hidden, vocab = shape_for(params)
    size = model_size(params, hidden, vocab)
    model_dir = work / f"model-{size.num_layers}x{size.hidden_size}-{vocab}"
    if not (model_dir / "config.json").is_file():
        make_model_dir(model_dir, size)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_params = sum(p.numel() for p in trainer.parameters())
    prompt = list(range(3, 35))
    banned = (int(trainer.config.eos_token_id),) if trainer.config.eos_token_id is not None else ()
    engine = VllmEngine(model_dir, num_kv_blocks=64, block_size=32, max_model_len=1024, max_num_seqs=16)
    shutil.rmtree(work / f"weights-{params}", ignore_errors=True)  # a kept work dir's versions from before
    publisher = WeightPublisher(work / f"weights-{params}", model_dir, keep_versions=2)
    server = WeightServer()
    rows: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    try:
        from tiderl.rollout.engine import SamplingSpec

        asyncio.run(engine.generate(prompt, SamplingSpec(max_new_tokens=4, seed=0)))  # the engine's first steps are slow
        base = asyncio.run(engine.generate(prompt, SamplingSpec(max_new_tokens=args.tokens, temperature=1.0, seed=2,
                                                                banned_token_ids=banned)))
        base_ref = scored(trainer, prompt + list(base.token_ids), len(prompt), banned)
        base_diff = max(abs(a - b) for a, b in zip(base.logprobs, base_ref))
        version = 0
        for r in range(args.rounds):
            for path in PATHS:
                row: dict[str, Any] = {}
                for phase in ("first_token", "in_flight"):
                    version += 1
                    perturb(trainer, 1000 * r + version)
                    t0 = time.monotonic()
                    pub = publisher.publish(_Actor(trainer), version)
                    if path == "files_cold":
                        evict(pub.path)
                    if path in TRANSFERS:
                        server.shared_memory = path == "transfer"
                        server.stage(version, trainer.state_dict().items(), torch.float32)
                        server.commit(version)
                    published_at = time.monotonic()
                    row.setdefault("publish_s", published_at - t0)
                    update = _update(engine, path, pub, version, server.address, verify)
                    if phase == "first_token":
                        got = asyncio.run(first_token(engine, update, published_at, prompt, args, banned))
                        g = got.pop("sample")
                        ids = prompt + list(g.token_ids)
                        ref = scored(trainer, ids, len(prompt), banned)
                        got["max_logprob_diff"] = max(abs(a - b) for a, b in zip(g.logprobs, ref))
                    else:
                        got = asyncio.run(in_flight(engine, update, prompt, args, banned))
                    row.update(got)
                    row["via"] = engine.last_update.via or "files"
                rows[path].append(row)
    finally:
        server.close()
        engine.close()
    out: dict[str, Any] = {"params": num_params, "layers": size.num_layers, "hidden": size.hidden_size,
                           "base_max_logprob_diff": base_diff}
    for path, rs in rows.items():
        out[path] = {k: statistics.median(r[k] for r in rs) for k in ("publish_s", "to_first_token_s", "update_s",
                                                                        "receive_s", "bytes", "stall_s")}
        out[path]["max_logprob_diff"] = max(r["max_logprob_diff"] for r in rs)
        out[path]["in_flight"] = min(r["in_flight"] for r in rs)
        out[path]["kept"] = all(r["kept"] for r in rs)
        out[path]["versions_split"] = min(r["versions_split"] for r in rs)
        out[path]["via"] = sorted({r["via"] for r in rs})
    out["over_transfer"] = {f"{path}/{t}": {k: out[path][k] / out[t][k] for k in
                                            ("to_first_token_s", "update_s", "stall_s") if out[t][k] > 0}
                            for t in TRANSFERS for path in PATHS if path not in TRANSFERS}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for params in args.sizes:
            res = bench_size(params, args, work)
            results.append(res)
            print(json.dumps(res), flush=True)
    print(json.dumps({"ratios": {str(r["params"]): r["over_transfer"] for r in results}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
