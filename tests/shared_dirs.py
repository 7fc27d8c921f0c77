"""A directory filled once per pytest run, whichever pytest-xdist worker asks for it first.

A module-scoped fixture runs once per worker that runs one of its tests: where the tests of one
module are spread over both workers, an expensive fixture (launching training runs) ran twice.
Here the first worker to ask builds the directory under a lock in the run's shared temporary
root; the other waits for it and reads the same directory. A build that raised leaves no marker:
the next asker builds again (and fails the same way, in its own tests).
"""
import fcntl
import os
import shutil


def _root(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's base is <run root>/popen-gwN: the run root is shared
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build):
    """<run root>/name after build(that path) has filled it, once per pytest run."""
    root = _root(tmp_path_factory)
    d, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here while one builds
        try:
            if not done.exists():
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir()
                build(d)
                done.write_text("built\n")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return d
