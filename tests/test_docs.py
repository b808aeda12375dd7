"""The docs name only what exists: repository paths, config keys, run-directory files, linked pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tiderl.config import JobConfig
from tiderl.config.schema import iter_fields

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
CODE = re.compile(r"`([^`\n]+)`")
REPO_DIRS = ("tiderl/", "jobs/", "tools/", "slurm/", "tests/", "docs/", ".ci/")
SECTIONS = {key for key, _tp, _f in iter_fields(JobConfig) if "." not in key}
KEYS = {key for key, _tp, _f in iter_fields(JobConfig)}
FILE_SUFFIXES = (".py", ".yaml", ".md", ".safetensors", ".json", ".pt", ".url", ".log", ".db", ".txt", ".conf", ".sh",
                 ".sbatch", ".out", ".err", ".port", ".token", ".png", ".csv")
SOURCE = "\n".join(p.read_text() for p in (ROOT / "tiderl").rglob("*.py"))


def _spans(doc: Path) -> list[tuple[int, str]]:
    out = []
    in_fence = False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if not in_fence:
            out += [(n, m.group(1).strip()) for m in CODE.finditer(line)]
    return out


def _repo_path(text: str) -> str | None:
    word = text.split()[0] if text.split() else ""
    if not word.startswith(REPO_DIRS) or any(c in word for c in "*{}<>$"):
        return None
    return re.sub(r"(:\d+(-\d+)?|[,.;:)]+)$", "", word)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_repository_paths_the_docs_name_exist(doc: Path) -> None:
    missing = [f"{doc.name}:{n}: {path}" for n, text in _spans(doc)
               if (path := _repo_path(text)) and not (ROOT / path).exists()
               # An upper-case placeholder (jobs/sim/JOBSTEM.workload.yaml) stands for any name.
               and not any(ROOT.glob(re.sub(r"[A-Z][A-Z_]+", "*", path)))]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_config_keys_the_docs_name_exist(doc: Path) -> None:
    bad = []
    for n, text in _spans(doc):
        for word in re.findall(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)(?==|\b)", text):
            section = word.split(".")[0]
            if section not in SECTIONS or word in KEYS or word.endswith(FILE_SUFFIXES):
                continue
            if word.endswith("_") and any(k.startswith(word) for k in KEYS):  # a family: rollout.ctb_weight_*
                continue
            bad.append(f"{doc.name}:{n}: {word}")
    assert not bad, "\n".join(bad)


def _named_in_source(part: str) -> bool:
    """`part` of a run-directory path appears as a string in the code (or, for NAME.EXT, NAME as a
    string and .EXT in a format string: f"{name}.url" with name "control")."""
    def quoted(word: str) -> bool:
        return re.search(rf"['\"/]{re.escape(word)}['\"/]|\"{re.escape(word)}|{re.escape(word)}\"", SOURCE) is not None

    stem, dot, ext = part.rpartition(".")
    return quoted(part) or bool(dot and stem and quoted(stem) and f".{ext}" in SOURCE)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_run_directory_files_the_docs_name_are_written_by_the_code(doc: Path) -> None:
    bad = []
    in_fence = False
    for n, text in enumerate(doc.read_text().splitlines(), 1):  # in code spans and in prose
        if text.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence:  # an example's own files (a cron job's output), not the run's
            continue
        for path in re.findall(r"RUN_DIR/([\w./{}-]+)", text):
            parts = [p for p in path.rstrip("/.").split("/") if p and "{" not in p and "*" not in p]
            for part in parts:
                if re.search(r"[A-Z][A-Z_]+", part):  # a placeholder: RUN_DIR/metrics/NAME.url
                    continue
                if not _named_in_source(part):
                    bad.append(f"{doc.name}:{n}: RUN_DIR/{path} ({part!r} appears nowhere in tiderl/)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_linked_pages_exist(doc: Path) -> None:
    bad = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
            if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists():
                bad.append(f"{doc.name}:{n}: {target}")
    assert not bad, "\n".join(bad)
