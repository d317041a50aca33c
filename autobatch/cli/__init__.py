"""autobatch's Hydra command line: ``python -m autobatch probe|train [overrides]``.

The only part of autobatch that imports Hydra and OmegaConf. Importing this package
registers the structured configs and makes the shipped configs importable as
``autobatch.conf``, so ``initialize_config_module("autobatch.conf")`` + ``compose`` work.
"""

from .conf import CONF_MODULE, ensure_conf_module
from .config import register_configs

ensure_conf_module()
register_configs()

__all__ = ["CONF_MODULE", "ensure_conf_module", "register_configs"]
