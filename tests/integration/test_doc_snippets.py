"""Every code block README.md and docs/*.md show is run (python) or loaded (yaml op lists) as written, extracted from
the markdown, so the docs and the code cannot drift apart.

Conventions, for whoever writes docs (an HTML comment on the line just before the fence, invisible when rendered):

- no comment: a ``python`` block runs in a fresh namespace after ``import torch, amp_patch``; a ``yaml`` block is
  loaded with ``amp_patch.load_op_lists`` (a first line ``# NAME.yaml`` also writes it under that name into the
  working directory of the python blocks of the same file, so they can use ``op_lists="NAME.yaml"``);
- ``<!-- snippet: setup=NAME -->``: run after the setup ``NAME`` below (a small model, optimizer, data...);
- ``<!-- snippet: signature=amp_patch.initialize -->``: the block is a signature; its parameter names and defaults
  must be the function's;
- ``<!-- snippet: no-run (why) -->``: not run; the reason is required.

``bash`` blocks are not run: tests/integration/test_doc_commands.py parses each of their commands with its program's
real argument parser (and runs the cheap ones). Other languages (text) are not checked.
Each block runs in a temporary working directory, and amp_patch is deinitialized (and the apex alias removed)
afterwards.
"""
import inspect
import re

import pytest
import torch
from tests_support import REPO
from tests_support import split_params as _split_params

import amp_patch
import amp_patch.legacy

ROOT = REPO
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)")
MARKER = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")

IMPORTS = "import torch, amp_patch\n"
TRAINING = IMPORTS + '''
class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))

torch.manual_seed(0)
device = "cpu"
model = MyModel()
optimizer = opt = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = loss_fn = torch.nn.functional.cross_entropy
x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
loader = [(x, y), (x, y)]
micro_batches = [(x[:4], y[:4]), (x[4:], y[4:])]
max_norm, lam = 1.0, 0.1
loss = criterion(model(x), y)
'''
SETUPS = {
    "training": TRAINING,
    "initialized": TRAINING + '''
model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1", verbosity=0)
opt = optimizer
inputs = x.clone().requires_grad_()
loss = criterion(model(inputs), y)
''',
    "gan": TRAINING + '''
gen, disc = MyModel(), torch.nn.Linear(2, 1)
opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
loss_d_real = disc(torch.randn(8, 2)).mean()
loss_d_fake = disc(gen(x).detach()).mean()
loss_g = gen(x).pow(2).mean()  # (built before opt_d.step(), so it must not go through disc's params)
''',
    "apex_script": IMPORTS + '''
with open("train.py", "w") as f:
    f.write("""import argparse, torch
from apex import amp
parser = argparse.ArgumentParser()
parser.add_argument("--opt-level", default="O1")
args = parser.parse_args()
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = amp.initialize(model, opt, opt_level=args.opt_level, verbosity=0)
with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
    scaled.backward()
opt.step()
""")
''',
}


def _blocks():
    """(path, line, language, marker, text) for every fenced block."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            marker = MARKER.match(lines[i - 1]) if i else None
            found.append((path, i + 1, fence.group(1), marker.group(1) if marker else "",
                          "\n".join(lines[i + 1:end]) + "\n"))
            i = end + 1
    return found


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if b[2] in ("python", "yaml")]


def _id(block):
    return f"{block[0].relative_to(ROOT)}:{block[1]}"


def _yaml_files(path):
    """The ``# NAME.yaml`` blocks of one markdown file: {name: text}."""
    out = {}
    for p, _, lang, _, text in BLOCKS:
        head = re.match(r"#\s*([\w.-]+\.ya?ml)\b", text)
        if p == path and lang == "yaml" and head:
            out[head.group(1)] = text
    return out


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    amp_patch.deinitialize()
    amp_patch.legacy.uninstall_apex_alias()


@pytest.mark.parametrize("block", RUN, ids=[_id(b) for b in RUN])
def test_snippet_runs_as_written(block, workdir):
    path, line, language, marker, text = block
    if marker.startswith("no-run"):
        assert re.match(r"no-run\s*\(.+\)", marker), f"{_id(block)}: 'no-run' needs a reason: no-run (why)"
        pytest.skip(f"marked {marker}")
    if marker.startswith("signature="):
        return _check_signature(marker.partition("=")[2], text)
    if language == "yaml":
        (workdir / "snippet.yaml").write_text(text)
        assert len(amp_patch.load_op_lists(str(workdir / "snippet.yaml"))) > 0
        return
    setup = marker.partition("=")[2] if marker.startswith("setup=") else None
    assert not marker or setup, f"{_id(block)}: unknown snippet marker {marker!r}"
    assert setup is None or setup in SETUPS, f"{_id(block)}: unknown setup {setup!r}; known: {sorted(SETUPS)}"
    for name, content in _yaml_files(path).items():
        (workdir / name).write_text(content)
    namespace = {"__name__": "__snippet__"}
    exec(compile(SETUPS[setup] if setup else IMPORTS, "<setup>", "exec"), namespace)
    exec(compile(text, _id(block), "exec"), namespace)


def _check_signature(target, text):
    module, _, name = target.rpartition(".")
    func = getattr(__import__(module, fromlist=[name]), name)
    start = text.index(name + "(") + len(name) + 1
    documented = [p for p in _split_params(text[start:text.rindex(")")]) if p]
    params = inspect.signature(func).parameters
    assert [p.split("=")[0].strip() for p in documented] == list(params), text
    for p in documented:
        pname, _, default = p.partition("=")
        if default:
            assert eval(default, {"torch": torch}) == params[pname.strip()].default, p


def test_snippets_are_found():
    """The extraction itself: blocks of the known files, with and without markers."""
    ids = {_id(b) for b in RUN}
    assert any(i.startswith("README.md:") for i in ids) and any(i.startswith("docs/recipes.md:") for i in ids)
    assert any(b[3].startswith("setup=") for b in RUN) and any(b[3].startswith("signature=") for b in RUN)
