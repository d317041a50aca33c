"""The manual names real things: every ``autobatch.<name>`` the README and the docs pages cite
resolves, every repository path they cite exists, and the README's links into the docs land on
a heading. The mkdocs build checks links between pages, not these: a module, test or script that
is renamed or removed left the prose pointing at nothing."""

from __future__ import annotations

import ast
import importlib
import re

import pytest
from conftest import REPO

PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
# not an OmegaConf resolver a config interpolates (`${autobatch.record_dir:.hydra}`, docs/cli.md)
NAME = re.compile(r"(?<!\$\{)\bautobatch(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])((?:autobatch|tests|scripts|conf|docs)/[\w./-]*\w)")
FILE_SUFFIXES = (".py", ".md", ".json", ".log", ".pt", ".png", ".yaml", ".csv", ".jsonl")
# Integrations import their framework (seconds): their names are read from the module's __all__.
STATIC = ("autobatch.integrations.lightning", "autobatch.integrations.transformers")


def _cited(pattern):
    for page in PAGES:
        for number, line in enumerate((REPO / page).read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                yield match.group(match.lastindex or 0).rstrip("."), f"{page}:{number}"


def _exported(module: str) -> set[str]:
    """Top-level names of ``module``'s source, without importing it."""
    tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):  # re-exported: `from .x import name`
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _resolves(name: str) -> bool:
    for module in STATIC:
        if name == module or name.startswith(module + "."):
            rest = name[len(module) + 1:].split(".")
            return not rest[0] or rest[0] in _exported(module)
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_every_cited_autobatch_name_resolves():
    missing = sorted({f"{name} ({where})" for name, where in _cited(NAME)
                      if not name.endswith(FILE_SUFFIXES) and not _resolves(name)})
    assert not missing, f"the docs cite names that do not exist: {missing}"


def test_every_cited_repository_path_exists():
    missing = sorted({f"{path} ({where})" for path, where in _cited(PATH) if not (REPO / path).exists()})
    assert not missing, f"the docs cite paths that do not exist: {missing}"


def _slug(heading: str) -> str:
    """The anchor mkdocs' toc extension gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", re.sub(r"`", "", heading)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@pytest.mark.parametrize("link", sorted(set(re.findall(r"\]\((docs/[^)#\s]+#[^)\s]+)\)", (REPO / "README.md").read_text()))))
def test_the_readmes_anchors_land_on_headings(link):
    page, anchor = link.split("#", 1)
    headings = [line.lstrip("#").strip() for line in (REPO / page).read_text().splitlines() if line.startswith("#")]
    assert anchor in {_slug(h) for h in headings}, f"README.md links to {link}, a heading {page} does not have"
