"""`tiderl init-model`: build (or find cached) the tiny warm-started policy model.

For an environment whose observations carry images (`ImageEnvironment`, e.g. `gridimage`)
it builds the tiny vision-language model of `tiny_vl_model` instead, warm-started the same way
(its pictures through the vision tower).

Without `--out` the model goes where runs look for it (`tiderl.models.for_job.spec_dir`): a run whose
`model:` section asks for the same model (`model.path: null`) then finds it instead of building it.
`--job JOB.yaml` builds exactly the model of that job (its `init_*` settings and, when `init_env` is
`env.name`, its `env.options`): `tiderl init-model --job jobs/quickstart.yaml` before `tiderl run
jobs/quickstart.yaml`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default=None,
                        help="Environment whose demonstrations warm-start the model (default hilo); the model a job "
                        "with `model.init_env: ENV` and no other `init_*` settings or env.options uses.")
    parser.add_argument("--job", type=Path, default=None,
                        help="Build the tiny model this job file uses (its model.init_* settings and env.options), "
                        "e.g. jobs/quickstart.yaml; not with --env, --seed, --train-steps or --demo-noise.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="With --job: a config override, as `tiderl run --set` (repeatable).")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Model directory to write. Default: where runs with `model.path: null` look for this model "
        "($TIDERL_CACHE or ~/.cache/tiderl, then models/tiny-ENV for the environment's default model, "
        "models/tiny-ENV-HASH for any other, HASH naming its settings and code), so the run does not rebuild it.",
    )
    parser.add_argument("--seed", type=int, default=None, help="Seed of the tokenizer corpus, weights and demonstrations (default 0).")
    parser.add_argument("--force", action="store_true", help="Rebuild even if the directory holds this exact model.")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="Supervised warm-start steps (default: the model's, 250 for a text model, 800 for a "
                        "vision-language one; 0: random weights).")
    parser.add_argument("--demo-noise", type=float, default=None,
                        help="Share of random actions in the demonstrations (default: the model's, 0.3 text, 0.1 vision).")


def _fail(message: str) -> int:
    print(f"tiderl init-model: {message}", file=sys.stderr)
    return 2


def _spec_of_job(args: argparse.Namespace):  # -> TinyModelSpec | TinyVisionSpec | str (an error)
    from tiderl.config import load_job
    from tiderl.models.for_job import tiny_spec

    mixed = [flag for flag, value in (("--env", args.env), ("--seed", args.seed), ("--train-steps", args.train_steps),
                                      ("--demo-noise", args.demo_noise)) if value is not None]
    if mixed:
        return f"--job takes the model's settings from the job; not with {', '.join(mixed)}"
    job = load_job(args.job, args.overrides)  # ConfigError: exit 2 (tiderl.cli)
    if job.model.path is not None:
        return f"--job {args.job}: model.path is {job.model.path}: the job trains that model, not a tiny one"
    return tiny_spec(job)


def _spec_of_args(args: argparse.Namespace):  # -> TinyModelSpec | TinyVisionSpec | str (an error)
    from tiderl.envs.images import ImageEnvironment
    from tiderl.envs.registry import env_class
    from tiderl.models.tiny_model import TinyModelSpec
    from tiderl.models.tiny_vl_model import TinyVisionSpec

    env = args.env or "hilo"
    is_vision = issubclass(env_class(env), ImageEnvironment)
    given = {"seed": args.seed, "train_steps": args.train_steps, "demo_noise": args.demo_noise}
    kwargs = {key: value for key, value in given.items() if value is not None}
    return (TinyVisionSpec if is_vision else TinyModelSpec)(env=env, **kwargs)


def run(args: argparse.Namespace) -> int:
    from tiderl.envs.registry import EnvUnavailableError, UnknownEnvError
    from tiderl.models.demos import demo_env_names
    from tiderl.models.for_job import build_spec, spec_dir
    from tiderl.models.tiny_model import cached_hash, spec_hash
    from tiderl.models.tiny_vl_model import TinyVisionSpec, vl_spec_hash

    if args.overrides and args.job is None:
        return _fail("--set needs --job")
    try:
        spec = _spec_of_job(args) if args.job is not None else _spec_of_args(args)
    except (UnknownEnvError, EnvUnavailableError) as e:
        return _fail(f"--env {args.env}: {e}" if args.job is None else f"model.init_env: {e}")
    except ValueError as e:
        return _fail(str(e))
    if isinstance(spec, str):
        return _fail(spec)
    is_vision = isinstance(spec, TinyVisionSpec)
    # The text model's tokenizer learns from the demonstrations; the vision model's from random play.
    if (not is_vision or spec.train_steps != 0) and spec.env not in demo_env_names():
        return _fail(f"--env {spec.env}: no warm-start demonstrations for this environment "
                     f"(environments with demonstrations: {', '.join(demo_env_names())})")
    if is_vision:
        digest = vl_spec_hash
        keys: tuple[str, ...] = ("hash", "kind", "num_parameters", "num_vision_parameters", "warm_start", "build_s")
    else:
        digest = spec_hash
        keys = ("hash", "num_parameters", "build_s")
    out = args.out if args.out is not None else spec_dir(spec)
    was_cached = not args.force and cached_hash(out) == digest(spec)
    return _print_built(build_spec(spec, out, force=args.force), was_cached, keys)


def _print_built(path: Path, was_cached: bool, keys: tuple[str, ...]) -> int:
    """One JSON line: where the model is, whether it came from the cache, and `keys` of its manifest."""
    from tiderl.models.tiny_model import MANIFEST

    manifest = json.loads((path / MANIFEST).read_text())
    print(json.dumps({"path": str(path), "cached": was_cached, **{k: manifest[k] for k in keys}}))
    return 0
