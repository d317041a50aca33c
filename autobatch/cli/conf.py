"""Locate the shipped configs: make ``autobatch.conf`` importable from a wheel and a checkout.

The configs live in one place, ``conf/`` at the top of the repository. A built wheel installs
that directory as the package ``autobatch.conf`` (pyproject.toml's ``package-dir``
mapping). Run from a source checkout without installing, ``autobatch/`` has no ``conf``
subpackage, so :func:`ensure_conf_module` imports ``<checkout>/conf`` under that name. Either
way Hydra reads ``pkg://autobatch.conf`` and tests can ``initialize_config_module``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["CONF_MODULE", "CONFIG_PATH", "ensure_conf_module"]

CONF_MODULE = "autobatch.conf"
#: The ``config_path`` handed to ``hydra.main``.
CONFIG_PATH = f"pkg://{CONF_MODULE}"


def ensure_conf_module() -> str:
    """Make ``autobatch.conf`` importable (a no-op once it is); return its name.

    Raises ``RuntimeError`` when neither an installed ``autobatch.conf`` nor a checkout's
    ``conf/`` exists (a broken install).
    """
    if CONF_MODULE in sys.modules or importlib.util.find_spec(CONF_MODULE) is not None:
        return CONF_MODULE
    source_conf = Path(__file__).resolve().parents[2] / "conf"
    init = source_conf / "__init__.py"
    if not init.is_file():
        raise RuntimeError(
            f"autobatch's configs are missing: no package {CONF_MODULE} and no {source_conf}; "
            "reinstall autobatch"
        )
    spec = importlib.util.spec_from_file_location(CONF_MODULE, init, submodule_search_locations=[str(source_conf)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[CONF_MODULE] = module
    spec.loader.exec_module(module)
    import autobatch

    autobatch.conf = module  # type: ignore[attr-defined]  # so `import autobatch.conf` finds it too
    return CONF_MODULE
