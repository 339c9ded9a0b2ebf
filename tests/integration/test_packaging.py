"""Packaging: every subpackage is declared, the op lists ship inside the installed package and all load."""
import configparser
import pathlib

from tests_support import REPO

import amp_patch
from amp_patch.config import oplist

REPO = REPO


def test_setup_cfg_declares_every_subpackage():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    declared = set(cfg["options"]["packages"].split())
    on_disk = {"amp_patch"} | {"amp_patch." + p.parent.relative_to(REPO / "amp_patch").as_posix().replace("/", ".")
                               for p in (REPO / "amp_patch").rglob("__init__.py") if p.parent != REPO / "amp_patch"}
    assert on_disk | {"amp_patch.op_lists"} == declared
    assert cfg["options.package_data"]["amp_patch.op_lists"].strip() == "*.yaml"


def test_every_yaml_in_op_lists_ships_and_loads():
    in_repo = sorted(p.stem for p in (REPO / "op_lists").glob("*.yaml"))
    assert amp_patch.shipped_names() == in_repo
    for name in in_repo:
        table = amp_patch.load_op_lists(name)
        # skipped only by a declared version bound (an op this torch release lacks), never an absent optional entry
        assert len(table) > 100 and all(s.reason.startswith("needs torch") for s in table.skipped), name


def test_installed_package_serves_its_own_copy():
    """A non-editable install (the README/CI install) must find the lists inside the package itself."""
    package_dir = pathlib.Path(amp_patch.__file__).resolve().parent
    apex = pathlib.Path(str(oplist._shipped_dir() / "apex.yaml")).resolve()  # (a MultiplexedPath when installed)
    if package_dir.parent == REPO:  # running from the source checkout: op_lists/ beside the package
        assert apex == REPO / "op_lists" / "apex.yaml"
    else:
        assert apex == package_dir / "op_lists" / "apex.yaml" and apex.is_file()


def _floor(spec):
    """(major, minor) of a '>=X.Y' requirement."""
    import re
    match = re.search(r">=\s*(\d+)\.(\d+)", spec)
    assert match, spec
    return int(match.group(1)), int(match.group(2))


def test_declared_floors_are_what_the_tests_run():
    """python_requires and the torch range are the tested ones (amp_patch._torch.compat, README); the torch CI's
    README flow installs (constraints.txt) lies inside that range."""
    import sys

    from amp_patch._torch import compat as torch_compat
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    requires = {line.split(">=")[0].split("=")[0].strip(): line.strip()
                for line in cfg["options"]["install_requires"].splitlines() if line.strip()}
    py_floor, torch_floor = _floor(cfg["options"]["python_requires"]), _floor(requires["torch"])
    pinned = next(line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    assert requires["torch"] == torch_compat.REQUIREMENT
    assert torch_floor == torch_compat.release(torch_compat.TESTED[0])[:2]
    assert torch_compat.tested(pinned.split("==")[1]), (pinned, requires["torch"])
    assert torch_compat.tested() and sys.version_info >= py_floor
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"Python >= {py_floor[0]}.{py_floor[1]}" in readme and torch_compat.REQUIREMENT in readme
    assert "numpy" in requires  # torch warns "Failed to initialize NumPy" in every process without it


def test_license_file_classifiers_and_project_urls():
    """The declared BSD-3-Clause licence ships as a file; the metadata says what the package is."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    meta = cfg["metadata"]
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert meta["license"] == "BSD-3-Clause" and meta["license_files"].strip() == "LICENSE"
    assert text.startswith("BSD 3-Clause License") and "Copyright (c) 2026, amp_patch developers" in text
    assert "Neither the name of the copyright holder" in text  # the third clause
    classifiers = meta["classifiers"].split("\n")
    assert "Framework :: Pytest" not in classifiers and "License :: OSI Approved :: BSD License" in classifiers
    urls = dict(line.split(" = ", 1) for line in meta["project_urls"].strip().splitlines())
    assert set(urls) == {"Source", "Documentation", "Issues"} and all(u.startswith("https://") for u in urls.values())


def test_the_long_description_has_no_relative_links():
    """README.md is the package index page: a relative link (docs/...) would point nowhere there."""
    import re
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert [link for link in links if not link.startswith(("https://", "http://", "#"))] == []
