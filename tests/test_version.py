"""One version: the installed distribution's comes from mergepipe.__version__ (pyproject's
dynamic version), and `mergepipe --version` prints it; commands never import
importlib.metadata just to learn it."""
import importlib.metadata
import subprocess
import sys

import mergepipe


def test_installed_version_is_the_package_constant():
    assert importlib.metadata.version("mergepipe") == mergepipe.__version__


def test_cli_prints_it_and_a_cached_command_skips_importlib_metadata():
    out = subprocess.run([sys.executable, "-m", "mergepipe", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"mergepipe {mergepipe.__version__}"
    code = "import sys, mergepipe.cli; print('importlib.metadata' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
