"""A safe YAML loader that remembers line numbers and refuses anything but plain data.

Mappings load as :class:`Map` and sequences as :class:`Seq`; both record the
1-based line of the node, of every key and of every item, so validation errors
can start with ``path:line``. Tags (``!!python/...``, ``!custom``), anchors and
aliases, duplicate keys and non-string keys are errors.
"""
import functools

from .errors import OpListError


class Map(dict):
    """A YAML mapping with ``line`` and ``key_lines`` (key -> line of the key)."""

    line = None

    def __init__(self):
        super().__init__()
        self.key_lines = {}


class Seq(list):
    """A YAML sequence with ``line`` and ``item_lines`` (index -> line of the item)."""

    line = None
    item_lines = ()


def _line(node):
    return node.start_mark.line + 1


def _construct_seq(loader, node):
    seq = Seq(loader.construct_object(child, deep=True) for child in node.value)
    seq.line = _line(node)
    seq.item_lines = [_line(child) for child in node.value]
    return seq


def _construct_map(loader, node):
    mapping = Map()
    mapping.line = _line(node)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise OpListError(loader.path, _line(key_node),
                              f"keys must be plain strings, got {type(key).__name__} {key!r}", entry=key)
        if key in mapping:
            raise OpListError(loader.path, _line(key_node),
                              f"duplicate key {key!r} (first at line {mapping.key_lines[key]})", entry=key)
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = _line(key_node)
    return mapping


@functools.lru_cache(maxsize=None)
def _loader_class():
    """The SafeLoader subclass whose containers carry line numbers (built on first use: importing amp_patch
    must not import yaml)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        path = "<yaml>"

    _Loader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)
    _Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)
    return _Loader


def _reject_tags_and_aliases(yaml, text, path):
    """Walk the event stream: explicit tags, anchors and aliases are not plain data."""
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise OpListError(path, line, "YAML anchors and aliases are not allowed in op lists; "
                              "write each entry out")
        tag = getattr(event, "tag", None)
        if tag is not None and tag != "!":
            raise OpListError(path, line, f"YAML tag {tag!r} is not allowed in op lists; "
                              "op lists are plain data (names and mappings)", entry=tag)


def load(text, path):
    """Parse ``text`` (from ``path``, used in messages) into Map/Seq/scalars."""
    import yaml

    try:
        _reject_tags_and_aliases(yaml, text, path)
        loader = _loader_class()(text)
        loader.path = str(path)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        if exc.context_mark is not None and mark.index >= len(text.rstrip()):
            mark = exc.context_mark  # "unexpected end of stream": point at what was left open, not past the end
        line = mark.line + 1 if mark is not None else None
        problem = ", ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
        raise OpListError(path, line, f"invalid YAML: {problem}") from None
    except yaml.reader.ReaderError as exc:  # unmarked, but its position indexes ``text``
        line = text.count("\n", 0, exc.position) + 1 if isinstance(text, str) else None
        raise OpListError(path, line, f"invalid YAML: {exc.reason} (character {exc.character!r})") from None
    except yaml.YAMLError as exc:
        raise OpListError(path, None, f"invalid YAML: {exc}") from None
    except RecursionError:
        raise OpListError(path, None, "invalid op list: YAML nested too deeply") from None
