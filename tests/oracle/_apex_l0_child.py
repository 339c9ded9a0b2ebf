"""The child process of :mod:`apex_l0`: runs Apex's own test files on CPU against amp_patch's mirror.

Started as ``python _apex_l0_child.py JOB.json``; the job names the test folders, the files, the source
substitutions (applied by :class:`_PortingFinder` to every module of those folders the tests import), the tests
ported away (skipped with their reason) and where the outcomes go (JSON lines ``[test id, [status, message,
seconds]]``, appended as each test ends).
``import apex`` resolves to amp_patch's mirror through the apex alias. The monkeypatches of :func:`_cpu_torch`
are listed in :data:`apex_l0.CPU_PATCHES`.
"""
import fnmatch
import importlib.abc
import importlib.util
import json
import os
import pathlib
import sys
import time
import traceback
import unittest
import warnings

OPTIONAL = ("onnx", "onnxscript")  # the layer norms' export tests need them; a test needing one absent skips


def _cpu_torch():
    """CUDA-only calls that Apex's tests make outside the code under test, made harmless on CPU."""
    import torch
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # the draws are CPU ones
    torch.cuda.manual_seed_all = lambda seed: None  # (torch.manual_seed calls it: no CUDA generator to seed)


class _PortingLoader(importlib.abc.SourceLoader):
    def __init__(self, path, port):
        self.path, self.port = path, port

    def get_filename(self, fullname):
        return str(self.path)

    def get_data(self, path):
        return port_source(pathlib.Path(path).read_text(), self.port).encode()


def _port_of(job, name):
    return job["port"].get(name, job["port"]["*"])


class _PortingFinder(importlib.abc.MetaPathFinder):
    """Serves the top-level modules that are files of the Apex test folders (``utils``, ``test_fused_optimizer``)."""

    def __init__(self, folders, job):
        self.folders, self.job = folders, job

    def find_spec(self, name, path, target=None):
        files = [folder / f"{name}.py" for folder in self.folders if (folder / f"{name}.py").is_file()]
        if "." in name or not files:
            return None
        return importlib.util.spec_from_file_location(name, files[0], loader=_PortingLoader(files[0],
                                                                                            _port_of(self.job, name)))


def port_source(text, port):
    for old, new in port:
        text = text.replace(old, new)
    return text


