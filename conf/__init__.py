"""autobatch's Hydra configs (installed as the package ``autobatch.conf``).

This directory is the one source of truth: pyproject.toml maps it into the wheel as
``autobatch.conf``, and from a source checkout :mod:`autobatch.cli.conf` imports it under that
name, so ``pkg://autobatch.conf`` and ``initialize_config_module("autobatch.conf")`` work in both.
"""
