"""`tiderl init-model`: build (or find cached) the tiny warm-started policy model.

For an environment whose observations carry images (`ImageEnvironment`, e.g. `gridimage`)
it builds the tiny vision-language model of `tiny_vl_model` instead, warm-started the same way
(its pictures through the vision tower)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default="hilo", help="Environment whose demonstrations warm-start the model.")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Model directory to write. Default: the cache directory `model.path: null` uses "
        "($TIDERL_CACHE or ~/.cache/tiderl, then models/tiny-ENV).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the tokenizer corpus, weights and demonstrations.")
    parser.add_argument("--force", action="store_true", help="Rebuild even if the directory holds this exact model.")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="Supervised warm-start steps (default: the model's, 250 for a text model, 800 for a "
                        "vision-language one; 0: random weights).")
    parser.add_argument("--demo-noise", type=float, default=None,
                        help="Share of random actions in the demonstrations (default: the model's, 0.3 text, 0.1 vision).")


def _warm_start_args(args: argparse.Namespace) -> dict[str, int | float]:
    given = {"train_steps": args.train_steps, "demo_noise": args.demo_noise}
    return {key: value for key, value in given.items() if value is not None}


def run(args: argparse.Namespace) -> int:
    from tiderl.envs.images import ImageEnvironment
    from tiderl.envs.registry import EnvUnavailableError, UnknownEnvError, env_class
    from tiderl.models.demos import demo_env_names
    from tiderl.models.tiny_model import TinyModelSpec, cached_hash, default_model_dir, init_model, spec_hash

    try:
        is_vision = issubclass(env_class(args.env), ImageEnvironment)
    except (UnknownEnvError, EnvUnavailableError) as e:
        print(f"tiderl init-model: --env {args.env}: {e}", file=sys.stderr)
        return 2
    # The text model's tokenizer learns from the demonstrations; the vision model's from random play.
    if (not is_vision or args.train_steps != 0) and args.env not in demo_env_names():
        print(
            f"tiderl init-model: --env {args.env}: no warm-start demonstrations for this environment "
            f"(environments with demonstrations: {', '.join(demo_env_names())})",
            file=sys.stderr,
        )
        return 2
    if is_vision:
        from tiderl.models.tiny_vl_model import TinyVisionSpec, init_vl_model, vl_spec_hash

        make_spec, build, digest = TinyVisionSpec, init_vl_model, vl_spec_hash
        keys: tuple[str, ...] = ("hash", "kind", "num_parameters", "num_vision_parameters", "warm_start", "build_s")
    else:
        make_spec, build, digest = TinyModelSpec, init_model, spec_hash
        keys = ("hash", "num_parameters", "build_s")
    try:
        spec = make_spec(env=args.env, seed=args.seed, **_warm_start_args(args))
    except ValueError as e:
        print(f"tiderl init-model: {e}", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else default_model_dir(args.env)
    was_cached = not args.force and cached_hash(out) == digest(spec)
    return _print_built(build(out, spec, force=args.force), was_cached, keys)


def _print_built(path: Path, was_cached: bool, keys: tuple[str, ...]) -> int:
    """One JSON line: where the model is, whether it came from the cache, and `keys` of its manifest."""
    from tiderl.models.tiny_model import MANIFEST

    manifest = json.loads((path / MANIFEST).read_text())
    print(json.dumps({"path": str(path), "cached": was_cached, **{k: manifest[k] for k in keys}}))
    return 0
