"""A safe YAML loader that remembers line numbers and refuses anything but plain data.

Mappings load as :class:`Map` and sequences as :class:`Seq`; both record the
1-based line of the node, of every key and of every item, so validation errors
can start with ``path:line``. Tags (``!!python/...``, ``!custom``), anchors and
aliases, duplicate keys, non-string keys, more than one document, more than
MAX_CHARS characters and more than MAX_DEPTH levels of nesting are errors.
"""
import functools

from ..errors import OpListError


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


#: Limits on what an op list may be (the shipped lists are ~10 KB and 4 levels deep).
MAX_CHARS = 4 * 1024 * 1024
MAX_DEPTH = 32


@functools.lru_cache(maxsize=None)
def _loader_class():
    """libyaml's parser when PyYAML has it (an event stream ~30x faster than the pure-Python one), built on
    first use: importing amp_patch must not import yaml."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Builder:
    """Turns one pass over the parser's events into Map/Seq/scalars, refusing what is not plain data.

    No recursion (depth is bounded by MAX_DEPTH), no second parse for the tag/alias check.
    """

    def __init__(self, yaml, loader, path):
        self.yaml, self.loader, self.path = yaml, loader, path
        self.stack = []  # [container, key awaiting its value or _KEY, line of that key]
        self.root, self.documents = _NOTHING, 0

    def error(self, line, message, entry=None):
        return OpListError(self.path, line, message, entry=entry)

    def run(self):
        y = self.yaml
        while True:
            event = self.loader.get_event()
            if isinstance(event, y.StreamEndEvent):
                return None if self.root is _NOTHING else self.root
            line = event.start_mark.line + 1
            if isinstance(event, y.DocumentStartEvent):
                self.documents += 1
                if self.documents > 1:
                    raise self.error(line, "expected a single document: an op list is one YAML document; remove the "
                                     "second '---' and what follows")
            elif isinstance(event, (y.ScalarEvent, y.SequenceStartEvent, y.MappingStartEvent, y.AliasEvent)):
                self._check_plain(event, line)
                self._node(event, line)
            elif isinstance(event, (y.SequenceEndEvent, y.MappingEndEvent)):
                self._add(self.stack.pop()[0], None)

    def _check_plain(self, event, line):
        if isinstance(event, self.yaml.AliasEvent) or getattr(event, "anchor", None):
            raise self.error(line, "YAML anchors and aliases are not allowed in op lists; write each entry out")
        tag = getattr(event, "tag", None)
        if tag is not None and tag != "!":
            raise self.error(line, f"YAML tag {tag!r} is not allowed in op lists; op lists are plain data "
                             "(names and mappings)", entry=tag)

    def _node(self, event, line):
        if isinstance(event, self.yaml.ScalarEvent):
            self._add(self._scalar(event), line)
            return
        if len(self.stack) >= MAX_DEPTH:
            raise self.error(line, f"the op list is nested more than {MAX_DEPTH} levels deep; an op list needs "
                             "4 (category: target: [names]); flatten it")
        container = Seq() if isinstance(event, self.yaml.SequenceStartEvent) else Map()
        container.line = line
        if isinstance(container, Seq):
            container.item_lines = []
        self.stack.append([container, _KEY, None])

    def _scalar(self, event):
        loader, yaml = self.loader, self.yaml
        tag = loader.resolve(yaml.ScalarNode, event.value, event.implicit)
        if tag == "tag:yaml.org,2002:str":
            return event.value
        node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
        return loader.construct_object(node)

    def _add(self, value, line):
        if not self.stack:
            self.root = value
            return
        frame = self.stack[-1]
        container = frame[0]
        line = line if line is not None else value.line
        if isinstance(container, Seq):
            container.append(value)
            container.item_lines.append(line)
        elif frame[1] is _KEY:
            if not isinstance(value, str):
                raise self.error(line, f"keys must be plain strings, got {type(value).__name__} {value!r:.60}",
                                 entry=value)
            if value in container:
                raise self.error(line, f"duplicate key {value!r} (first at line {container.key_lines[value]})",
                                 entry=value)
            frame[1], frame[2] = value, line
        else:
            container[frame[1]] = value
            container.key_lines[frame[1]] = frame[2]
            frame[1] = _KEY


_KEY = object()
_NOTHING = object()


def load(text, path):
    """Parse ``text`` (from ``path``, used in messages) into Map/Seq/scalars."""
    import yaml

    if isinstance(text, str) and len(text) > MAX_CHARS:
        raise OpListError(path, None, f"the op list is {len(text)} characters; the limit is {MAX_CHARS} "
                          "(an op list names a few hundred ops); split it with 'extends' and 'add'")
    try:
        loader = _loader_class()(text)
        try:
            return _Builder(yaml, loader, path).run()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        raise OpListError(path, *_syntax_error(exc, text)) from None
    except yaml.reader.ReaderError as exc:  # unmarked, but its position indexes ``text``
        line = text.count("\n", 0, exc.position) + 1 if isinstance(text, str) else None
        raise OpListError(path, line, f"invalid YAML: {exc.reason} (character {exc.character!r})") from None
    except yaml.YAMLError as exc:
        raise OpListError(path, None, f"invalid YAML: {exc}") from None


def _syntax_error(exc, text):
    """(line, message): the line where parsing failed, plus the line where the broken construct started."""
    mark, context = exc.problem_mark or exc.context_mark, exc.context_mark
    if context is not None and mark.index >= len(text.rstrip()):
        mark = context  # "unexpected end of stream": point at what was left open, not past the end
    line = mark.line + 1 if mark is not None else None
    problem = ", ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
    if context is not None and line is not None and context.line + 1 != line:
        problem += f" (the construct it belongs to starts at line {context.line + 1})"
    return line, f"invalid YAML: {problem}"
