"""The package's floor plan holds: no import cycles, the library never imports the tools, imports point down one
floor plan, few modules beside the folders, and every process-wide patch is catalogued and undone."""
import ast
import pathlib

import torch

import amp_patch
from amp_patch.patching import registry

PACKAGE = pathlib.Path(amp_patch.__file__).resolve().parent
FACADE = "amp_patch"  # the public names; its lazy entry points (amp_patch.doctor) load a tool on first call


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports():
    """module -> the amp_patch modules it imports (at module level or inside functions)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    found.add(full if full in modules else module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycles(graph):
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


#: The floor plan, bottom up (docs/architecture.md "Layers"): a package imports only from floors below its own
#: (module level or inside functions). The facade ``amp_patch`` and its siblings re-export; the lazy entry points
#: ``amp_patch.doctor`` / ``amp_patch.speed_report`` (facade -> tools) are the one documented upward import.
FLOORS = (
    ("errors",),
    ("_torch",),
    ("patching",),
    ("config",),
    ("casting",),
    ("weights",),
    ("model",),
    ("parallel",),
    ("observe",),
    ("scaling",),
    ("session",),
    ("", "distributed", "fsdp2"),
    ("integrations", "legacy"),
    ("lightning", "tools"),
    ("experiment", "precision_doctor", "__main__"),
)
DOCUMENTED_UPWARD = {("", "tools")}


def _package(module):
    """``amp_patch.scaling.scaler`` -> ``scaling``; the facade ``amp_patch`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _package_edges():
    edges = {}
    for name, deps in _imports().items():
        for dep in deps:
            if _package(dep) != _package(name):
                edges.setdefault((_package(name), _package(dep)), set()).add(f"{name} -> {dep}")
    return edges


def test_no_module_imports_itself_back_through_others():
    graph = _imports()
    graph[FACADE] = {m for m in graph[FACADE] if not m.startswith("amp_patch.tools")}
    assert _cycles(graph) == []


def test_no_package_imports_itself_back_through_others():
    """Counting imports inside functions too, the sub-packages form no cycle (the lazy facade -> tools aside)."""
    graph = {}
    for (src, dst) in _package_edges():
        if (src, dst) not in DOCUMENTED_UPWARD:
            graph.setdefault(src, set()).add(dst)
            graph.setdefault(dst, set())
    assert _cycles(graph) == []


def test_every_package_sits_on_a_floor():
    floors = {pkg for floor in FLOORS for pkg in floor}
    found = {_package(name) for name in _imports()}
    assert found - floors == set(), "add the new package to FLOORS (and to docs/architecture.md's layer list)"


def test_imports_point_down_the_floor_plan():
    floor_of = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}
    upward = {f"{src or FACADE} -> {dst or FACADE}": sorted(why) for (src, dst), why in _package_edges().items()
              if floor_of[dst] >= floor_of[src] and (src, dst) not in DOCUMENTED_UPWARD}
    assert upward == {}


def test_the_documented_floor_plan_is_this_one():
    repo = pathlib.Path(__file__).resolve().parents[2]  # (the package may be installed: the docs are the checkout's)
    doc = (repo / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = doc.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    for floor in FLOORS:
        for pkg in floor:
            assert f"`{pkg or FACADE}`" in listed, f"docs/architecture.md's layer list does not name {pkg or FACADE}"


def test_the_library_never_imports_the_tools():
    allowed = (FACADE, "amp_patch.__main__", "amp_patch.experiment", "amp_patch.precision_doctor")
    offenders = {name: sorted(m for m in deps if m.startswith("amp_patch.tools"))
                 for name, deps in _imports().items() if not name.startswith(("amp_patch.tools",) + allowed)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_few_modules_sit_beside_the_folders():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 6, top


def test_every_process_wide_patch_besides_op_sites_is_catalogued():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LSTM(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        engine = amp_patch.session.state.active_engine()
        entry_names = {entry.name for entry in engine.table.entries}
        op_sites = {site for patch, site in zip(engine.patcher.patches, engine.patcher.sites())
                    if patch.name in entry_names}
        others = [site for site in registry.installed() if site not in op_sites]
    finally:
        amp_patch.deinitialize()
    catalogued = {site for site, _, _ in registry.CATALOGUE}
    stepped = {s for s in others if s.endswith(".step")}
    assert stepped, "no optimizer step patch seen: the test no longer drives a session"
    guarded = {s for s in others if s.endswith(".forward")}  # ("<class of each model passed>.forward")
    assert guarded == {"torch.nn.modules.container.Sequential.forward"}
    assert [s for s in others if s not in catalogued and s not in stepped and s not in guarded
            and not s.startswith("torch.utils.checkpoint._checkpoint_without_reentrant_generator")] == []
    assert registry.installed() == []


def test_one_module_names_every_weight_layout_the_policy_can_choose():
    from amp_patch.config import opt_levels
    from amp_patch.weights import layouts

    chosen = set()
    for level in opt_levels.OPT_LEVELS:
        for api in opt_levels.APIS:
            for sharded in (False, True):
                for rounding in (None, "split"):
                    try:
                        props = opt_levels.resolve(level, api=api, fsdp2_sharded=sharded, master_rounding=rounding,
                                                   half_dtype=torch.bfloat16)
                    except Exception:
                        continue
                    chosen.add(props.weight_layout)
    assert chosen == set(layouts.LAYOUTS)
    for name in layouts.LAYOUTS:
        assert f"\n{name} " in layouts.__doc__
