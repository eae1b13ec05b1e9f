"""What the Python benches call first: SIGTERM and SIGHUP end a bench the way SIGINT does, by
an exception, so that its finally blocks run (they stop the daemon it started, close its
clients, whose shared memory libckpt then removes at exit, and remove its directories).
Python's default for SIGTERM and SIGHUP is to die at once, leaving all of that behind."""

import signal


def exit_on_signals() -> None:
    """From now on SIGTERM, SIGHUP and SIGINT raise SystemExit(128 + N) in the main thread.
    Further signals are ignored while the cleanup runs."""

    def handler(signum, _frame):
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, handler)
