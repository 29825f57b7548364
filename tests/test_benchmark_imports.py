"""The benchmarks import names from ray_diloco inside their functions, where a test that only imports the script
would not see a name that moved (benchmarks/overhead.py once imported `resolve_vocab` from the driver after it
had moved to run_setup, and failed only when run). Every `from ray_diloco… import name` in benchmarks/ and
docs/ scripts must name something that exists."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("docs/*.py"), *ROOT.glob("jobs/*.py")])


def imported_names(script: Path):
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ray_diloco"):
            for alias in node.names:
                yield node.module, alias.name, node.lineno


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_script_imports_from_ray_diloco_exists(script):
    missing = []
    for module, name, line in imported_names(script):
        imported = importlib.import_module(module)
        if not hasattr(imported, name):
            try:  # a submodule: `from ray_diloco.data import files`
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{script.name}:{line}: {module}.{name}")
    assert not missing, missing
