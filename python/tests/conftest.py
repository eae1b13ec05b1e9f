"""Shared pytest fixtures of the ckpt Python tests: real ckptd processes and temporary dirs.

Binaries come from the environment (ctest sets both), else from the default build dir:
  CKPTD_BINARY    path of ckptd      (default: <repo>/build/ckptd)
  CKPTCTL_BINARY  path of ckptctl    (default: <repo>/build/ckptctl)
The ``ckpt`` module itself is found through PYTHONPATH (ctest: <build>/python).

Fixtures (API kept stable; other test files build on it):
  daemon          a running ckptd on a fresh root and socket, stopped with SIGTERM at
                  teardown (the test errors if it then exits non-zero; skipped if the test
                  already called stop() or kill()). A ``Daemon``.
  start_daemon    factory: start_daemon(root=None, socket=None, pool_mib=64, extra_args=())
                  -> Daemon; every daemon it started is stopped at teardown like ``daemon``.
  temp_dir        a fresh short directory under /tmp (a ``TempDir``), removed at teardown.
  ckptd_binary, ckptctl_binary   the paths above (session scope).

Daemon: .socket (str), .root (str), .pid, .log_path, .log() (its output so far),
  .env() (os.environ plus CKPTD_SOCKET, for trainer subprocesses), .client() (a
  ckpt.Client connected to it), .ctl(*args) (runs ckptctl against it, returns the
  CompletedProcess), .stop(timeout=30) -> exit code (SIGTERM), .kill() (SIGKILL),
  .restart() (a new process on the same root and socket), .running.

When a test fails, the last lines of each of its daemons' logs are printed at teardown
(pytest shows them under "Captured stdout teardown").

Readiness is ckptd's --ready-fd: the fixture waits for "ready" on a pipe, bounded by a
deadline (READY_TIMEOUT_S), never with a fixed sleep.

Nothing left behind: SIGTERM and SIGHUP (timeout, a closed terminal) interrupt the run as
Ctrl-C does (KeyboardInterrupt), so pytest still tears the fixtures down: every daemon is
stopped and every temp dir removed; Python's default would end the process at once and leave
the daemons running.
"""

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 200


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) in (signal.SIG_DFL, None):
            signal.signal(s, _interrupt)


def _binary(env_name, default_name):
    path = os.environ.get(env_name) or str(REPO / "build" / default_name)
    return path


class TempDir:
    """A directory under /tmp with a short path (Unix socket paths must stay < 108 bytes)."""

    def __init__(self, prefix="ckpt-py-"):
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))

    def __truediv__(self, other):
        return self.path / other

    def __fspath__(self):
        return str(self.path)

    def __str__(self):
        return str(self.path)

    def cleanup(self):
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()


class Daemon:
    """One ckptd process serving `socket` with checkpoints under `root`."""

    def __init__(self, binary, ctl_binary, root, socket, pool_mib=64, extra_args=()):
        self.binary = binary
        self.ctl_binary = ctl_binary
        self.root = str(root)
        self.socket = str(socket)
        self.pool_mib = pool_mib
        self.extra_args = list(extra_args)
        self.log_path = self.root.rstrip("/") + ".ckptd.log"
        self.proc = None
        self._start()

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self):
        if not os.path.exists(self.binary):
            pytest.fail(f"ckptd binary not found at {self.binary} (build it, or set CKPTD_BINARY)")
        Path(self.root).mkdir(parents=True, exist_ok=True)
        Path(self.socket).parent.mkdir(parents=True, exist_ok=True)
        r, w = os.pipe()
        argv = [self.binary, "--root", self.root, "--create-root", "--socket", self.socket,
                "--pool-mib", str(self.pool_mib), "--ready-fd", str(w),
                "--log-level", "debug", *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, pass_fds=(w,),
                                         stdin=subprocess.DEVNULL)
        os.close(w)
        got = b""
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while not got.startswith(b"ready"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    break
                chunk = os.read(r, 16)
                if not chunk:  # the daemon closed the pipe: it exited
                    break
                got += chunk
        except BaseException:  # an interrupt (SIGINT, SIGTERM) while it starts: no orphan daemon
            self.kill()
            raise
        finally:
            os.close(r)
        if not got.startswith(b"ready"):
            self.kill()
            pytest.fail(f"ckptd did not become ready within {READY_TIMEOUT_S:.0f} s; its log:\n{self.log()}")

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    @property
    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout=30.0):
        """SIGTERM, then waits up to `timeout` s (SIGKILL after it). Returns the exit code
        (negative: killed by that signal, as subprocess reports it); None if not running."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError(f"ckptd did not exit within {timeout} s of SIGTERM; its log:\n{self.log()}")
        return proc.returncode

    def kill(self):
        """SIGKILL (a crash); returns at once after reaping the process."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def restart(self):
        """Starts a new ckptd on the same root and socket (stop() or kill() the old one first)."""
        if self.running:
            raise RuntimeError("restart() of a daemon that is still running: stop() or kill() it first")
        self._start()
        return self

    # -- conveniences ----------------------------------------------------------------------
    def log(self):
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return "(no log)"

    def env(self, **extra):
        env = dict(os.environ)
        env["CKPTD_SOCKET"] = self.socket
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def client(self):
        import ckpt
        return ckpt.Client.connect(self.socket)

    def ctl(self, *args, check=True, timeout=60):
        """Runs `ckptctl --socket SOCKET ARGS...`; returns the CompletedProcess (text)."""
        return subprocess.run([self.ctl_binary, "--socket", self.socket, *map(str, args)],
                              capture_output=True, text=True, check=check, timeout=timeout)

    def __repr__(self):
        return f"<Daemon pid={self.pid} socket={self.socket} root={self.root}>"


@pytest.fixture(scope="session")
def ckptd_binary():
    return _binary("CKPTD_BINARY", "ckptd")


@pytest.fixture(scope="session")
def ckptctl_binary():
    return _binary("CKPTCTL_BINARY", "ckptctl")


@pytest.fixture
def temp_dir():
    d = TempDir()
    yield d
    d.cleanup()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Keeps each phase's report on the item, so fixtures can tell at teardown whether the
    # test failed (and then show the daemon's log).
    outcome = yield
    report = outcome.get_result()
    setattr(item, "ckpt_report_" + report.when, report)


@pytest.fixture
def start_daemon(request, ckptd_binary, ckptctl_binary, temp_dir):
    started = []
    count = [0]

    def start(root=None, socket=None, pool_mib=64, extra_args=()):
        count[0] += 1
        n = count[0]
        d = Daemon(ckptd_binary, ckptctl_binary,
                   root=root or temp_dir / f"root{n}", socket=socket or temp_dir / f"s{n}" / "ckptd.sock",
                   pool_mib=pool_mib, extra_args=extra_args)
        started.append(d)
        return d

    yield start
    call = getattr(request.node, "ckpt_report_call", None)
    if call is not None and call.failed:
        for d in started:
            print(f"--- last {LOG_TAIL_LINES} lines of the log of ckptd (socket {d.socket}) ---")
            print("\n".join(d.log().splitlines()[-LOG_TAIL_LINES:]))
    failures = []
    for d in started:
        if d.proc is None:
            continue
        rc = d.stop()
        if rc != 0:
            failures.append(f"ckptd (socket {d.socket}) exited with status {rc} after SIGTERM; its log:\n{d.log()}")
    if failures:
        pytest.fail("\n".join(failures))


@pytest.fixture
def daemon(start_daemon):
    return start_daemon()
