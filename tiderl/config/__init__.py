"""Job configuration: typed, frozen, validated dataclasses loaded from YAML."""

from tiderl.config.job import JobConfig, dump_job, load_job
from tiderl.config.schema import ConfigError

__all__ = ["ConfigError", "JobConfig", "dump_job", "load_job"]
