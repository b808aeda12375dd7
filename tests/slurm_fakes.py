"""A stand-in for `tiderl.slurm.cluster`'s command runner, for unit tests of what sits on top of it."""

from __future__ import annotations

from collections.abc import Sequence


class FakeRunner:
    """Records each argv; answers from a table keyed by the command name (an exception is raised)."""

    def __init__(self, answers: dict[str, str | Exception]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        answer = self.answers[argv[0]]
        if isinstance(answer, Exception):
            raise answer
        return answer
