"""docs/api.md names every public name, with the code's parameters and defaults, every subcommand option and every
record key. The names come from the code (``__all__`` of each public module, the argparse parser, real records),
so a name added anywhere in the package without its entry here fails a test."""
import argparse
import importlib
import inspect
import pkgutil
import re

import pytest
import torch
from tests_support import REPO
from tests_support import split_params as _split_params

import amp_patch
from amp_patch.legacy.mirror import TOP_LEVEL
from amp_patch.observe import trace as tracing
from amp_patch.tools import cli
from amp_patch.tools.experiment import VARIANTS, compare

DOC = (REPO / "docs" / "api.md").read_text(encoding="utf-8")


def _public_modules():
    """amp_patch and every importable submodule without a _private part that declares ``__all__``."""
    names = ["amp_patch"] + [info.name for info in pkgutil.walk_packages(amp_patch.__path__, "amp_patch.")
                             if not any(part.startswith("_") for part in info.name.split("."))]
    modules = [importlib.import_module(name) for name in names]
    public = [m for m in modules if hasattr(m, "__all__")]
    # a facade (amp_patch.distributed) shares its code home's __all__ (amp_patch.parallel.ddp): the facade's name is
    # the public one, documented; its home is not a second public module
    homes = {id(m.__all__): m for m in sorted(public, key=lambda m: m.__name__.count("."), reverse=True)}
    return [m for m in public if homes[id(m.__all__)] is m]


# Modules that re-create another package's API (Apex's modules, its C extensions) keep that package's names and
# signatures; they are documented in the doc named here (which api.md links), each name there in backticks.
FOREIGN = {"amp_patch.legacy.apex": "apex_modules.md", "amp_patch.legacy.amp_lists": "apex_modules.md",
           **{module: "apex_modules.md" for module in TOP_LEVEL.values()}}  # (amp_C, apex_C, syncbn, ...)


def _foreign_doc(module):
    for prefix, doc in FOREIGN.items():
        if module.__name__ == prefix or module.__name__.startswith(prefix + "."):
            return doc
    return None


PUBLIC = _public_modules()
NAMES = [(m, name) for m in PUBLIC for name in m.__all__]


def _sections(text, level):
    """{heading text: body} for the headings of one level (``## `` or ``### ``)."""
    marker = "#" * level + " "
    parts, current = {}, None
    for line in text.splitlines():
        if line.startswith(marker):
            current = line[len(marker):].strip()
            parts[current] = []
        elif current is not None and re.match(r"#{1,%d} " % level, line):
            current = None
        elif current is not None:
            parts[current].append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


def _module_section(module):
    sections = {re.match(r"`([\w.]+)`", h).group(1): body for h, body in _sections(DOC, 2).items()
                if re.match(r"`([\w.]+)`", h)}
    assert module.__name__ in sections, f"docs/api.md has no '## `{module.__name__}`' section"
    return sections[module.__name__]


def _documented_signature(section, name):
    """The parameters of the fullest ``name(...)`` code span (the entry's own; shorter ones are mentions)."""
    found = re.findall(r"`(?:amp_patch[\w.]*\.)?%s\((.*?)\)`" % re.escape(name), section, re.S)
    return max(found, key=len) if found else None


@pytest.mark.parametrize("module", PUBLIC, ids=lambda m: m.__name__)
def test_every_public_module_has_a_section(module):
    doc = _foreign_doc(module)
    if doc is not None:
        assert f"({doc})" in DOC, f"docs/api.md does not link {doc}, where {module.__name__} is documented"
        return
    _module_section(module)


@pytest.mark.parametrize("module, name", NAMES, ids=[f"{m.__name__}.{n}" for m, n in NAMES])
def test_every_public_name_is_documented(module, name):
    doc = _foreign_doc(module)
    if doc is not None:
        text = (REPO / "docs" / doc).read_text(encoding="utf-8")
        assert f"`{name}`" in text or f"`{name}(" in text, f"docs/{doc} does not name `{name}` ({module.__name__})"
        return
    section = _module_section(module)
    assert re.search(r"`(?:amp_patch[\w.]*\.)?%s(?:`|\()" % re.escape(name), section), \
        f"docs/api.md's `{module.__name__}` section does not document `{name}`"


def _needs_signature(module, name, obj):
    if not inspect.isfunction(inspect.unwrap(obj)):
        return False
    return module is amp_patch or getattr(amp_patch, name, None) is not obj  # re-exports: documented at the top


@pytest.mark.parametrize("module, name", NAMES, ids=[f"{m.__name__}.{n}" for m, n in NAMES])
def test_documented_signature_matches_the_code(module, name):
    if _foreign_doc(module) is not None:
        pytest.skip("another package's API: its signatures are that package's")
    obj = getattr(module, name)
    documented = _documented_signature(_module_section(module), name)
    if documented is None:
        assert not _needs_signature(module, name, obj), f"docs/api.md gives no `{name}(...)` signature"
        return
    params = inspect.signature(obj).parameters
    doc_params = [p.lstrip("*") for p in _split_params(documented)]
    assert [p.split("=")[0].strip() for p in doc_params] == list(params), f"{name}: {documented}"
    namespace = {"torch": torch, **vars(module)}
    for text in doc_params:
        pname, _, default = text.partition("=")
        expected = params[pname.strip()].default
        if default:
            assert eval(default, namespace) == expected, f"{name}: {pname}={default}, the code says {expected!r}"
        else:
            assert expected is inspect.Parameter.empty, f"{name}: {pname} has a default ({expected!r}) in the code"


def _subcommands():
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(action.choices.items())


@pytest.mark.parametrize("name, parser", _subcommands(), ids=[n for n, _ in _subcommands()])
def test_every_subcommand_and_option_is_documented(name, parser):
    sections = _sections(DOC, 3)
    heading = f"`amp-patch {name}`"
    assert heading in sections, f"docs/api.md has no '### {heading}' section"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings or [action.metavar or action.dest]:
            if option != "args":
                assert option in sections[heading], f"amp-patch {name}: {option} is not in docs/api.md"


def _keys(value, found):
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not key.startswith("loss_scaler"):
                found.add(key)
            _keys(item, found)
    elif isinstance(value, list):
        for item in value:
            _keys(item, found)
    return found


@pytest.fixture(scope="module")
def records():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", diagnose_overflow=True, verbosity=0)
    try:
        loss = model(torch.tensor([[float("inf"), 1.0]])).float().sum()
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        with amp_patch.trace() as tracer:
            model(torch.ones(1, 2))
        return [amp_patch.history(), amp_patch.last_overflow(), amp_patch.state_dict(), tracer.report(),
                tracer.unpatched_report()]
    finally:
        amp_patch.deinitialize()


def _experiment_report():
    from test_experiment import tiny_data, tiny_loss, tiny_model, tiny_optimizer
    return compare(tiny_model, tiny_optimizer, tiny_data, tiny_loss, variants=("fp32",), steps=3, batch_size=8,
                   isolate=False, progress=False)


def test_every_record_key_is_documented(records):
    schemas = _sections(DOC, 2)["Record schemas"]
    found = _keys(records + [_experiment_report(), {"rows": [], "unpatched_on_half": []}], set())
    found = (found | set(tracing._FIELDS)) - set(VARIANTS)  # (the keys of a report's "variants" are their names)
    assert {"scale_before", "first_bad_module", "unskipped", "cache_misses", "ratio_to_fp32_min"} <= found
    missing = sorted(k for k in found if f"`{k}`" not in schemas and f'"{k}"' not in schemas)
    assert not missing, f"record keys missing from docs/api.md's 'Record schemas': {missing}"
