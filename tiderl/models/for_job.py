"""The policy model of a job: `model.path`, or the tiny model its `model:` section describes."""

from __future__ import annotations

from pathlib import Path

from tiderl.config import JobConfig
from tiderl.envs.images import ImageEnvironment
from tiderl.envs.registry import env_class
from tiderl.models import tiny_model, tiny_vl_model


def tiny_spec(job: JobConfig) -> tiny_model.TinyModelSpec | tiny_vl_model.TinyVisionSpec:
    """The spec of the tiny model a job with `model.path: null` trains: for an image environment the tiny
    vision-language model's."""
    m = job.model
    # The warm start plays the job's own task when it is the same environment; unset options keep the spec's defaults.
    given = {"env_options": dict(job.env.options) if m.init_env == job.env.name else {},
             "train_steps": m.init_train_steps, "demo_noise": m.init_demo_noise}
    kwargs = {key: value for key, value in given.items() if value is not None}
    if issubclass(env_class(m.init_env), ImageEnvironment):
        return tiny_vl_model.TinyVisionSpec(env=m.init_env, **kwargs)
    return tiny_model.TinyModelSpec(env=m.init_env, **kwargs)


def spec_dir(spec: tiny_model.TinyModelSpec | tiny_vl_model.TinyVisionSpec) -> Path:
    """The cache directory of a tiny model's spec: where runs look for it (and build it when it is not there)."""
    if isinstance(spec, tiny_vl_model.TinyVisionSpec):
        return tiny_vl_model.spec_vl_model_dir(spec)
    return tiny_model.spec_model_dir(spec)


def build_spec(spec: tiny_model.TinyModelSpec | tiny_vl_model.TinyVisionSpec, out: Path | None = None, *,
               force: bool = False) -> Path:
    """Build (or find cached) the tiny model of `spec` in `out`, by default where runs look (`spec_dir`)."""
    out = spec_dir(spec) if out is None else out
    if isinstance(spec, tiny_vl_model.TinyVisionSpec):
        return tiny_vl_model.init_vl_model(out, spec, force=force)
    return tiny_model.init_model(out, spec, force=force)


def model_dir(job: JobConfig) -> Path:
    """`model.path`, or the cached tiny model the `model:` section describes (built on first use): for an
    image environment the tiny vision-language model."""
    if job.model.path is not None:
        return Path(job.model.path)
    return build_spec(tiny_spec(job))
