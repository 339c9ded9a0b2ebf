"""Op lists: load, validate and layer the YAML tables that drive casting.

See docs/op_lists.md for the schema. The result of loading is an immutable
:class:`OpTable`; nothing here patches anything.
"""
import dataclasses
import importlib.resources
import logging
import os
import pathlib
from collections.abc import Mapping

import torch

from ..errors import ConfigError, OpListError
from ..patching.resolve import resolve_name, resolve_target
from . import _yaml
from . import fp8 as _fp8
from . import scopes as _scopes
from .aliases import check_aliases
from .torch_bounds import version_message, version_skip

log = logging.getLogger("amp_patch")

CATEGORIES = ("half", "float", "promote", "sequence_promote", "fp8", "banned")
_TOP_KEYS = ("description", "schema_version", "extends", "add", "remove", "scopes", "fp8_recipe") + CATEGORIES
_ENTRY_KEYS = ("name", "optional", "min_torch", "max_torch", "message", "strict", "note")
DEFAULT_BANNED_MESSAGE = ("{qualname} is banned under amp_patch: it is unsafe in {dtype}. "
                          "Remove it from the op list's 'banned' category, "
                          "or pass allow_banned=True to run it in float32.")


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """One op-list entry: ``target.name`` runs under ``category``; ``path:line`` put it there."""

    target: str
    name: str
    category: str
    path: str
    line: int
    message: str = None
    strict: bool = False  # banned only: raise on any input, not only when an argument is half
    scope: str = None  # the module-path glob of a ``scopes:`` entry; None for the global list

    @property
    def qualname(self):
        return f"{self.target}.{self.name}"


@dataclasses.dataclass(frozen=True)
class SkippedEntry:
    """A declared version-dependent entry that this torch does not have."""

    entry: OpEntry
    reason: str


class OpTable:
    """An immutable, ordered set of entries keyed by ``(target, name)``."""

    def __init__(self, entries=(), skipped=(), sources=(), scopes=(), fp8_recipe=_fp8.DEFAULT_RECIPE):
        self._entries = {(e.target, e.name): e for e in entries}
        self.fp8_recipe = fp8_recipe  # how the fp8 category scales (amp_patch.config.fp8.RECIPES)
        self.skipped = tuple(skipped)
        self.sources = tuple(sources)
        self.scopes = tuple(scopes)  # scopes.Scope, from the ``scopes:`` sections (see amp_patch.casting.scopes)

    @property
    def entries(self):
        return tuple(self._entries.values())

    def get(self, target, name):
        return self._entries.get((target, name))

    def category_of(self, target, name):
        entry = self._entries.get((target, name))
        return entry.category if entry else None

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return key in self._entries

    def counts(self):
        counts = dict.fromkeys(CATEGORIES, 0)
        for entry in self._entries.values():
            counts[entry.category] += 1
        return counts

    def __repr__(self):
        return f"OpTable({len(self)} entries, sources={list(self.sources)})"


def shipped_names():
    """Names of the op lists that ship with amp_patch."""
    return sorted(p.name[:-5] for p in _shipped_dir().iterdir() if p.name.endswith(".yaml"))


def _shipped_dir():
    """``amp_patch/op_lists`` in an installed package; ``op_lists/`` beside the package in a source checkout."""
    try:
        return importlib.resources.files("amp_patch.op_lists")
    except ModuleNotFoundError:
        return pathlib.Path(__file__).resolve().parent.parent.parent / "op_lists"


def _read_shipped(name):
    resource = _shipped_dir() / f"{name}.yaml"
    if not resource.is_file():
        raise ConfigError(f"op_lists={name!r}: no shipped op list of that name; shipped: "
                          f"{', '.join(shipped_names())}; or pass a path to a YAML file")
    # entries and sources keep the short name; errors name the file as the user can open it
    opened = os.path.realpath(resource) if isinstance(resource, pathlib.Path) else f"op_lists/{name}.yaml"
    return resource.read_text(encoding="utf-8"), f"op_lists/{name}.yaml", None, opened


def _looks_like_path(spec):
    return isinstance(spec, os.PathLike) or os.sep in spec or "/" in spec or spec.endswith((".yaml", ".yml"))


