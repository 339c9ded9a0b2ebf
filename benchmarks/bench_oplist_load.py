"""Time to load (or refuse) large and hostile op lists.

Usage: python benchmarks/bench_oplist_load.py [--mb 1.0]
Prints one line per case: size, seconds, and the result. The target on the 2-core CPU this project is
developed on: a valid 1 MB list loads in under 2 s; hostile files are refused at least as fast.
"""
import argparse
import os
import tempfile
import time

import torch

import amp_patch
from amp_patch.patching.resolve import is_tensor_op


def _valid_list(size):
    """A schema-valid list of about ``size`` bytes: every tensor op of the torch namespace, each with a note."""
    names = sorted(n for n in dir(torch) if not n.startswith("_") and is_tensor_op(getattr(torch, n, None)))
    note = "x" * max(1, size // len(names) - 40)
    lines = ["float:", "  torch:"] + [f"    - {{name: {n}, optional: true, note: {note}}}" for n in names]
    return "\n".join(lines) + "\n"


def _cases(size):
    yield "valid list", _valid_list(size)
    yield "flow sequence in description", "description: [" + ", ".join(["matmul"] * (size // 8)) + "]\n"
    yield "40 KB of nesting", "description: " + "[" * 20000 + "]" * 20000 + "\n"
    yield "over the size limit", "description: " + "x" * (5 * 1024 * 1024) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=1.0)
    size = int(parser.parse_args().mb * 1024 * 1024)
    with tempfile.TemporaryDirectory() as folder:
        for label, text in _cases(size):
            path = os.path.join(folder, "list.yaml")
            with open(path, "w") as f:
                f.write(text)
            start = time.perf_counter()
            try:
                result = f"loaded {len(amp_patch.load_op_lists(path))} entries"
            except ValueError as exc:
                result = f"refused: {str(exc).split(': ', 1)[1][:70]}"
            took = time.perf_counter() - start
            print(f"{label:32s} {len(text) / 1e6:6.2f} MB  {took:6.3f} s  ({took / 2.0:.2f} of the 2 s budget)  "
                  f"{result}")


if __name__ == "__main__":
    main()
