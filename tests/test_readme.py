"""The README's option reference is the code's: every command, option and key has its README mention."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_reference_is_current():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import readme_reference

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    assert readme_reference.splice(readme, readme_reference.reference()) == readme, \
        "README reference is stale: run python3 scripts/readme_reference.py --write"


def test_every_command_has_help():
    out = subprocess.run([sys.executable, "-m", "tiers.cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0
    import argparse
    from tiers.cli import build_parser

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():  # nested commands such as `config check`
                    walk(sub, f"{name} {sub_name}")
            elif name:
                assert action.help, f"{name} {action.option_strings or action.dest} has no --help line"

    walk(build_parser(), "")


def test_readme_names_the_two_first_commands_and_ci_runs_the_test_one():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as fh:
        ci = fh.read()
    test_command = "scripts/install.sh --test && python3 -m pytest -q"
    assert "scripts/install.sh && hicache-tiers demo" in readme
    assert test_command in readme and test_command in ci


def test_the_compatibility_table_names_tests_that_exist():
    """docs/COMPATIBILITY.md cites `tests/file.py::test` (or `::test` of the file cited last)."""
    import re

    with open(os.path.join(ROOT, "docs", "COMPATIBILITY.md"), encoding="utf-8") as fh:
        text = fh.read()
    cited, current = 0, None
    for match in re.finditer(r"`(tests/\w+\.py)?(::\w+)?`", text):
        path, test = match.groups()
        if path:
            current = os.path.join(ROOT, path)
            assert os.path.exists(current), path
            cited += 1
        if test:
            with open(current, encoding="utf-8") as fh:
                assert f"def {test[2:]}(" in fh.read(), f"{current} has no {test[2:]}"
            cited += 1
    assert cited >= 20
