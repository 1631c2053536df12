"""The runner of the Python package's broken variants (scripts/lmcache-mutants.py,
scripts/vllm-mutants.py): each script names its variants and the tests that must catch them;
this copies python/ to a scratch folder with the test environment's compiled module
(kvx._kvx) beside it, applies one variant at a time to the copy, runs the tests against it
(the copy first on PYTHONPATH), and reports each variant caught, missed or stale.
"""
import os
import shutil
import subprocess
import sys

import mutant_selection

ROOT = mutant_selection.ROOT


def run_one(scratch, python, mutant, pytest_args, script):
    path, old, new, what = mutant
    target = os.path.join(scratch, path)
    shutil.copy(os.path.join(ROOT, path), target)
    text = open(target).read()
    if old not in text:
        return f"STALE (pattern not found: update {script})", what
    open(target, "w").write(text.replace(old, new, 1))
    env = dict(os.environ, PYTHONPATH=os.path.join(scratch, "python"))
    # A variant's run is judged by its named tests alone: the suite's skip policy and skip
    # log belong to the test command's own runs (python/tests/conftest.py).
    for key in ("KVX_NO_MODULE_SKIPS", "KVX_SKIP_LOG"):
        env.pop(key, None)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "log_level=CRITICAL",
           *pytest_args(scratch)]
    proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=900)
    shutil.copy(os.path.join(ROOT, path), target)
    failed = [l.split(" ")[1] for l in proc.stdout.splitlines() if l.startswith("FAILED ")]
    if proc.returncode == 0:
        return "MISSED", what
    if not failed:
        return f"ERROR (pytest exit {proc.returncode}): {proc.stdout[-500:]}", what
    return "caught by " + ", ".join(f.split("::")[-1] for f in failed), what


def main(mutants, python, scratch, pytest_args, script):
    """Runs the variants the command line selects (scripts/mutant_selection.py: all by
    default, names, --check or --changed); exits 1 if any is stale or not caught.
    `pytest_args(scratch)` gives the tests (and options) to run in the copy."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        # The calling script's docstring is its help; never a run of every variant.
        print(sys.modules["__main__"].__doc__ or "")
        return
    names = mutant_selection.select(mutants, sys.argv[1:], script)
    if not names:
        return
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "python"), os.path.join(scratch, "python"))
    # The checkout holds kvx's Python sources only; the copy, which shadows the installed
    # package, needs the installed wheel's compiled module too. Asked from / with no
    # PYTHONPATH, so that nothing but the environment's own kvx answers.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    native = subprocess.run([python, "-c", "import kvx._kvx; print(kvx._kvx.__file__)"],
                            cwd="/", env=env, capture_output=True, text=True, check=True)
    shutil.copy(native.stdout.strip(), os.path.join(scratch, "python/kvx"))
    width = max(len(n) for n in names) + 2
    missed = False
    for name in names:
        verdict, what = run_one(scratch, python, mutants[name], pytest_args, script)
        missed |= not verdict.startswith("caught")
        print(f"{name:{width}} {verdict}\n{'':{width}} ({what})", flush=True)
    sys.exit(1 if missed else 0)
