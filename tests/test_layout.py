"""The package's layout is its design: these checks keep it readable as it grows.

* the pipeline flows one way: memory -> probe -> planning -> training -> dist, with report,
  workloads, integrations and cli at the edge; a module imports only from its own stage or
  earlier ones (function-level imports included);
* Hydra and OmegaConf are imported only under ``cli/``, and ``import autobatch`` works
  without them, every public name resolving;
* no module over 400 lines, no function over 100.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autobatch"

#: Stages in pipeline order; a module may import from its own stage and earlier ones.
STAGES = {
    "version": 0, "keywords": 0, "memory": 0, "errors": 1, "checks": 1, "probe": 2, "planning": 3, "training": 4, "dist": 5,
    "report": 6, "workloads": 6, "integrations": 7, "cli": 8, "__init__": 9, "__main__": 9,
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 100


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _stage_of(parts: tuple[str, ...]) -> str:
    head = parts[0]
    return head[:-3] if head.endswith(".py") else head


def _imported_stages(path: Path) -> list[tuple[int, str]]:
    """``(line, stage)`` for every import of another autobatch module in ``path``."""
    relative = path.relative_to(PACKAGE).parts
    package = relative[:-1]  # the package the module lives in, as path parts
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = list(base) + (node.module.split(".") if node.module else [])
                names = [target] if target else [[alias.name] for alias in node.names]
            elif node.module and node.module.split(".")[0] == "autobatch":
                names = [node.module.split(".")[1:] or [alias.name for alias in node.names][:1]]
            else:
                continue
            found += [(node.lineno, name[0].removesuffix(".py")) for name in names if name]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "autobatch" and len(parts) > 1:
                    found.append((node.lineno, parts[1]))
    return found


def test_the_pipeline_flows_one_way():
    backwards = []
    for path in _modules():
        relative = path.relative_to(PACKAGE).parts
        own = _stage_of(relative)
        for line, stage in _imported_stages(path):
            if stage in STAGES and own in STAGES and STAGES[stage] > STAGES[own]:
                backwards.append(f"{path.relative_to(PACKAGE)}:{line} imports {stage} ({own} comes before it)")
    assert not backwards, "imports against the pipeline:\n" + "\n".join(backwards)


def test_every_module_belongs_to_a_stage():
    unknown = {_stage_of(p.relative_to(PACKAGE).parts) for p in _modules()} - set(STAGES)
    assert not unknown, f"add these to STAGES in the right place of the pipeline: {sorted(unknown)}"


def test_hydra_is_imported_only_by_the_cli():
    offenders = []
    for path in _modules():
        if path.relative_to(PACKAGE).parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for n in names if n.split(".")[0] in ("hydra", "omegaconf")]
    assert not offenders, f"hydra/omegaconf outside cli/: {offenders}"


def test_import_autobatch_needs_no_hydra_nor_fsdp_and_every_public_name_resolves():
    code = (
        "import sys; sys.modules['hydra'] = None; sys.modules['omegaconf'] = None\n"
        "import autobatch\n"
        "missing = [n for n in autobatch.__all__ if getattr(autobatch, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert callable(autobatch.plan) and callable(autobatch.train)\n"
        "heavy = [m for m in ('torch.distributed.tensor', 'torch.distributed.fsdp') if m in sys.modules]\n"
        "assert not heavy, f'imported at start-up (about a second a process): {heavy}'\n"
        "print(len(autobatch.__all__))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 40


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_short(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_MODULE_LINES, f"{len(lines)} lines: split it by responsibility"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse("\n".join(lines)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_every_module_compiles_without_a_warning():
    """An invalid escape in a docstring (``\\ s``) is a SyntaxWarning on Python 3.12, printed in
    every user's test output (and an error in a later Python)."""
    import warnings

    noisy = []
    for path in _modules():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(encoding="utf-8"), str(path), "exec")
            except SyntaxError as exc:
                noisy.append(f"{path.relative_to(PACKAGE)}: {exc.msg}")
    assert not noisy, noisy


def test_notes_are_added_through_the_python_310_helper():
    """``BaseException.add_note`` exists from Python 3.11; autobatch supports 3.10, where calling it
    raised ``AttributeError`` and hid the user's own error: every note goes through
    :func:`autobatch.errors.add_note`."""
    direct = [f"{path.relative_to(PACKAGE)}:{number}" for path in sorted(PACKAGE.rglob("*.py")) if path.name != "errors.py"
              for number, line in enumerate(path.read_text().splitlines(), 1) if ".add_note(" in line]
    assert not direct, direct