def _read_path(spec, relative_to=None):
    path = os.fspath(spec)
    if relative_to and not os.path.isabs(path):
        path = os.path.join(relative_to, path)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path, os.path.dirname(os.path.abspath(path)), path
    except (OSError, ValueError) as exc:  # ValueError: embedded null byte
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"op list file {path!r} cannot be read ({reason}); pass an existing YAML file "
                          f"or a shipped name ({', '.join(shipped_names())})") from None


#: the shipped list amp_patch's own API loads when ``op_lists`` is not given: native autocast's policy on the device
DEVICE_LISTS = {"cuda": "torch_cuda", "cpu": "torch_cpu"}


def default_list_name(device_type):
    """The shipped op list ``initialize`` and ``amp_patch.autocast()`` use without ``op_lists``: the policy native
    ``torch.autocast`` applies on ``device_type`` (``torch_cuda``, ``torch_cpu``); ``apex`` for a device type with
    no shipped torch list. Under the apex alias the default stays ``apex`` (legacy scripts keep Apex's lists)."""
    return DEVICE_LISTS.get(device_type, "apex")


def load_op_lists(spec=None, *, default="apex"):
    """Load ``spec`` into an :class:`OpTable`.

    ``spec`` is a shipped name (``"apex"``), a path, a mapping in the op-list
    schema, or a sequence of these applied in order; ``None`` means ``default``.
    """
    if spec is None:
        spec = default
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ConfigError("op_lists=[] is empty; pass at least one shipped name, path or mapping")
        table = None
        for item in spec:
            table = _load_one(item, base=table, stack=())
        return table
    return _load_one(spec, base=None, stack=())


def _load_one(spec, base, stack, relative_to=None):
    if isinstance(spec, Mapping):
        return _Document(_as_map(spec), "<mapping>", None).build(base, stack)
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"op_lists item {spec!r} ({type(spec).__name__}) is not supported; pass a shipped "
                          "name, a path, a mapping, or a list of these")
    if isinstance(spec, str) and not _looks_like_path(spec):
        text, path, folder, opened = _read_shipped(spec)
    else:
        text, path, folder, opened = _read_path(spec, relative_to)
    key = os.path.realpath(path) if folder else path  # realpath: a symlinked folder cannot hide a cycle
    if key in stack:
        raise ConfigError(f"op list {path!r} extends itself through {' -> '.join(stack)}; remove the cycle")
    doc = _yaml.load(text, opened)
    return _Document(doc, path, folder, opened).build(base, stack + (key,))


def _as_map(mapping):
    """Convert a user's plain dict into the line-annotated form (lines unknown)."""
    if isinstance(mapping, _yaml.Map):
        return mapping
    out = _yaml.Map()
    for key, value in mapping.items():
        out[key] = _as_map(value) if isinstance(value, Mapping) else (
            _as_seq(value) if isinstance(value, (list, tuple)) else value)
        out.key_lines[key] = None
    return out


def _as_seq(seq):
    out = _yaml.Seq(_as_map(v) if isinstance(v, Mapping) else v for v in seq)
    out.item_lines = [None] * len(out)
    return out


