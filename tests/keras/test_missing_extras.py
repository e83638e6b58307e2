"""Without its framework, a binding's import fails with an ImportError that names the extra."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module,framework,extra", [("ringserve.keras", "keras", "keras"),
                                                    ("ringserve.tensorflow", "tensorflow", "tensorflow")])
def test_a_binding_without_its_framework_names_the_extra_to_install(module: str, framework: str, extra: str) -> None:
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            f"try:\n    import {module}\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ImportError:" in done.stdout and f"pip install ringserve[{extra}]" in done.stdout


def test_no_binding_imports_another() -> None:
    code = ("import os, sys; os.environ['KERAS_BACKEND'] = 'torch'\nimport ringserve.keras\n"
            "print(sorted(m for m in sys.modules if m.startswith(('ringserve.torch', 'ringserve.tensorflow'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
