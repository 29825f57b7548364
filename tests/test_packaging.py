"""Packaging: CI runs exactly the README's test command, whose `test` extra brings every third-party module the
tests import, and the Python floor is one the code supports."""

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import name -> distribution, for the modules the tests use beyond the package's own dependencies.
DISTRIBUTIONS = {"pytest": "pytest", "hypothesis": "hypothesis", "matplotlib": "matplotlib"}


def readme_test_command() -> str:
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if "python -m pytest" in line]
    return lines[0].split("#")[0].strip()


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert readme_test_command() in ci_lines
    # Nothing else installs the project or runs tests: what a new user runs is what CI runs.
    assert not [line for line in ci_lines if ("pytest" in line or "-e ." in line or "-e '." in line)
                and line != readme_test_command()]


def test_the_test_extra_brings_what_the_tests_and_benchmarks_they_run_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = re.search(r"\.\[([a-z,_-]+)\]", readme_test_command()).group(1).split(",")
    installed = {re.split(r"[<>=\[ ]", req)[0].lower()
                 for name in extra for req in project["optional-dependencies"][name]}
    installed |= {re.split(r"[<>=\[ ]", req)[0].lower() for req in project["dependencies"]}
    imported = set()
    for path in [*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    missing = {DISTRIBUTIONS[m] for m in imported if m in DISTRIBUTIONS} - installed
    assert not missing, f"the README's test command does not install {missing}"


def test_python_floor_is_one_whose_timeout_errors_the_averaging_loop_catches():
    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    major, minor = map(int, re.search(r">=\s*(\d+)\.(\d+)", floor).groups())
    assert (major, minor) >= (3, 11), floor  # on 3.10 concurrent.futures.TimeoutError is another class
    assert sys.version_info >= (major, minor)


def test_a_run_past_its_time_budget_ends_failing_with_its_report():
    """CI ends at 90 min without a report; the suite's budget (pyproject's session_timeout) ends it first, with one.
    Here a budget spent before the first test ends: that test passes, no other runs, and the run fails, saying why,
    with its durations."""
    import subprocess

    assert 'session_timeout = ' in (ROOT / "pyproject.toml").read_text()
    tests = ["tests/test_config.py", "tests/test_codecs.py"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "session_timeout=0.001", *tests]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:]
    assert re.search(r"\b1 passed\b", done.stdout) and "failed" not in done.stdout, done.stdout[-2000:]
    assert "session-timeout: 0.001 sec exceeded" in done.stdout, done.stdout[-2000:]
    assert "slowest" in done.stdout  # the report CI needs is there
