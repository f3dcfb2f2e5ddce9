"""The package's import contracts (``.importlinter``, checked with
import-linter): no new import cycle between sibling modules or packages,
and no library module importing a benchmark or a demo."""

import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint(config: str, cwd: str) -> int:
    from importlinter.cli import lint_imports

    old = os.getcwd()
    os.chdir(cwd)
    try:
        return lint_imports(config_filename=config, no_cache=True)
    finally:
        os.chdir(old)


def test_package_keeps_its_import_contracts():
    pytest.importorskip("importlinter")
    assert _lint(os.path.join(ROOT, ".importlinter"), ROOT) == 0


def test_a_new_cycle_breaks_the_contract(tmp_path, monkeypatch):
    """The same contract type on a two-module package whose modules import
    each other: broken (so the check above is one that can fail)."""
    pytest.importorskip("importlinter")
    pkg = tmp_path / "cyclic_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (tmp_path / "contracts.ini").write_text(textwrap.dedent("""\
        [importlinter]
        root_package = cyclic_pkg

        [importlinter:contract:acyclic]
        name = no cycles
        type = acyclic_siblings
        ancestors =
            cyclic_pkg
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _lint(str(tmp_path / "contracts.ini"), str(tmp_path)) != 0