class _Document:
    """One parsed YAML document and the rules that turn it into a table."""

    def __init__(self, doc, path, folder, opened=None):
        self.doc, self.path, self.folder = doc, path, folder
        self.opened = opened or path  # the path errors name: a shipped list's real file
        self.skipped = []

    def error(self, line, message, entry=None):
        return OpListError(self.opened, line, message, entry=entry)

    def build(self, base, stack):
        doc = self.doc
        if not isinstance(doc, _yaml.Map):
            raise self.error(getattr(doc, "line", 1), "an op list must be a mapping with keys such as "
                             f"{', '.join(_TOP_KEYS)}; got {type(doc).__name__}")
        self._check_top_keys()
        has_categories = any(c in doc for c in CATEGORIES)
        if "extends" in doc and has_categories:
            raise self.error(doc.key_lines["extends"], "'extends' cannot be combined with top-level categories "
                             f"({', '.join(c for c in CATEGORIES if c in doc)}); put additions under 'add:'")
        if "extends" in doc:
            base = self._load_extends(stack)
        entries = dict(self._parse_categories(doc)) if has_categories else dict(base._entries if base else {})
        skipped = list(self.skipped if has_categories else (base.skipped if base else ()))
        sources = [self.path] if has_categories else list(base.sources if base else ()) + [self.path]
        self.skipped = []
        if "remove" in doc:
            self._apply_remove(entries, doc["remove"], doc.key_lines["remove"])
        if "add" in doc:
            self._apply_add(entries, doc["add"], doc.key_lines["add"])
        scopes = self._scopes(None if has_categories else base)
        check_aliases(entries.values(), self.path)
        inherited = base.fp8_recipe if base is not None and not has_categories else _fp8.DEFAULT_RECIPE
        return OpTable(entries.values(), skipped + self.skipped, sources, scopes, _fp8.read_recipe(self, inherited))

    def _scopes(self, base):
        inherited = base.scopes if base is not None else ()
        if "scopes" not in self.doc:
            return inherited
        return _scopes.merge_scopes(inherited, _scopes.parse_scopes(self, self.doc["scopes"],
                                                                    self.doc.key_lines["scopes"], self._parse_block))

    def _check_top_keys(self):
        for key, line in self.doc.key_lines.items():
            if key not in _TOP_KEYS:
                hint = " (did you mean 'float'?)" if key in ("fp32", "float32") else (
                    " (did you mean 'half'?)" if key in ("fp16", "bf16", "float16", "lower_precision_fp") else "")
                raise self.error(line, f"unknown key {key!r}{hint}; allowed keys: {', '.join(_TOP_KEYS)}", key)
        version = self.doc.get("schema_version", 1)
        if version != 1 or type(version) is not int:
            raise self.error(self.doc.key_lines.get("schema_version"),
                             f"schema_version {version!r} is not supported; this amp_patch reads schema_version 1")
        if "description" in self.doc and not isinstance(self.doc["description"], str):
            raise self.error(self.doc.key_lines["description"], "description must be a string")

    def _load_extends(self, stack):
        name = self.doc["extends"]
        line = self.doc.key_lines["extends"]
        if not isinstance(name, str) or not name:
            raise self.error(line, f"extends must be a shipped list name or a path, got {name!r}", name)
        try:
            return _load_one(name, None, stack, relative_to=self.folder or os.getcwd())
        except ConfigError as exc:
            if isinstance(exc, OpListError):
                raise
            raise self.error(line, f"extends {name!r}: {exc}", name) from None

    def _parse_categories(self, doc):
        seen = {}
        for category in CATEGORIES:
            if category in doc:
                for entry in self._parse_block(category, doc[category], doc.key_lines[category]):
                    key = (entry.target, entry.name)
                    if key in seen:
                        first = seen[key]
                        raise self.error(entry.line, f"{entry.qualname} is listed twice: as {entry.category} here "
                                         f"and as {first.category} at line {first.line}; keep one", entry.name)
                    seen[key] = entry
        return seen.items()

    def _parse_block(self, category, block, line):
        if block is None:
            return []
        if not isinstance(block, _yaml.Map):
            raise self.error(line, f"category {category!r} must map targets to lists of names, e.g. "
                             f"'{category}: {{torch: [matmul]}}'; got {type(block).__name__}")
        entries = []
        for target, names in block.items():
            owner = self._target(target, block.key_lines[target])
            if not isinstance(names, _yaml.Seq):
                raise self.error(block.key_lines[target], f"{category}.{target} must be a list of names, "
                                 f"got {type(names).__name__} {names!r}", target)
            for item, item_line in zip(names, names.item_lines):
                entry = self._entry(category, target, owner, item, item_line or block.key_lines[target])
                if entry is not None:
                    entries.append(entry)
        return entries

    def _target(self, target, line):
        try:
            return resolve_target(target)
        except ConfigError as exc:
            raise self.error(line, str(exc), target) from None

    def _entry(self, category, target, owner, item, line):
        spec = self._entry_spec(category, target, item, line)
        entry = OpEntry(target, spec["name"], category, self.path, line, spec.get("message"),
                        spec.get("strict", False))
        skip_reason = version_skip(spec)
        if skip_reason:
            note = spec.get("note")
            self.skipped.append(SkippedEntry(entry, f"{skip_reason} ({note})" if note else skip_reason))
            return None
        try:
            resolve_name(target, owner, spec["name"])
        except ConfigError as exc:
            if spec.get("optional"):
                self.skipped.append(SkippedEntry(entry, f"optional and absent: {exc}"))
                return None
            raise self.error(line, str(exc), spec["name"]) from None
        _fp8.check_entry(self, entry)
        return entry

    def _entry_spec(self, category, target, item, line):
        if isinstance(item, str):
            return {"name": item}
        if not isinstance(item, _yaml.Map):
            raise self.error(line, f"entry {item!r} under {category}.{target} must be a name or a mapping "
                             "with 'name:'", item)
        for key, key_line in item.key_lines.items():
            if key not in _ENTRY_KEYS:
                raise self.error(key_line or line, f"unknown entry key {key!r}; allowed: {', '.join(_ENTRY_KEYS)}", key)
        if not isinstance(item.get("name"), str):
            raise self.error(line, f"entry under {category}.{target} needs 'name: <op name>', got {item.get('name')!r}")
        self._check_entry_values(category, item, line)
        return item

    def _check_entry_values(self, category, item, line):
        name = item["name"]
        if "optional" in item and not isinstance(item["optional"], bool):
            raise self.error(line, f"{name}: optional must be true or false, got {item['optional']!r}", name)
        if "message" in item and (category != "banned" or not isinstance(item["message"], str)):
            raise self.error(line, f"{name}: 'message' is a string and only allowed on banned entries", name)
        if "strict" in item and (category != "banned" or not isinstance(item["strict"], bool)):
            raise self.error(line, f"{name}: 'strict' is true or false and only allowed on banned entries", name)
        for key in ("min_torch", "max_torch"):
            if key in item:
                # TorchVersion falls back to *string* comparison for invalid versions, so parse explicitly; floats
                # are rejected because YAML reads 2.10 as 2.1.
                try:
                    if not isinstance(item[key], (str, int)) or isinstance(item[key], bool):
                        raise TypeError(item[key])
                    torch.torch_version.Version(str(item[key]))
                except Exception:  # noqa: BLE001 - packaging raises its own InvalidVersion
                    raise self.error(line, version_message(name, key, item[key], self.opened, line), name) from None

    def _apply_remove(self, entries, block, line):
        if not isinstance(block, _yaml.Map):
            raise self.error(line, "remove must map targets to lists of names, e.g. 'remove: {torch: [matmul]}'")
        for target, names in block.items():
            tline = block.key_lines[target]
            if not isinstance(names, _yaml.Seq):
                raise self.error(tline, f"remove.{target} must be a list of names", target)
            for name, nline in zip(names, names.item_lines):
                if not isinstance(name, str):
                    raise self.error(nline or tline, f"remove.{target}: {name!r} is not a name; list plain op names",
                                     name)
                if (target, name) not in entries:
                    raise self.error(nline or tline, f"cannot remove {target}.{name}: the base list does not "
                                     "contain it (check the spelling and the target)", name)
                del entries[(target, name)]

    def _apply_add(self, entries, block, line):
        if not isinstance(block, _yaml.Map):
            raise self.error(line, "add must map categories to {target: [names]}, e.g. 'add: {float: {torch: [exp]}}'")
        for category in block:
            if category not in CATEGORIES:
                raise self.error(block.key_lines[category], f"unknown category {category!r} under add; "
                                 f"allowed: {', '.join(CATEGORIES)}", category)
        added = dict(self._parse_categories(block))
        for key, entry in added.items():
            previous = entries.get(key)
            if previous is not None and previous.category == entry.category:
                raise self.error(entry.line, f"{entry.qualname} is already {entry.category} in the base "
                                 f"({previous.path}:{previous.line}); drop it from add", entry.name)
            if previous is not None:
                log.debug("%s moves from %s to %s (%s:%s)", entry.qualname, previous.category, entry.category,
                          entry.path, entry.line)
            entries[key] = entry
            _fp8.move_aliases(entries, entry, previous.category if previous else None, added)


def inactive_report(table):
    """One line per entry of ``table`` that is inactive on this torch, saying why (``amp-patch lists`` and
    ``amp-patch validate`` print these)."""
    return [f"  skipped {item.entry.category} {item.entry.qualname} ({item.entry.path}:{item.entry.line}): "
            f"{item.reason}" for item in table.skipped]
