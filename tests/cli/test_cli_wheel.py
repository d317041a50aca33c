"""The built wheel ships the configs: install it into a fresh venv, probe from elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

from conftest import REPO


def _run(*args, **kwargs):
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done


def test_wheel_installs_and_the_default_probe_runs_outside_the_checkout(tmp_path):
    # Build from a copy, so the build's by-products never land in the checkout.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("autobatch", "conf"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source))
    (wheel,) = wheels.glob("autobatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "autobatch/conf/probe.yaml" in names and "autobatch/conf/model/gpt.yaml" in names

    venv = tmp_path / "venv"  # sees the global torch and hydra, but not this checkout
    _run(sys.executable, "-m", "venv", "--system-site-packages", str(venv))
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    env["OMP_NUM_THREADS"] = "1"
    _run(str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel), env=env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    located = _run(str(python), "-c", "import autobatch; print(autobatch.__file__)", cwd=elsewhere, env=env)
    assert str(venv) in located.stdout  # the installed copy, not the checkout

    done = _run(str(python), "-m", "autobatch", "probe", cwd=elsewhere, env=env)  # the embedded default
    assert "batch size" in done.stdout
    (result_file,) = elsewhere.glob("outputs/probe/*/*/result.json")
    result = json.loads(result_file.read_text())
    assert result["batch_size"] >= 1 and result["config"]["model"]["_target_"] == "autobatch.workloads.models.GPT"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["outputs"]  # nothing else in the cwd

    script = _run(str(venv / "bin" / "autobatch"), "--help", cwd=elsewhere, env=env)  # the console script
    assert "probe" in script.stdout
