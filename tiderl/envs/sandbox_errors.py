"""What the sandbox raises (`tiderl.envs.sandbox` and the modules it runs on: bwrap, cgroups, uids).

Its own module so that those modules and `sandbox` can share the classes without importing each
other; `tiderl.envs.sandbox` re-exports both.
"""

from __future__ import annotations


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not the code failing: that is a result)."""


class SandboxUnavailableError(SandboxError):
    """The `bwrap` isolation cannot work on this machine; the message says why."""
