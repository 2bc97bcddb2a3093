"""The documentation of the ``LIGHTINFER_*`` switches follows the code: the tables in docs/architecture.md and
kernels/README.md are ``switches.markdown_table()``, and no document names a variable the code does not read."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lightinfer.kernels import switches

ROOT = Path(__file__).resolve().parent.parent
TABLES = ("docs/architecture.md", "kernels/README.md")
FIX = ("python -c \"from lightinfer.kernels import switches; "
       "switches.write_tables(['docs/architecture.md', 'kernels/README.md'])\"")
# variables read outside the kernels: the server's key, the test suite's and the benchmarks' own
OTHER_VARIABLES = {"LIGHTINFER_API_KEY", "LIGHTINFER_TEST_MODEL", "LIGHTINFER_TEST_KV_CACHE_DTYPE",
                   "LIGHTINFER_SMOLLM2_AWQ", "LIGHTINFER_TOOLS_VENV"}


@pytest.mark.parametrize("path", TABLES)
def test_the_switches_table_is_generated_from_the_code(path: str) -> None:
    text = (ROOT / path).read_text(encoding="utf-8")
    assert switches.replace_table(text) == text, f"{path}'s switches table drifted from kernels/switches.py; run {FIX}"


def test_every_switch_has_its_variable_role_and_effect() -> None:
    table = switches.markdown_table()
    for f in dataclasses.fields(switches.KernelSwitches):
        assert f.metadata["role"] in switches.ROLES, f.name
        assert f.metadata["env"].startswith("LIGHTINFER_") and f.metadata["effect"], f.name
        assert f"`{f.metadata['env']}`" in table
    assert len(table.splitlines()) == 2 + len(dataclasses.fields(switches.KernelSwitches))


def test_no_document_names_a_variable_the_code_does_not_read() -> None:
    known = {f.metadata["env"] for f in dataclasses.fields(switches.KernelSwitches)} | OTHER_VARIABLES
    docs = [ROOT / "README.md", ROOT / "kernels" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unknown = {(p.relative_to(ROOT).as_posix(), name) for p in docs
               for name in re.findall(r"LIGHTINFER_[A-Z0-9_]*[A-Z0-9]", p.read_text(encoding="utf-8"))
               if name not in known}
    assert not unknown, f"documents name variables the code does not read: {sorted(unknown)}"


def test_replace_table_needs_its_markers() -> None:
    with pytest.raises(ValueError, match="switches:begin"):
        switches.replace_table("no table here")
    filled = switches.replace_table(f"a\n{switches.TABLE_BEGIN}\nold\n{switches.TABLE_END}\nb")
    assert filled == f"a\n{switches.TABLE_BEGIN}\n{switches.markdown_table()}\n{switches.TABLE_END}\nb"
