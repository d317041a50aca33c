"""autobatch's Hydra command line: ``python -m autobatch probe|train [overrides]``.

The only part of autobatch that imports Hydra and OmegaConf. Importing this package
registers the structured configs (and the resolver the shipped ``hydra.output_subdir`` uses)
and makes the shipped configs importable as ``autobatch.conf``, so
``initialize_config_module("autobatch.conf")`` + ``compose`` work.
"""

from .conf import CONF_MODULE, ensure_conf_module
from .config import register_configs
from . import run_dir  # noqa: F401 - registers the autobatch.record_dir resolver the shipped configs' hydra node uses

ensure_conf_module()
register_configs()

__all__ = ["CONF_MODULE", "ensure_conf_module", "register_configs"]
