"""The recording list behind ``apex.amp.lists``: a plain ``list`` that remembers where each name was added."""
import sys


def _caller(depth=2):
    frame = sys._getframe(depth)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class OpNameList(list):
    """Apex's op-name list (``FP16_FUNCS`` ...), mutable as in Apex; names added later remember ``file:line``
    of the statement that added them, for the error a misspelt name gets at ``amp.initialize``."""

    def __init__(self, qualname, names=()):
        super().__init__(names)
        self.qualname = qualname
        self.pristine = tuple(names)
        self.where = {}

    def _note(self, names, where):
        for name in names:
            self.where.setdefault(_key(name), where)

    def append(self, name):
        self._note([name], _caller())
        super().append(name)

    def insert(self, index, name):
        self._note([name], _caller())
        super().insert(index, name)

    def extend(self, names):
        names = list(names)
        self._note(names, _caller())
        super().extend(names)

    def __iadd__(self, names):
        names = list(names)
        self._note(names, _caller())
        super().extend(names)
        return self

    def __setitem__(self, index, value):
        self._note(value if isinstance(index, slice) else [value], _caller())
        super().__setitem__(index, value)

    def added(self):
        """Names not in Apex's original list, in order: (name, "file:line" or None)."""
        original = {_key(n) for n in self.pristine}
        return [(n, self.where.get(_key(n))) for n in self if _key(n) not in original]

    def removed(self):
        current = {_key(n) for n in self}
        return [n for n in self.pristine if _key(n) not in current]


def _key(item):
    """BANNED_FUNCS holds (name, message) pairs; the others hold names."""
    return item[0] if isinstance(item, tuple) and item else item
