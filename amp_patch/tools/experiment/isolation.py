"""Each variant in its own spawned process, driven round by round: :class:`IsolatedRun`.

The parent keeps one process per variant alive for the whole experiment (:class:`Processes`: the process of a
variant runs that variant for every job in turn, since starting one, importing torch, costs seconds of CPU) and
sends it commands (``job``, ``setup``, ``round n``, ``close``) one variant at a time, so the variants' rounds
interleave while each keeps its own process (its own patches, allocator and peak memory, reset for each job). A
process that crashes is reported as ``failed``; one that exceeds the variant's time limit (``Config.timeout_s``,
the time it spends working) is killed and reported as ``timeout``; either way the next job gets a fresh one.
"""
import contextlib
import multiprocessing
import signal
import time

from .runner import VariantRun, fail_result, job_from_ref, mark_interrupted, new_result, reset_peak_memory


def _child_main(conn):
    """The variant process: for each job it is given (``job``), build the run, then obey commands until ``close``;
    then wait for the next job (a process serves one variant of every job in turn) or ``exit``."""
    while True:
        try:
            command, arg = conn.recv()
        except EOFError:  # the parent is gone (killed): nothing left to report to
            return
        if command != "job":
            return  # "exit"
        _serve_job(conn, *arg)


def _serve_job(conn, job_ref, variant, config):
    run = VariantRun(None, variant, config, on_step=lambda s: conn.send(("step", s)), isolated=True)
    reset_peak_memory(run.device, True)  # this job's peak, not the last job's in this process
    try:
        run.job = job_from_ref(job_ref)
    except Exception as exc:
        fail_result(run.result, exc)
    while True:
        try:
            command, arg = conn.recv()
        except EOFError:
            return
        if command == "setup" and run.result["status"] == "ok":
            run.setup()
        elif command == "round":
            run.run_round(arg)
        elif command == "close":
            conn.send(("result", run.close() if run.job is not None else run.result))
            return
        conn.send(("done", run.snapshot() if command == "round" else None))


class VariantProcess:
    """One spawned process that runs a variant's jobs one after the other (:func:`_child_main`); Ctrl-C reaches
    the parent only, which ends it."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_child_main, args=(child_conn,), daemon=True)
        with _sigint_ignored():  # inherited: Ctrl-C reaches the parent only, which ends the variant processes
            self.proc.start()
        child_conn.close()
        self.usable = True  # False once it crashed, timed out or was killed

    def kill(self):
        self.usable = False
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()

    def exit(self):
        """Let it end (no job left); killed if it does not within 30 s."""
        if self.usable:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(("exit", None))
        self.usable = False
        self.proc.join(timeout=30)
        self.kill()


class Processes:
    """The variant processes of one experiment, one per variant, reused from job to job (starting one costs
    seconds of CPU: importing torch); ``close()`` ends them."""

    def __init__(self):
        self.by_variant = {}

    def get(self, variant):
        process = self.by_variant.get(variant)
        if process is None or not process.usable:
            process = self.by_variant[variant] = VariantProcess()
        return process

    def close(self):
        for process in self.by_variant.values():
            process.exit()
        self.by_variant.clear()


class IsolatedRun:
    """The parent's handle on one variant process; the same three calls as :class:`VariantRun`."""

    def __init__(self, job_ref, variant, config, on_step=None, process=None):
        self.variant, self.config, self.on_step = variant, config, on_step
        self.result = None
        self.partial = None  # the result as of the last finished round (kept when the experiment is interrupted)
        self.used_s = 0.0
        self.process = process or VariantProcess()  # (the experiment's Processes hand one from job to job)
        self.own_process = process is None
        self.conn, self.proc = self.process.conn, self.process.proc
        self._send("job", (job_ref, variant, config))

    def setup(self):
        self._command("setup", None)

    def run_round(self, steps):
        self._command("round", steps)

    def close(self):
        """The variant's result (the process ends); a crash or a timeout is a result too."""
        self._command("close", None)
        if self.result is None or self.result["status"] in ("failed", "timeout") or self.own_process:
            self.process.exit() if self.result is not None else self.process.kill()
        if self.result is None:
            self.result = self._lost(f"the variant's process exited with code {self.proc.exitcode} before "
                                     "reporting a result")
        return self.result

    def _command(self, command, arg):
        if self.result is not None:
            return  # finished early: crashed or timed out
        if self._send(command, arg):
            self._wait(command)

    def _send(self, command, arg):
        try:
            self.conn.send((command, arg))
        except (BrokenPipeError, OSError):
            self.process.usable = False
            self.result = self._lost(f"the variant's process exited with code {self.proc.exitcode}")
            return False
        return True

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
            self.process.usable = False
            self.proc.join()
            self.result = self._lost(f"the variant's process exited with code {self.proc.exitcode} during "
                                     f"{command!r}")
        finally:
            self.used_s += time.monotonic() - start

    def interrupt(self):
        """End the variant's process now; the result as of its last finished round, marked ``interrupted`` if
        it had rounds left."""
        self.process.kill()
        if self.result is not None:
            return self.result
        result = self.partial or new_result(self.variant, True)
        result["pid"] = self.proc.pid
        return mark_interrupted(result, self.config)  # a variant that had run all its rounds stays ok

    def _timed_out(self, limit):
        self.process.kill()
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
