"""Shared test helpers: every test gets its own probe cache directory (so no test writes to
the real user cache or sees another test's entries), and the command-line tests run
``python -m autobatch`` in a subprocess."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# tiny ops on a shared 2-core box: one thread per test process (xdist runs one process per core,
# and each would otherwise start a thread per core), inherited by the processes tests start
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def _compile_the_package() -> None:
    """autobatch's modules compiled once, before the tests (in the controller: xdist's workers start
    after it). Why: under PYTHONDONTWRITEBYTECODE=1 (this project's CI machine) no import writes
    bytecode, so every process a test starts (the command line, each rank of a distributed test,
    some hundreds of them) compiled the package from its source again, 0.3-0.5 s a process on 2
    cores. The files are hash-checked (``CHECKED_HASH``), never stale where a source changes within
    a second, and go where Python looks for them, ``__pycache__`` beside each module, which git
    ignores; nothing else gets bytecode (a test's own modules, written and rewritten in its
    temporary directory, still compile from their source)."""
    import compileall
    import py_compile

    compileall.compile_dir(Path(__file__).resolve().parents[1] / "autobatch", quiet=2, force=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)


if "PYTEST_XDIST_WORKER" not in os.environ:
    _compile_the_package()


class LogLines(logging.Handler):
    """A handler keeping every message it is given (for loggers that do not propagate to the root,
    where caplog listens: torch's and Lightning's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())



def pytest_collection_finish(session: pytest.Session) -> None:
    """Set what the collection made (the imported frameworks, every test module) aside from the
    garbage collector (``gc.freeze``): the library's full ``gc.collect()`` after each out-of-memory
    error otherwise walks a test process's whole heap, 0.1-0.2 s a call where a small training
    script's takes milliseconds. What a test makes is collected as before."""
    if os.environ.get("AUTOBATCH_TEST_NO_FREEZE") != "1":
        # what torch imports lazily at a test's first optimizer (``Optimizer.__init__`` imports
        # dynamo, sympy and torch.fx: ~117,000 objects, 40-70 ms a collection), imported here so
        # that it is set aside too
        import torch._dynamo  # noqa: F401

        gc.collect()
        gc.freeze()


REPO = Path(__file__).resolve().parents[1]
#: Small workloads so every CLI run takes a second or two on a CPU.
SMALL = ["data.shape=[16]", "data.seq_len=16", "model.width=32", "probe.max_batch=64", "probe.steps_per_trial=1"]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: the checkout importable, no error-display flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "AUTOBATCH_TRACEBACK")}
    # the checkout first; what the caller's path adds stays (the GPU machine's wheels in /tmp/site)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    env["OMP_NUM_THREADS"] = "1"  # tiny ops: threads only contend on a shared 2-core CI box
    env.update(extra)
    return env


def rank_reports(tmp_path: Path, name: str, script: str, timeout: float = 180) -> tuple[list[dict], str]:
    """Write ``script`` (a program that launches ranks and has each write ``rank<N>.json`` in
    ``tmp_path``) as ``name``, run it in ``tmp_path``, and return the reports in rank order and its stderr."""
    import json

    path = tmp_path / name
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=cli_env(PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, timeout=timeout)
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))], done.stderr


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120):
    """Run ``python -m autobatch *args`` in ``cwd``; return the CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-m", "autobatch", *args],
        cwd=cwd,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli(tmp_path):
    """``cli(*args)`` runs the CLI in ``tmp_path`` (run dir ``tmp_path/run``, sweep dir ``tmp_path/sweep``)."""

    def run(*args: str, **kwargs):
        extra = [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
        return run_cli(*args, *extra, cwd=tmp_path, **kwargs)

    return run


def main_keeping_loggers(args: list[str]) -> int:
    """The CLI's ``main(args)`` in this process; Hydra's job logging (a file in the run dir, the
    console) stays that run's: the handlers it added are closed and the loggers put back."""
    from autobatch.__main__ import main

    loggers = [logging.getLogger(), logging.getLogger("autobatch")]
    saved = [(lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in loggers]
    try:
        return main(args)
    finally:
        for logger, (handlers, level, propagate, disabled) in zip(loggers, saved):
            for handler in set(logger.handlers) - set(handlers):
                handler.close()
            logger.handlers[:], logger.propagate, logger.disabled = handlers, propagate, disabled
            logger.setLevel(level)


def cli_in_process(*args: str, cwd: Path) -> int:
    """``run_cli(*args, cwd=cwd)``'s run through ``main`` in this process (for a module-scoped
    fixture, where ``cli_here`` cannot serve): its exit status; what it prints goes to the
    test's output. For a one-process run whose files a test compares with (a reference)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setattr(sys, "argv", ["autobatch"])  # main() sets it for Hydra
        for name in ("HYDRA_FULL_ERROR", "AUTOBATCH_TRACEBACK"):
            patch.delenv(name, raising=False)
        patch.setenv("AUTOBATCH_CACHE_DIR", str(cwd / "autobatch-cache"))  # never the user's cache
        return main_keeping_loggers(list(args))


@pytest.fixture
def cli_here(tmp_path, monkeypatch, capsys):
    """``cli_here(*args)``: what ``cli(*args)`` checks, through the CLI's ``main`` in this test's
    own process (in ``tmp_path``, with the same run and sweep dirs), as a CompletedProcess. A CLI
    subprocess spends ~3.5 s of the CI box on imports alone (torch, Hydra, and the
    ``torch._dynamo`` that making an optimizer loads), so a test of output, exit status or
    written files runs here; one of what only a real process shows (signals, the interpreter's
    exit status, its environment, imports of a user's module) keeps ``cli``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["autobatch"])  # main() sets it for Hydra
    for name in ("HYDRA_FULL_ERROR", "AUTOBATCH_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, dirs: bool = True) -> subprocess.CompletedProcess:
        """``dirs=False``: no run and sweep dirs added (``run_cli``'s: the ones ``args`` name, else Hydra's)."""
        extra = [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"] if dirs else []
        capsys.readouterr()
        code = main_keeping_loggers([*args, *extra])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["autobatch", *args], code, out, err)

    return run


@pytest.fixture(autouse=True)
def unweighed_traces(monkeypatch):
    """``auto``'s first fake-tensor trace is weighed against a trial only where it took more than
    ``trace_cost.FLOOR_S`` seconds of wall time: on a loaded machine (tests on many workers beside other
    work) a small model's trace passed 1 s, and the probe took the weighed path, with one more trial and
    other answers than the test asserted. Tests run the unweighed path unless they set the floor
    themselves (``tests/probe/test_review34_trace_cost.py``)."""
    from autobatch.probe.tracing import trace_cost
    monkeypatch.setattr(trace_cost, "FLOOR_S", float("inf"))


@pytest.fixture(autouse=True)
def isolated_probe_cache(tmp_path_factory, monkeypatch):
    directory = tmp_path_factory.mktemp("autobatch-cache")
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(directory))
    return directory
