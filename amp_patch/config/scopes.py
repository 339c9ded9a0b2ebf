"""The ``scopes:`` section of an op list, parsed: module-path globs and their category overrides.

``scopes:`` maps module-path globs (paths as ``model.named_modules()`` spells them) to category overrides::

    scopes:
      "encoder.layers.*.attn":
        float: {torch: [bmm]}

``*`` matches one path component, ``**`` any number of them. How scopes apply at run time is
:mod:`amp_patch.casting.scopes`.
"""
import dataclasses
import functools
import re

from ._yaml import Map

CATEGORIES = ("half", "float", "promote")


@dataclasses.dataclass(frozen=True)
class Scope:
    """One ``scopes:`` key: a glob, its compiled pattern, its entries and where it was declared."""

    glob: str
    entries: tuple  # OpEntry, each with .scope == glob
    path: str
    line: int

    def matches(self, module_path):
        return compile_glob(self.glob).fullmatch(module_path) is not None


@functools.lru_cache(maxsize=1024)
def compile_glob(glob):
    """``*``: one dotted component (or part of one); ``**``: any number of components (also none)."""
    parts = []
    for token in re.split(r"(\*\*\.?|\*)", glob):
        if token.startswith("**"):
            parts.append(r"(?:[^.]+\.)*" if token.endswith(".") else r".*")
        elif token == "*":
            parts.append(r"[^.]*")
        else:
            parts.append(re.escape(token))
    return re.compile("".join(parts))


def parse_scopes(document, block, line, parse_block):
    """The scopes of one op-list document: ``document.error(line, message, token)`` makes its errors and
    ``parse_block(category, targets, line)`` parses one category's entries (oplist's own parser)."""
    if not isinstance(block, Map):
        raise document.error(line, "scopes must map module-path globs to category overrides, e.g. "
                             "'scopes: {\"encoder.*.attn\": {float: {torch: [bmm]}}}'")
    scopes = []
    for glob, overrides in block.items():
        glob_line = block.key_lines[glob] or line
        _check_glob(document, glob, glob_line)
        if not isinstance(overrides, Map) or not overrides:
            raise document.error(glob_line, f"scope {glob!r} must map categories ({', '.join(CATEGORIES)}) to "
                                 "{target: [names]}, e.g. {float: {torch: [bmm]}}", glob)
        entries = {}
        for category, targets in overrides.items():
            if category not in CATEGORIES:
                raise document.error(overrides.key_lines[category] or glob_line, f"scope {glob!r}: category "
                                     f"{category!r} is not allowed in a scope; allowed: {', '.join(CATEGORIES)}",
                                     category)
            for entry in parse_block(category, targets, overrides.key_lines[category] or glob_line):
                key = (entry.target, entry.name)
                if key in entries:
                    raise document.error(entry.line, f"scope {glob!r} lists {entry.qualname} twice (as "
                                         f"{entries[key].category} and {entry.category}); keep one", entry.name)
                entries[key] = dataclasses.replace(entry, scope=glob)
        scopes.append(Scope(glob, tuple(entries.values()), document.path, glob_line))
    return scopes


def _check_glob(document, glob, line):
    if not isinstance(glob, str) or not glob or glob.strip() != glob:
        raise document.error(line, f"scope key {glob!r} must be a module path glob such as 'encoder.layers.*.attn' "
                             "(the root module: use the global categories instead)", glob)
    if any(not part for part in glob.split(".")) or re.search(r"[^\w.*\-]", glob):
        raise document.error(line, f"scope key {glob!r} is not a module path glob: use names as "
                             "model.named_modules() spells them, joined by '.', with * (one part) or ** (any)",
                             glob)


def merge_scopes(base, new):
    """``base`` scopes updated by ``new`` ones: a glob declared again replaces/extends the base's entries."""
    merged = {s.glob: s for s in base}
    for scope in new:
        old = merged.get(scope.glob)
        if old is not None:
            entries = {(e.target, e.name): e for e in old.entries}
            entries.update({(e.target, e.name): e for e in scope.entries})
            scope = dataclasses.replace(scope, entries=tuple(entries.values()))
        merged[scope.glob] = scope
    return tuple(merged.values())
