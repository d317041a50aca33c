"""Package discovery for setuptools; all metadata lives in pyproject.toml.

The subpackages are found automatically (a new one under ``autobatch/`` ships without an
edit here) and the top-level ``conf/`` ships as the package ``autobatch.conf``.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["autobatch", "autobatch.*"]) + ["autobatch.conf"],
    package_dir={"autobatch.conf": "conf"},
)
