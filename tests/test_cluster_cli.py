"""scripts/cluster answers bad usage with a message and exit code 2, never a traceback."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "cluster"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


def test_help_names_every_command():
    out = run("--help")
    assert out.returncode == 0 and all(c in out.stdout for c in ("up", "scenario", "cleanup"))
    out = run("scenario", "--help")
    assert out.returncode == 0 and "--delay-ms" in out.stdout and "curve" in out.stdout


def test_an_unknown_scenario_is_a_message():
    out = run("scenario", "teleport")
    assert out.returncode == 2 and "unknown scenario 'teleport'" in out.stderr and "Traceback" not in out.stderr


def test_bad_sizes_are_a_message():
    out = run("scenario", "share", "--pools", "0")
    assert out.returncode != 0 and "Traceback" not in out.stderr
