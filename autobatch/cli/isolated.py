"""``train``'s probe in a child process, so training starts in a process no trial ran in.

A probe leaves its process changed in ways no cleanup undoes: where the caching allocator put
what outlived the trials, which pages that pins, what libraries cached after the out-of-memory
trials (which of these mattered below was not measured). A size at the edge of memory trains or
not by such details. Measured on one NVIDIA H200 (issue 16, ViT-B/16,
bf16, 8 GiB cap, expandable segments, ``scripts/diag_cli_same.py``): the CLI's probe answered 103;
a new process trained 103 for 200 steps with 6 allocator retries in all, while the process that
probed retried at every step and ran out of memory at step 78 (7.70 GiB allocated, 193 MiB
reserved in pieces it could not release, 120 MiB asked for), with the same allocated figures
step for step, and a full garbage collection after the probe changed nothing. So on CUDA
``train`` runs ``python -m autobatch probe`` with the job's own overrides as a child process and
trains from its answer, as a cache hit does: the probe cache's promise (the answer trains in a
new process) is then the only promise ``train`` needs.

Only the plain probe is moved: a plan (``train.global_batch``) may wrap the model for activation
checkpointing in this process, and under ``torchrun`` the ranks' probe agrees through the
process group; both still run here (``probe.isolate``).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ..dist import agreement as dist_sync
from ..probe.promise import forget_own_layout
from ..probe.result import ProbeResult
from .errors import ERROR_FILE_ENV, RUNTIME_FAILURE, CLIError, handed_back
from .preflight import QUIET_ENV
from .user_config import given_overrides

__all__ = ["child_command", "child_environment", "isolate_probe", "probe_in_child"]

#: flags whose value follows them and names where the configs come from (kept for the child)
_CONFIG_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")


def isolate_probe(cfg: DictConfig, device_type: str) -> bool:
    """Whether ``train`` probes in a child process: ``probe.isolate``, where null means on CUDA
    for a plain probe (no ``train.global_batch``) in a single process. Decided before this
    process touches the device, so the child has the whole device to itself."""
    wanted = cfg.probe.get("isolate")
    distributed = dist_sync.is_distributed()
    if wanted and distributed:
        raise CLIError("probe.isolate=true cannot run under torchrun: the ranks' probe agrees through the process "
                       "group; drop it (the probe then runs in each rank's own process)")
    if wanted and cfg.train.global_batch is not None:
        raise CLIError("probe.isolate=true probes without a plan: drop train.global_batch, or probe.isolate")
    if wanted is None:
        return device_type == "cuda" and not distributed and cfg.train.global_batch is None
    return bool(wanted)


def child_command(out_dir: Path, argv: list[str] | None = None, task: list[str] | None = None) -> list[str]:
    """``python -m autobatch probe`` with this job's overrides (``task``: Hydra's, which are this
    job's own values in a sweep), the config-location flags of ``argv``, and ``out_dir`` as
    its run directory."""
    argv = sys.argv[1:] if argv is None else argv
    task = given_overrides() if task is None else task
    flags: list[str] = []
    for index, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name in _CONFIG_FLAGS:
            flags += [arg] if "=" in arg else argv[index:index + 2]
    overrides = [o for o in task if not o.lstrip("+~").startswith("hydra.")]
    return [sys.executable, "-m", "autobatch", "probe", *flags, *overrides, f"hydra.run.dir={out_dir}", "probe.isolate=false"]


def child_environment(environ: dict[str, str] | None = None, path: list[str] | None = None) -> dict[str, str]:
    """The child's environment: this one, with this process's own import paths (``sys.path``
    entries outside the interpreter's installation, such as the directory ``python -m`` ran in)
    added to ``PYTHONPATH``, so a ``_target_`` from the user's own modules imports in the child
    wherever it starts."""
    environ = dict(os.environ if environ is None else environ)
    site_dirs = getattr(site, "getsitepackages", list)()  # absent in some old virtualenvs
    installed = [sys.prefix, sys.base_prefix, sys.exec_prefix, *site_dirs, site.getusersitepackages()]
    installed = [str(Path(p).resolve()) for p in installed if p]
    own = []
    for entry in sys.path if path is None else path:
        if not entry or not Path(entry).is_dir():
            continue
        resolved = str(Path(entry).resolve())
        if not any(resolved == root or resolved.startswith(root + os.sep) for root in installed):
            own.append(resolved)
    current = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    joined = list(dict.fromkeys([*current, *own]))
    if joined:
        environ["PYTHONPATH"] = os.pathsep.join(joined)
    return environ


def probe_in_child(out_dir: Path) -> ProbeResult:
    """Run the probe as a child process writing into ``out_dir`` (its table and trial lines go
    to this process's terminal); its result, as a cache hit returns one (without the parking the
    child did in its own process). A failed child hands its one-line error back
    (:data:`~autobatch.cli.errors.ERROR_FILE_ENV`) and it is raised here with the child's exit
    status: one line, and a sweep's summary names it; a child that died without one (killed,
    crashed) is one error naming its exit status.

    The child starts in the directory the command was run from (Hydra's ``runtime.cwd``), not
    the run directory ``hydra.job.chdir=true`` moved this process into: relative paths in the
    overrides and the user's own modules resolve there as they did for this process."""
    cwd = HydraConfig.get().runtime.cwd if HydraConfig.initialized() else None
    handle, error_file = tempfile.mkstemp(prefix="autobatch-probe-error-", suffix=".json")
    os.close(handle)
    environ = {**child_environment(), QUIET_ENV: "1", ERROR_FILE_ENV: error_file}  # keys ignored: named here already
    try:
        done = subprocess.run(child_command(out_dir.resolve()), check=False, cwd=cwd, env=environ)
        error = handed_back(error_file) if done.returncode != 0 else None
    finally:
        os.unlink(error_file)
    if error is not None:
        raise CLIError(*error)
    result_file = out_dir / "result.json"
    if done.returncode != 0 or not result_file.is_file():
        raise CLIError(f"the probe's child process (probe.isolate) failed with exit status {done.returncode}; "
                       f"its error is above (run dir {out_dir})", done.returncode or RUNTIME_FAILURE)
    data = json.loads(result_file.read_text(encoding="utf-8"))  # from_dict leaves out its command and config
    return forget_own_layout(ProbeResult.from_dict(data))  # the child laid out its own state, not this process's
