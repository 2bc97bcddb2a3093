"""Packaging metadata: installing the project prints no setuptools deprecation warning."""

from __future__ import annotations

import warnings
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_pyproject_applies_without_deprecation_warnings() -> None:
    """Issue 19 item 15: ``project.license`` as a TOML table made setuptools warn three times on every install;
    the SPDX string form (PEP 639) does not, and it reaches the metadata as a license expression."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(PYPROJECT))
    messages = [str(w.message).splitlines()[0] for w in caught]
    assert not [m for m in messages if "license" in m.lower() or "deprecat" in m.lower()], messages
    assert dist.metadata.license_expression == "Apache-2.0"
