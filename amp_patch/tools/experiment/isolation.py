"""Each variant in its own spawned process, driven round by round: :class:`IsolatedRun`.

The parent keeps one process per variant alive for the whole job and sends it commands (``setup``, ``round n``,
``close``) one variant at a time, so the variants' rounds interleave while each keeps its own process (its own
patches, allocator and peak memory). A process that crashes is reported as ``failed``; one that exceeds the
variant's time limit (``Config.timeout_s``, the time it spends working) is killed and reported as ``timeout``.
"""
import contextlib
import multiprocessing
import signal
import time

from .runner import VariantRun, _fail, job_from_ref, mark_interrupted, new_result


def _child_main(conn, job_ref, variant, config):
    """The variant process: build the run, then obey commands until ``close``."""
    run = VariantRun(None, variant, config, on_step=lambda s: conn.send(("step", s)), isolated=True)
    try:
        run.job = job_from_ref(job_ref)
    except Exception as exc:
        _fail(run.result, exc)
    while True:
        try:
            command, arg = conn.recv()
        except EOFError:  # the parent is gone (killed): nothing left to report to
            return
        if command == "setup" and run.result["status"] == "ok":
            run.setup()
        elif command == "round":
            run.run_round(arg)
        elif command == "close":
            conn.send(("result", run.close() if run.job is not None else run.result))
            conn.close()
            return
        conn.send(("done", run.snapshot() if command == "round" else None))


class IsolatedRun:
    """The parent's handle on one variant process; the same three calls as :class:`VariantRun`."""

    def __init__(self, job_ref, variant, config, on_step=None):
        self.variant, self.config, self.on_step = variant, config, on_step
        self.result = None
        self.partial = None  # the result as of the last finished round (kept when the experiment is interrupted)
        self.used_s = 0.0
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_child_main, args=(child_conn, job_ref, variant, config), daemon=True)
        with _sigint_ignored():  # inherited: Ctrl-C reaches the parent only, which ends the variant processes
            self.proc.start()
        child_conn.close()

    def setup(self):
        self._command("setup", None)

    def run_round(self, steps):
        self._command("round", steps)

    def close(self):
        """The variant's result (the process ends); a crash or a timeout is a result too."""
        self._command("close", None)
        self.conn.close()
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        if self.result is None:
            self.result = self._lost(f"the variant's process exited with code {self.proc.exitcode} before "
                                     "reporting a result")
        return self.result

    def _command(self, command, arg):
        if self.result is not None:
            return  # finished early: crashed or timed out
        try:
            self.conn.send((command, arg))
        except (BrokenPipeError, OSError):
            self.result = self._lost(f"the variant's process exited with code {self.proc.exitcode}")
            return
        self._wait(command)

    def _wait(self, command):
        """Relay step messages until the command is done, within what is left of the time limit."""
        limit = self.config.timeout_s
        start = time.monotonic()
        try:
            while True:
                left = None if limit is None else limit - self.used_s - (time.monotonic() - start)
                if left is not None and (left <= 0 or not self.conn.poll(left)):
                    self._timed_out(limit)
                    return
                kind, payload = self.conn.recv()
                if kind == "step" and self.on_step is not None:
                    self.on_step(payload)
                elif kind == "result":
                    self.result = payload
                    return
                elif kind == "done":
                    self.partial = payload if payload is not None else self.partial
                    return
        except EOFError:
            self.proc.join()
            self.result = self._lost(f"the variant's process exited with code {self.proc.exitcode} during "
                                     f"{command!r}")
        finally:
            self.used_s += time.monotonic() - start

    def interrupt(self):
        """End the variant's process now; the result as of its last finished round, marked ``interrupted`` if
        it had rounds left."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        if self.result is not None:
            return self.result
        result = self.partial or new_result(self.variant, True)
        result["pid"] = self.proc.pid
        return mark_interrupted(result, self.config)  # a variant that had run all its rounds stays ok

    def _timed_out(self, limit):
        self.proc.kill()
        self.proc.join()
        self.result = self._lost(f"no result within the variant's time limit of {limit:g} s (--timeout)")
        self.result["status"] = "timeout"

    def _lost(self, error):
        result = new_result(self.variant, True)
        result.update(status="failed", pid=self.proc.pid, error=error)
        return result


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while a child starts: a process started so keeps ignoring it (Python installs its
    KeyboardInterrupt handler only where SIGINT is not ignored). Only in the main thread (signal's rule)."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: leave it
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
