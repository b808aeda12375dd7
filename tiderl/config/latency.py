"""Latency profiles: environment delay injected per step, so that multi-turn
variance is realistic even for fast games.

Spec strings (also the `env.latency` config field):
- `none`: no delay
- `fixed:SECONDS`: the same delay every step
- `lognormal:MEAN_S:P99_S`: lognormal delays with that mean and 99th percentile
  (P99_S must be greater than MEAN_S and at most ~15x it, the lognormal's limit)
- `file:PATH`: delays in seconds recorded from a real environment, one per line
  (blank lines and `#` comments ignored), drawn uniformly at random
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

Z99 = 2.3263478740408408  # standard normal 99th percentile


class LatencySpecError(ValueError):
    """A latency spec string that cannot be parsed; the message says which form is expected."""


_NO_RNG = random.Random(0)  # none and fixed draw nothing


@dataclass(frozen=True)
class LatencyProfile:
    spec: str
    kind: str  # none | fixed | lognormal | file
    fixed_s: float = 0.0
    mu: float = 0.0
    sigma: float = 0.0
    samples_s: tuple[float, ...] = ()

    def sample_s(self, rng: random.Random) -> float:
        """One step's delay in seconds."""
        if self.kind == "fixed":
            return self.fixed_s
        if self.kind == "lognormal":
            return rng.lognormvariate(self.mu, self.sigma)
        if self.kind == "file":
            return rng.choice(self.samples_s)
        return 0.0

    def keyed_s(self, *key: object) -> float:
        """The delay drawn for `key` (a session's seed, its ordinal among that seed's sessions, the step
        number...): the same key gives the same delay in every run and process (a string seed is hashed
        by SHA-512, not by Python's salted hash), so two runs of one task feed see the same delays where
        they play the same task steps, whatever order their requests come in."""
        if self.kind in ("none", "fixed"):
            return self.sample_s(_NO_RNG)
        return self.sample_s(random.Random("/".join(map(str, key))))

    @property
    def mean_s(self) -> float:
        if self.kind == "fixed":
            return self.fixed_s
        if self.kind == "lognormal":
            return math.exp(self.mu + self.sigma**2 / 2)
        if self.kind == "file":
            return sum(self.samples_s) / len(self.samples_s)
        return 0.0


def lognormal_params(mean_s: float, p99_s: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with that mean and 99th percentile (the smaller-sigma root)."""
    if not (mean_s > 0 and p99_s > mean_s):
        raise LatencySpecError(f"lognormal needs 0 < MEAN_S < P99_S, got mean {mean_s}, p99 {p99_s}")
    # mean = exp(mu + s^2/2), p99 = exp(mu + Z99*s)  =>  s^2/2 - Z99*s + ln(p99/mean) = 0
    gap = math.log(p99_s / mean_s)
    disc = Z99**2 - 2 * gap
    if disc < 0:
        raise LatencySpecError(
            f"lognormal: p99 {p99_s} is more than {math.exp(Z99**2 / 2):.1f}x the mean {mean_s}; "
            "no lognormal has that shape"
        )
    sigma = Z99 - math.sqrt(disc)
    mu = math.log(mean_s) - sigma**2 / 2
    return mu, sigma


def _float(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError as e:
        raise LatencySpecError(f"latency {spec!r}: {text!r} is not a number of seconds") from e
    if not math.isfinite(value) or value < 0:
        raise LatencySpecError(f"latency {spec!r}: seconds must be finite and >= 0, got {text!r}")
    return value


def parse_latency(spec: str) -> LatencyProfile:
    """Parse a spec string (see the module docstring)."""
    kind, _, rest = spec.strip().partition(":")
    if kind == "none" and not rest:
        return LatencyProfile(spec=spec, kind="none")
    if kind == "fixed":
        return LatencyProfile(spec=spec, kind="fixed", fixed_s=_float(rest, spec))
    if kind == "lognormal":
        parts = rest.split(":")
        if len(parts) != 2:
            raise LatencySpecError(f"latency {spec!r}: expected lognormal:MEAN_S:P99_S")
        mu, sigma = lognormal_params(_float(parts[0], spec), _float(parts[1], spec))
        return LatencyProfile(spec=spec, kind="lognormal", mu=mu, sigma=sigma)
    if kind == "file":
        path = Path(rest)
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise LatencySpecError(f"latency {spec!r}: cannot read {path}: {e}") from e
        samples = tuple(
            _float(line.split("#")[0].strip(), spec) for line in lines if line.split("#")[0].strip()
        )
        if not samples:
            raise LatencySpecError(f"latency {spec!r}: {path} holds no delays")
        return LatencyProfile(spec=spec, kind="file", samples_s=samples)
    raise LatencySpecError(
        f"latency {spec!r}: expected none, fixed:SECONDS, lognormal:MEAN_S:P99_S or file:PATH"
    )
