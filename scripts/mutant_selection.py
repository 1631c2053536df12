"""Which deliberately broken variants a runner runs (scripts/mutants.py, scripts/python_mutants.py
for kvx.lmcache's and kvx.vllm's): shared by every table.

  (no names)    every variant of the table
  NAME ...      those variants
  --check       none: only checks that every variant's pattern still applies to its file
                (a refactor that moved the code makes a variant stale, and a stale variant
                checks nothing)
  --changed     checks every pattern, then runs the variants whose file changed since the
                commit at which `scripts/evidence.sh` last ran every variant (recorded in
                `.ci/evidence-commit`): CI's gate runs those, the evidence run all of them

A variant is (file, ...); its file is a path relative to the repository's root.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIDENCE_COMMIT = os.path.join(ROOT, ".ci/evidence-commit")


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def evidence_base():
    """The commit the changes are counted from: the one recorded in .ci/evidence-commit when
    this history holds it, else the parent of HEAD (a history without the record, or a
    shallow clone), else None (no history: every variant runs)."""
    try:
        recorded = open(EVIDENCE_COMMIT).read().split()[0]
    except (OSError, IndexError):
        recorded = None
    for candidate, why in ((recorded, "the last full evidence run"), ("HEAD~1", "the parent commit")):
        if candidate and git("merge-base", "--is-ancestor", candidate, "HEAD").returncode == 0:
            return candidate, why
    return None, None


def changed_files(base):
    """Files that differ from `base` in the working tree, committed or not, and untracked ones."""
    diff = git("diff", "--name-only", base).stdout.split()
    untracked = git("ls-files", "--others", "--exclude-standard").stdout.split()
    return set(diff) | set(untracked)


def select(table, args, script):
    """The names to run, from the command line `args` (less the runner's own flags); prints
    what it selected and why. Exits 1 (after listing them) if --check or --changed finds a
    stale pattern; `applies(name)` tells whether a variant's pattern still applies."""
    unknown = [a for a in args if not a.startswith("--") and a not in table]
    if unknown:
        sys.exit(f"{script}: no such variant: {', '.join(unknown)} (--list names them)")
    names = [a for a in args if not a.startswith("--")]
    if "--check" not in args and "--changed" not in args:
        return names or list(table)
    stale = [n for n in table if not applies(table[n])]
    if stale:
        for n in stale:
            print(f"{n}: STALE (pattern not found in {table[n][0]}: update {script})")
        sys.exit(1)
    print(f"{script}: the patterns of all {len(table)} variants apply")
    if "--check" in args:
        return []
    base, why = evidence_base()
    if base is None:
        print(f"{script}: no history to compare with: every variant runs")
        return list(table)
    changed = changed_files(base)
    names = [n for n in table if table[n][0] in changed]
    print(f"{script}: {len(names)} of {len(table)} variants have a file changed since "
          f"{base[:12]} ({why})" + (f": {', '.join(names)}" if names else ""))
    return names


def applies(variant):
    """Whether every `old` of the variant is in its file: (file, old, new, ...) replaces one
    text, (file, [(old, new), ...], ...) several."""
    path, change = variant[0], variant[1]
    try:
        text = open(os.path.join(ROOT, path)).read()
    except OSError:
        return False
    for old, new in change if isinstance(change, list) else [(change, variant[2])]:
        if old not in text:
            return False
        text = text.replace(old, new)
    return True
