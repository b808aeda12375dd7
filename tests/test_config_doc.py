from __future__ import annotations

from pathlib import Path

from gen_config_doc import render


def test_config_reference_is_current() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert page == render(), "docs/config.md is stale: run `python tools/gen_config_doc.py > docs/config.md`"
