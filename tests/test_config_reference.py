"""docs/configuration.md is generated from the config dataclasses: every key, its default and
its meaning; `phalanx train --help` lists the sections and points to the page."""

from __future__ import annotations

import dataclasses
import doctest
import re
from pathlib import Path

from phalanx import config
from phalanx.config import MEANINGS, Config, config_keys, reference_markdown
from phalanx.train import cli as train_cli

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_key_has_a_meaning_and_every_meaning_a_key():
    keys = [k for k, _ in config_keys()]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(MEANINGS)
    assert {"parallel.ep", "parallel.sequence_parallel", "train.prune.pattern", "checkpoint.async"} <= set(keys)


def test_keys_and_defaults_are_the_configs_own():
    """config_keys reads every leaf of Config (an independent walk of to_dict here)."""
    def leaves(d, prefix=""):
        for k, v in d.items():
            yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    # Config() resolves precision.policy=auto to this machine's policy; the reference shows the default
    want = dict(leaves(dataclasses.replace(Config()).to_dict()))
    got = dict(config_keys())
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if k != "precision.policy"} == \
        {k: v for k, v in want.items() if k != "precision.policy"}
    assert got["precision.policy"] == "auto"


def test_the_page_is_generated_from_the_code():
    assert PAGE.read_text() == reference_markdown(), \
        "docs/configuration.md is stale: regenerate with python -m phalanx.config --markdown > docs/configuration.md"
    for key, default in config_keys():
        assert f"| `{key}` | " in PAGE.read_text(), key


def test_train_help_lists_the_sections_and_points_to_the_page(capsys):
    try:
        train_cli.main_train(["--help"])
    except SystemExit as done:
        assert done.code == 0
    out = capsys.readouterr().out
    assert "docs/configuration.md" in out
    for section in ("model:", "parallel:", "precision:", "train:", "train.prune:", "data:", "run:", "checkpoint:"):
        assert f"\n  {section}" in out, section
    assert "sequence_parallel" in out and re.search(r"\bep\b", out)


def test_doctests():
    assert doctest.testmod(config).failed == 0
