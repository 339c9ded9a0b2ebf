"""Packaging: every subpackage is declared, the op lists ship inside the installed package and all load."""
import configparser
import pathlib

import amp_patch
from amp_patch import oplist

REPO = pathlib.Path(__file__).resolve().parent.parent


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
        assert len(table) > 100 and not table.skipped, name


def test_installed_package_serves_its_own_copy():
    """A non-editable install (the README/CI install) must find the lists inside the package itself."""
    package_dir = pathlib.Path(amp_patch.__file__).resolve().parent
    apex = pathlib.Path(str(oplist._shipped_dir() / "apex.yaml")).resolve()  # (a MultiplexedPath when installed)
    if package_dir.parent == REPO:  # running from the source checkout: op_lists/ beside the package
        assert apex == REPO / "op_lists" / "apex.yaml"
    else:
        assert apex == package_dir / "op_lists" / "apex.yaml" and apex.is_file()