class _Recorder(unittest.TestResult):
    """Records each outcome and appends it to the job's out file at once (a timed-out child keeps what ran)."""

    def __init__(self, prefix, sink):
        super().__init__()
        self.outcomes, self._start, self.prefix, self.sink = {}, {}, prefix, sink

    def _put(self, test, status, message=""):
        seconds = round(time.monotonic() - self._start.get(test.id(), time.monotonic()), 2)
        self.outcomes[test.id()] = [status, message[-1500:], seconds]
        _emit(self.sink, f"{self.prefix}{test.id()}", self.outcomes[test.id()])

    def startTest(self, test):
        self._start[test.id()] = time.monotonic()
        super().startTest(test)

    def addSuccess(self, test):
        self._put(test, "pass")

    def addFailure(self, test, err):
        self._put(test, "fail", "".join(traceback.format_exception(*err)))

    def addError(self, test, err):
        if isinstance(err[1], ModuleNotFoundError) and err[1].name in OPTIONAL:
            self._put(test, "skip", f"needs {err[1].name}, not installed")
            return
        self._put(test, "fail", "".join(traceback.format_exception(*err)))

    def addSkip(self, test, reason):
        self._put(test, "ported" if reason.startswith("ported away: ") else "skip", reason)

    def addExpectedFailure(self, test, err):
        self._put(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        self._put(test, "fail", "unexpected success")

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self._put(subtest, "fail", "".join(traceback.format_exception(*err)))


def _port_away(suite, ported):
    """Replace each test matching a ``Class.method`` pattern of ``ported`` by a skip naming the reason."""
    for test in _flatten(suite):
        key = f"{type(test).__name__}.{test._testMethodName}"
        for pattern, reason in ported.items():
            if fnmatch.fnmatchcase(key, pattern):
                setattr(test, test._testMethodName, unittest.skip(f"ported away: {reason}")(lambda: None))
                break


def _flatten(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _flatten(item)
        else:
            yield item


def _emit(sink, key, outcome):
    with open(sink, "a") as f:
        f.write(json.dumps([key, outcome]) + "\n")


def _run_unittest(job):
    for _, name in job["files"]:
        try:
            module = __import__(name)
        except Exception:  # noqa: BLE001 - an import failure is the file's outcome
            _emit(job["out"], f"{name}::<import>", ["fail", traceback.format_exc()[-1500:], 0])
            continue
        suite = unittest.TestLoader().loadTestsFromModule(module)
        if job.get("select"):
            suite = unittest.TestSuite(t for t in _flatten(suite) if any(
                fnmatch.fnmatchcase(f"{type(t).__name__}.{t._testMethodName}", s) for s in job["select"]))
        _port_away(suite, job["ported"])
        result = _Recorder(f"{name}::", job["out"])
        suite.run(result)
        for err_test, err in result.errors:  # module-level or class-level setup errors
            if err_test.id() not in result.outcomes:
                _emit(job["out"], f"{name}::{err_test.id()}", ["fail", err[-1500:], 0])


def _recorder(namespace, checks):
    """The script's ``compare``, renamed ``_apex_compare`` in its source, called and recorded (with its largest
    difference) by this stand-in of that name."""
    def compare(desc, a, b, *given):
        ok = bool(namespace["_apex_compare"](desc, a, b, *given))
        error = given[0] if given else namespace["_apex_compare"].__defaults__[-1]
        gap = (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
        checks.append((desc, ok, f"largest |a - b| {gap:.4g}, allowed {error:g} + {error:g} * |b|"))
        return ok
    return compare


def _run_scripts(job):
    for folder, name in job["files"]:
        _run_script(pathlib.Path(folder), job, name)


def _run_script(folder, job, name):
    """Run a script of Apex's that checks by ``compare(desc, a, b, error)``: each call is one check."""
    port = _port_of(job, name) + [["def compare(", "def _apex_compare("]]
    text = port_source((folder / f"{name}.py").read_text(), port)
    sys.argv = [name] + job.get("argv", [])
    namespace, checks = {"__name__": "__main__"}, []
    namespace["compare"] = _recorder(namespace, checks)
    try:
        exec(compile(text, str(folder / f"{name}.py"), "exec"), namespace)
        error = None
    except BaseException:  # noqa: BLE001 - the script's failure is an outcome
        error = traceback.format_exc()
    seen = {}
    for desc, ok, gap in checks:
        seen[desc] = seen.get(desc, 0) + 1
        key = f"{name}::{desc.strip().rstrip(':')}" + (f" #{seen[desc]}" if seen[desc] > 1 else "")
        _emit(job["out"], key, ["pass" if ok else "fail", gap, 0])
    # the script's own asserts (test_batchnorm1d checks by assert alone) held when it ran to its end
    end = ["pass", "", 0] if error is None else ["fail", error[-1500:], 0]
    _emit(job["out"], f"{name}::<script ran to its end>", end)


def main(job_file):
    job = json.loads(pathlib.Path(job_file).read_text())
    folders = list(dict.fromkeys(pathlib.Path(folder) for folder, _ in job["files"]))
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(int(job.get("threads", 1)))
    _cpu_torch()
    from amp_patch.legacy import install_apex_alias
    install_apex_alias()
    sys.path[:0] = [str(folder) for folder in folders]
    sys.meta_path.insert(0, _PortingFinder(folders, job))
    pathlib.Path(job["out"]).write_text("")
    (_run_scripts if job["kind"] == "script" else _run_unittest)(job)


if __name__ == "__main__":
    main(sys.argv[1])
