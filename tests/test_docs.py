"""The README is the front door and the docs site the manual: both must stay true and build."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _relative_links(path):
    for target in LINK.findall(path.read_text()):
        if not target.startswith(("http://", "https://", "mailto:")):
            yield target


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
    text = "\n".join(lines)
    assert "bash scripts/setup.sh && python -m autobatch probe" in text
    assert "bash scripts/setup.sh --dev && python -m pytest" in text


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (REPO / "docs").glob("*.md"))])
def test_relative_links_point_at_files(page):
    path = REPO / page if page == "README.md" else REPO / "docs" / page
    missing = [t for t in _relative_links(path) if not (path.parent / t).exists()]
    assert not missing, f"{page} links to missing files: {missing}"


def test_the_ci_command_is_the_readmes():
    ci = (REPO / ".ci" / "run").read_text()
    command = re.search(r"^bash scripts/setup.sh --dev && python -m pytest[^\n#]*", ci, re.M).group(0).strip()
    assert command in (REPO / "README.md").read_text()


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    # no -q: mkdocs 1.6 counts the warnings --strict aborts on only at the level it logs, so a
    # quiet build passed with broken links and griffe's docstring warnings
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the built reference holds every public name, and every field of the records a user reads
    # (mkdocstrings drops a member without a docstring: ProbeResult.to_dict, every dataclass field)
    import dataclasses

    import autobatch
    from autobatch.integrations.decorator import Attempt

    anchors = set(re.findall(r'id="(autobatch\.[\w.]+)"', (tmp_path / "site" / "api" / "index.html").read_text()))
    records = {f"autobatch.{n}": getattr(autobatch, n) for n in ("ProbeResult", "TrialRecord", "Plan", "RunResult",
                                                                  "MemoryEstimate", "BatchEstimate")}
    records["autobatch.integrations.decorator.Attempt"] = Attempt
    wanted = {f"autobatch.{name}" for name in autobatch.__all__ if name != "__version__"}
    wanted |= {f"{path}.{f.name}" for path, cls in records.items() for f in dataclasses.fields(cls)}
    wanted |= {f"{path}.{m}" for path, cls in records.items() for m in ("to_dict", "to_json") if hasattr(cls, m)}
    assert not sorted(wanted - anchors), f"docs/api.md's reference lacks {sorted(wanted - anchors)}"


_STUB_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
case "$*" in
  "-c import torch") exit "${STUB_NO_TORCH:-0}" ;;
  *"sys.exit((int"*) exit "${STUB_OLD_TORCH:-0}" ;;
  *"print(torch.__version__)"*) echo 2.5.1+cu121 ;;
esac
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's CPU wheels carry the +cpu label")
def test_review36_setup_installs_only_a_cpu_torch_and_keeps_an_old_one(tmp_path):
    """scripts/setup.sh, run with a stub Python that logs each call: without torch it asks pip for
    the +cpu wheel by name (a plain ==2.13.0 takes a +cu128 wheel in find-links, whose label sorts
    higher); with a torch older than 2.9 it stops, naming the upgrade, before the editable install
    (whose resolver would replace it with PyPI's CUDA build)."""
    stub = tmp_path / "python"
    stub.write_text(_STUB_PYTHON)
    stub.chmod(0o755)
    log = tmp_path / "calls"
    run = lambda **env: subprocess.run(  # noqa: E731
        ["bash", str(REPO / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHON": str(stub), "STUB_LOG": str(log), **env})
    assert run(STUB_NO_TORCH="1").returncode == 0
    calls = log.read_text().splitlines()
    torch_pips = [c for c in calls if c.startswith("-m pip") and "torch==" in c]
    assert torch_pips and all("torch==2.13.0+cpu" in c for c in torch_pips), calls
    log.unlink()
    old = run(STUB_OLD_TORCH="1")
    assert old.returncode == 1 and "needs torch>=2.9" in old.stderr and "2.5.1+cu121" in old.stderr
    assert not [c for c in log.read_text().splitlines() if c.startswith("-m pip install")]
