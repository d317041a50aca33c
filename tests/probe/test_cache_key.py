"""The probe cache key's reading of code: stable across processes."""

import os
import pathlib
import subprocess
import sys

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def test_a_set_literal_in_the_code_is_keyed_the_same_under_any_hash_seed(tmp_path):
    """``x in {"gelu", "relu"}`` compiles to a frozenset constant whose repr's order follows
    PYTHONHASHSEED: keyed by its repr, the same code got another key in every new process, and
    the persistent cache never hit (transformers' models read one through strtobool)."""
    script = tmp_path / "key.py"
    script.write_text(
        "from autobatch.probe.cache_key import _code_hash\n"
        "def act(x):\n    return x in {'gelu', 'relu', 'silu', 'tanh', 'swish', 'mish', 'quick_gelu'}\n"
        "print(_code_hash(act))\n")
    keys = {subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": ROOT}).stdout for seed in ("1", "2")}
    assert len(keys) == 1
