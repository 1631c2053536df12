#!/usr/bin/env python3
"""Structure checks that CI runs (.ci/run): no import circles, no doc naming a missing file.

1. Rust: inside each crate, the modules that sit side by side (the top-level modules, and the
   children of each folder or inline module) must not import each other in a circle. An edge
   A -> B is a path that names B from code in A: `use crate::b::…`, `crate::b::…` in code,
   `super::…` / `self::…` paths resolved from where they stand. A parent declaring `mod child`
   is no edge; a path that lands on the parent itself (an item its file defines, or a
   re-export) is not counted among siblings, so the usual face pattern (a `mod.rs` that
   re-exports its children, whose children use items of their parent) is no circle.
2. Python: the same for the modules of `python/kvx` (each package's children among
   themselves); imports under `if TYPE_CHECKING:` do not run, so they are not edges. Imports
   inside functions run, so they are.
3. Docs: every repo path that `README.md` and `docs/**/*.md` name (in backticks or as a link)
   exists. `path:line` and `path#anchor` name the path; `…`, `...` and `*` stand for any
   folders or names; `../shared/…` lies outside the repository and is not checked.

Usage: python3 scripts/check_structure.py [--root DIR] [--self-test]
Exit status 1 when any check finds something; each finding names files and lines.
Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

ModPath = Tuple[str, ...]


@dataclass(frozen=True)
class Edge:
    """`source` names `target` at `file`:`line` (`text` is that line, trimmed)."""

    source: ModPath
    target: ModPath
    file: Path
    line: int
    text: str


# ---------------------------------------------------------------------------------------------
# Circles in a graph whose nodes are the children of one module or package.


def strongly_connected(nodes: Iterable[str], succ: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's components, iteratively (deep module chains must not hit the recursion limit)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components: List[List[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def one_cycle(component: Sequence[str], succ: Dict[str, Set[str]]) -> List[str]:
    """A shortest circle through the component's first node, as the nodes it passes."""
    start = component[0]
    members = set(component)
    came_from: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(succ.get(node, ())):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return list(reversed(path))
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    return list(component)


# A circle is named by where it is (a crate's root file or the Python package), the module
# whose children it ties, and those children.
CircleKey = Tuple[str, str, Tuple[str, ...]]

# Circles that stand today and are to be broken, each with what ties it. A circle listed here
# is reported but does not fail the check; one that grows, or any other, fails it; and a
# listed one that no longer stands fails it too, so that the list only shrinks.
KNOWN_CIRCLES: Dict[CircleKey, str] = {
}


def circles_among_children(
    edges: Sequence[Edge],
    parents: Iterable[ModPath],
    show: Callable[[ModPath], str],
    where: str,
    separator: str,
) -> List[Tuple[CircleKey, str]]:
    """For each parent, the circles among its children: each one's key and report."""
    reports = []
    for parent in sorted(set(parents)):
        depth = len(parent)
        succ: Dict[str, Set[str]] = {}
        evidence: Dict[Tuple[str, str], List[Edge]] = {}
        for edge in edges:
            if len(edge.source) <= depth or len(edge.target) <= depth:
                continue
            if edge.source[:depth] != parent or edge.target[:depth] != parent:
                continue
            a, b = edge.source[depth], edge.target[depth]
            if a == b:
                continue
            succ.setdefault(a, set()).add(b)
            found = evidence.setdefault((a, b), [])
            if not found or (found[-1].file, found[-1].line) != (edge.file, edge.line):
                found.append(edge)
        for component in strongly_connected(succ.keys(), succ):
            if len(component) < 2:
                continue
            cycle = one_cycle(component, succ)
            names = [show(parent + (n,)) for n in cycle]
            lines = [f"circle: {' -> '.join(names + [names[0]])}"]
            if len(component) > len(cycle):
                lines.append(f"  (one of several among: {', '.join(component)})")
            members = set(component)
            tied = sorted((a, b) for (a, b) in evidence if a in members and b in members)
            for a, b in tied:
                for edge in evidence[(a, b)][:3]:
                    lines.append(f"  {edge.file}:{edge.line}: {edge.text}")
                more = len(evidence[(a, b)]) - 3
                if more > 0:
                    lines.append(f"  … and {more} more from {show(parent + (a,))}")
            key = (where, separator.join(parent), tuple(component))
            reports.append((key, "\n".join(lines)))
    return reports


# ---------------------------------------------------------------------------------------------
# Rust: the module tree from `mod` declarations, and the paths each module names.

RUST_STRING = re.compile(r'b?r(#*)"(?:.|\n)*?"\1|b?"(?:\\.|[^"\\])*"', re.S)
CHAR_LITERAL = re.compile(r"b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'")
TEST_ONLY = r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?"
TOKEN = re.compile(
    rf"(?P<test_use>{TEST_ONLY}use\s+[^;]*;)"
    rf"|(?P<test_mod>{TEST_ONLY}mod\s+(?:r#)?\w+\s*(?P<test_end>[;{{]))"
    r"|(?P<use>\buse\s+(?P<tree>[^;]*);)"
    r"|(?P<mod>\bmod\s+(?P<name>r#\w+|\w+)\s*(?P<end>[;{]))"
    r"|(?P<path>(?<![\w$:])\$?(?:crate|super|self)(?:\s*::\s*(?:r#)?\w+)+)"
    r"|(?P<open>\{)|(?P<close>\})"
)


def blank(text: str) -> str:
    """`text` with every character but newlines turned to spaces (lines keep their numbers)."""
    return re.sub(r"[^\n]", " ", text)


def strip_rust(source: str) -> str:
    """Comments, strings and character literals blanked out; lifetimes are left alone."""
    out: List[str] = []
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            out.append(blank(source[i:end]))
            i = end
        elif source.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if source.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif source.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(source[i:j]))
            i = j
        elif c in "\"rb'":
            preceded_by_word = i > 0 and (source[i - 1].isalnum() or source[i - 1] == "_")
            match = None if preceded_by_word else (
                RUST_STRING.match(source, i) or CHAR_LITERAL.match(source, i)
            )
            if match:
                out.append(blank(match.group(0)))
                i = match.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def use_tree_paths(tree: str) -> List[List[str]]:
    """`crate::{a::X, b::{Y, self}}` as [[crate, a, X], [crate, b, Y], [crate, b]]."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))
    paths: List[List[str]] = []

    def walk(prefix: List[str], text: str) -> None:
        if "{" not in text:
            segments = [s for s in text.split("::") if s and s != "*"]
            if segments == ["self"]:
                paths.append(prefix)
            else:
                paths.append(prefix + segments)
            return
        head, _, rest = text.partition("{")
        inner = rest[: rest.rfind("}")]
        head_segments = [s for s in head.split("::") if s]
        depth, start = 0, 0
        for k, ch in enumerate(inner + ","):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                part = inner[start:k]
                if part:
                    walk(prefix + head_segments, part)
                start = k + 1

    walk([], tree)
    return paths


@dataclass
class RustModule:
    path: ModPath
    file: Path
    # Where `mod x;` inside this module looks for x's file.
    child_dir: Path


class RustCrate:
    """One crate's modules (found from its root file by `mod` declarations) and their edges."""

    def __init__(self, root_file: Path, repo: Path) -> None:
        self.repo = repo
        self.root_file = root_file
        self.modules: Dict[ModPath, RustModule] = {}
        self.edges: List[Edge] = []
        self._load(root_file, (), root_file.parent)

    def _load(self, file: Path, path: ModPath, child_dir: Path) -> None:
        self.modules[path] = RustModule(path, file, child_dir)
        source = file.read_text(encoding="utf-8", errors="replace")
        raw_lines = source.splitlines()
        text = strip_rust(source)
        # Inline modules open at a brace depth and close with it: (depth, module path, dir);
        # a test module's path is None: test code may reach anywhere, and is no edge.
        scopes: List[Tuple[int, Optional[ModPath], Path]] = [(0, path, child_dir)]
        depth = 0
        pending_files: List[Tuple[Path, ModPath, Path]] = []
        for match in TOKEN.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            here, here_dir = scopes[-1][1], scopes[-1][2]
            if match.group("open"):
                depth += 1
            elif match.group("close"):
                depth -= 1
                if len(scopes) > 1 and depth < scopes[-1][0]:
                    scopes.pop()
            elif match.group("test_use"):
                pass
            elif match.group("test_mod"):
                # `#[cfg(test)] mod x;` is not loaded; an inline one is walked for its braces.
                if match.group("test_end") == "{":
                    depth += 1
                    scopes.append((depth, None, here_dir))
            elif here is None:
                if match.group("mod") and match.group("end") == "{":
                    depth += 1
                    scopes.append((depth, None, here_dir))
            elif match.group("mod"):
                name = match.group("name").removeprefix("r#")
                child = here + (name,)
                if match.group("end") == "{":
                    depth += 1
                    self.modules.setdefault(child, RustModule(child, file, here_dir / name))
                    scopes.append((depth, child, here_dir / name))
                else:
                    as_file = here_dir / f"{name}.rs"
                    as_folder = here_dir / name / "mod.rs"
                    for found in (as_file, as_folder):
                        if found.exists():
                            pending_files.append((found, child, here_dir / name))
                            break
            else:
                snippet = raw_lines[line - 1].strip() if line <= len(raw_lines) else ""
                if match.group("use"):
                    # A grouped `use`'s braces are balanced: scopes are not disturbed.
                    segment_lists = use_tree_paths(match.group("tree"))
                else:
                    segment_lists = [re.split(r"\s*::\s*", match.group("path").lstrip("$"))]
                for segments in segment_lists:
                    target = self._resolve(here, segments)
                    if target is not None:
                        self.edges.append(Edge(here, target, file, line, snippet))
        for found, child, directory in pending_files:
            self._load(found, child, directory)

    def _resolve(self, here: ModPath, segments: List[str]) -> Optional[ModPath]:
        """The deepest module a path names, when it starts at `crate`, `super` or `self`."""
        if not segments or segments[0] not in ("crate", "super", "self"):
            return None
        base: ModPath = here
        rest = list(segments)
        while rest and rest[0] in ("crate", "super", "self"):
            head = rest.pop(0)
            if head == "crate":
                base = ()
            elif head == "super":
                base = base[:-1]
        for segment in rest:
            if base + (segment,) in self.modules or self._declared(base, segment):
                base = base + (segment,)
            else:
                break
        return base

    def _declared(self, base: ModPath, name: str) -> bool:
        """Whether `base` has a child module `name` not loaded yet (a file `mod` declared later)."""
        module = self.modules.get(base)
        if module is None:
            return False
        return (module.child_dir / f"{name}.rs").exists() or (
            module.child_dir / name / "mod.rs"
        ).exists()

    def show(self, path: ModPath) -> str:
        module = self.modules.get(path)
        where = module.file.relative_to(self.repo) if module else "?"
        return f"{'::'.join(('crate',) + path)} ({where})"


def rust_crate_roots(repo: Path) -> List[Path]:
    """The root files of every crate in the repository: lib.rs and main.rs, and each binary."""
    roots = []
    for manifest in sorted(repo.glob("**/Cargo.toml")):
        folders = manifest.relative_to(repo).parts[:-1]
        if any(part == "target" or part.startswith(".") for part in folders):
            continue
        crate_dir = manifest.parent
        for candidate in ("src/lib.rs", "src/main.rs", "lib.rs", "main.rs"):
            if (crate_dir / candidate).exists():
                roots.append(crate_dir / candidate)
        roots.extend(sorted((crate_dir / "src" / "bin").glob("*.rs")))
    return roots


def check_rust(repo: Path) -> List[Tuple[CircleKey, str]]:
    reports = []
    for root in rust_crate_roots(repo):
        crate = RustCrate(root, repo)
        edges = [
            Edge(e.source, e.target, e.file.relative_to(repo), e.line, e.text) for e in crate.edges
        ]
        where = str(root.relative_to(repo))
        reports.extend(circles_among_children(edges, crate.modules.keys(), crate.show, where, "::"))
    return reports


# ---------------------------------------------------------------------------------------------
# Python: the modules of python/kvx and the imports between them.

PYTHON_PACKAGE = ("python", "kvx")


def python_modules(repo: Path) -> Dict[ModPath, Path]:
    package_dir = repo.joinpath(*PYTHON_PACKAGE)
    modules: Dict[ModPath, Path] = {}
    if not package_dir.is_dir():
        return modules
    top = PYTHON_PACKAGE[-1]
    for file in sorted(package_dir.rglob("*.py")):
        parts = file.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[(top,) + parts] = file
    return modules


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST) -> Iterable[ast.stmt]:
    """Every import statement that runs, at any depth, but none under `if TYPE_CHECKING:`."""
    pending: List[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))


def check_python(repo: Path) -> List[Tuple[CircleKey, str]]:
    modules = python_modules(repo)
    edges: List[Edge] = []

    def deepest(dotted: Sequence[str]) -> Optional[ModPath]:
        for k in range(len(dotted), 0, -1):
            if tuple(dotted[:k]) in modules:
                return tuple(dotted[:k])
        return None

    for module, file in modules.items():
        is_package = file.name == "__init__.py"
        package = module if is_package else module[:-1]
        source = file.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in runtime_imports(ast.parse(source, str(file))):
            targets: List[Sequence[str]] = []
            if isinstance(node, ast.Import):
                targets = [alias.name.split(".") for alias in node.names]
            else:
                if node.level:
                    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                else:
                    base = ()
                stem = list(base) + (node.module.split(".") if node.module else [])
                # `from a import b`: b is a module of a when a file says so, else a name in a.
                targets = [stem + [alias.name] for alias in node.names]
            for dotted in targets:
                target = deepest(dotted)
                if target is not None:
                    text = lines[node.lineno - 1].strip()
                    edges.append(Edge(module, target, file.relative_to(repo), node.lineno, text))

    def show(path: ModPath) -> str:
        file = modules.get(path)
        return f"{'.'.join(path)} ({file.relative_to(repo) if file else '?'})"

    where = "/".join(PYTHON_PACKAGE)
    return circles_among_children(edges, modules.keys(), show, where, ".")


# ---------------------------------------------------------------------------------------------
# Docs: the repo paths they name.

PATH_EXTENSIONS = (".rs", ".py", ".pyi", ".md", ".sh", ".toml", ".json", ".yml", ".yaml", ".txt")
BACKTICKED = re.compile(r"`([^`\n]+)`")
LINKED = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def top_level_entries(repo: Path) -> Set[str]:
    return {p.name for p in repo.iterdir() if p.name not in (".git", "target")}


def expand_braces(text: str) -> List[str]:
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        return [text]
    out = []
    for choice in match.group(1).split(","):
        out.extend(expand_braces(text[: match.start()] + choice + text[match.end():]))
    return out


def clean_candidate(token: str) -> str:
    token = token.strip().strip("'\"")
    token = token.rstrip(".,;:)")
    token = token.lstrip("(")
    token = token.split("#", 1)[0]
    # `path:12`, `path:12-30`, `path:12:4`, `path::item` name the path.
    token = re.sub(r"::.*$", "", token)
    token = re.sub(r":[0-9][0-9,\-–:]*$", "", token)
    return token


def looks_like_repo_path(token: str, tops: Set[str], strict: bool) -> bool:
    if "/" not in token or "://" in token or token.startswith(("/", "~", "-", "$")):
        return False
    if any(ch in token for ch in "<>$=@|\\"):
        return False
    first = token.split("/", 1)[0]
    if first in tops:
        return True
    return not strict and token.rstrip("/").endswith(PATH_EXTENSIONS)


def path_exists(repo: Path, base: Path, token: str, all_files: List[str]) -> bool:
    """Whether `token` names something: from `base` (the repo, or a link's folder), or, for a
    path that does not start at a top-level entry, as the tail of some file's path."""
    for variant in expand_braces(token):
        pattern = variant.replace("…", "*").replace("...", "*").rstrip("/")
        pattern = re.sub(r"\*+", "*", pattern)
        if "*" in pattern:
            relative_base = os.path.relpath(base, repo)
            full = os.path.normpath(os.path.join(relative_base, pattern))
            globbed = full.replace("*/", "**/") if "*/" in full else full
            patterns = {full, globbed}
            if not (repo / full.split("/", 1)[0]).exists():
                # Not from a top-level entry (`kvx-io/tests/*.rs`): the tail of some path.
                patterns |= {"*/" + full, "*/" + globbed}
            names = all_files + sorted(directories_of(all_files))
            if any(fnmatch.fnmatch(name, p) for name in names for p in patterns):
                return True
            continue
        if (base / pattern).exists():
            return True
        if not (repo / pattern.split("/", 1)[0]).exists():
            if any(f == pattern or f.endswith("/" + pattern) for f in all_files):
                return True
            if any(d.endswith("/" + pattern) for d in directories_of(all_files)):
                return True
    return False


_DIRECTORY_CACHE: Dict[int, Set[str]] = {}


def directories_of(files: List[str]) -> Set[str]:
    key = id(files)
    if key not in _DIRECTORY_CACHE:
        dirs: Set[str] = set()
        for f in files:
            parts = f.split("/")[:-1]
            for k in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:k]))
        _DIRECTORY_CACHE[key] = dirs
    return _DIRECTORY_CACHE[key]


def repo_files(repo: Path) -> List[str]:
    files = []
    for directory, subdirs, names in os.walk(repo):
        subdirs[:] = [d for d in subdirs if d not in (".git", "target", "__pycache__")]
        rel = os.path.relpath(directory, repo)
        for name in names:
            files.append(name if rel == "." else f"{rel}/{name}")
    return files


def doc_files(repo: Path) -> List[Path]:
    docs = [repo / "README.md"] if (repo / "README.md").exists() else []
    return docs + sorted((repo / "docs").rglob("*.md")) if (repo / "docs").is_dir() else docs


def check_docs(repo: Path) -> List[str]:
    tops = top_level_entries(repo)
    files = repo_files(repo)
    reports = []
    for doc in doc_files(repo):
        in_fence = False
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if FENCE.match(line):
                in_fence = not in_fence
                continue
            # (candidate, whether it is a link, whether only top-level entries count): a link
            # is relative to its doc's folder; a backticked path, to the repository.
            candidates: List[Tuple[str, bool, bool]] = []
            if in_fence:
                candidates += [(t, False, True) for t in line.split()]
            else:
                for span in BACKTICKED.findall(line):
                    candidates += [(t, False, False) for t in span.split()]
                for target in LINKED.findall(line):
                    candidates.append((target, True, False))
            for raw, is_link, strict in candidates:
                if is_link:
                    if "://" in raw or raw.startswith(("mailto:", "#")):
                        continue
                    token = raw.split("#", 1)[0]
                    if not token:
                        continue
                    folder = os.path.relpath(doc.parent, repo)
                    resolved = os.path.normpath(os.path.join(folder, token))
                    if resolved.startswith(".."):
                        continue
                    if not path_exists(repo, repo, resolved, files):
                        where = f"{doc.relative_to(repo)}:{number}"
                        reports.append(f"{where}: no such path: {raw} (link)")
                    continue
                token = clean_candidate(raw)
                if not token or token.startswith("../"):
                    continue  # `../shared/…`: beside the repository, not in it
                if not looks_like_repo_path(token, tops, strict):
                    continue
                if not path_exists(repo, repo, token, files):
                    reports.append(f"{doc.relative_to(repo)}:{number}: no such path: {token}")
    return reports


# ---------------------------------------------------------------------------------------------


def run_checks(
    repo: Path, known: Dict[CircleKey, str], notes: Optional[List[str]] = None
) -> Dict[str, List[str]]:
    """Every finding that fails, by check; circles in `known` go to `notes` instead."""
    circles = {"Rust module circles": check_rust(repo), "Python module circles": check_python(repo)}
    findings: Dict[str, List[str]] = {}
    found_keys = set()
    for check, reports in circles.items():
        findings[check] = []
        for key, report in reports:
            found_keys.add(key)
            if key in known:
                if notes is not None:
                    notes.append(f"known, to break ({known[key]}):\n  {report}")
            else:
                findings[check].append(report)
    findings["Rust module circles"] += [
        f"listed in KNOWN_CIRCLES but no longer a circle (remove it): {key}"
        for key in sorted(known)
        if key not in found_keys
    ]
    findings["doc paths that do not exist"] = check_docs(repo)
    return findings


def self_test() -> int:
    """Builds small trees with a circle or a missing path and asserts that each is reported,
    and that the same trees without them pass: each check can fail, and does not cry wolf."""
    files_ok = {
        "Cargo.toml": "[package]\nname = \"demo\"\n",
        "src/lib.rs": "//! demo\nmod a;\nmod b;\nmod c;\npub use a::A;\n",
        "src/a.rs": "use crate::b::B;\npub struct A(pub B);\n",
        "src/b.rs": "pub struct B;\n// use crate::a::A;  (a comment is no edge)\n"
        "const S: &str = \"crate::a::A\";\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\n"
        "#[cfg(test)]\nuse crate::a::A as _;\n",
        "src/c/mod.rs": "mod x;\nmod y;\npub struct Face;\n",
        "src/c/x.rs": "use super::y::Y;\npub struct X(Y, super::Face);\n",
        "src/c/y.rs": "pub struct Y;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        "python/kvx/__init__.py": "from . import p\n",
        "python/kvx/p/__init__.py": "from .x import X\n",
        "python/kvx/p/x.py": "from typing import TYPE_CHECKING\nfrom .y import Y\nclass X: pass\n",
        "python/kvx/p/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from .x import X\nclass Y: pass\n",
        "scripts/run.sh": "#!/bin/sh\n",
        "README.md": "Run `scripts/run.sh`, see [the code](src/a.rs) and `src/c/x.rs:2`,\n"
        "`../shared/golden/x.bin`, `src/c/…` and `python/kvx/p/x.py#L1`.\n",
        "docs/guide.md": "Back to [the readme](../README.md); `crates/…` is not here, "
        "but `c/y.rs` is.\n",
    }
    broken = {
        "rust": ("src/b.rs", "pub struct B;\nfn f() -> crate::a::A { todo!() }\n"),
        "rust-folder": ("src/c/y.rs", "pub struct Y;\npub fn f(_: &super::x::X) {}\n"),
        "python": ("python/kvx/p/y.py", "class Y: pass\ndef f():\n    from .x import X\n"),
        "python-package": ("python/kvx/p/y.py", "import kvx.p.x\nclass Y: pass\n"),
        "docs": ("docs/guide.md", "See `scripts/gone.sh:12` and [this](missing.md).\n"),
    }
    expect = {
        "rust": ("Rust module circles", "src/b.rs:2"),
        "rust-folder": ("Rust module circles", "src/c/y.rs:2"),
        "python": ("Python module circles", "python/kvx/p/y.py:3"),
        "python-package": ("Python module circles", "python/kvx/p/y.py:1"),
        "docs": ("doc paths that do not exist", "scripts/gone.sh"),
    }

    def build(directory: Path, files: Dict[str, str]) -> None:
        for name, content in files.items():
            path = directory / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")

    failures = []
    with tempfile.TemporaryDirectory() as scratch:
        clean = Path(scratch) / "clean"
        build(clean, files_ok)
        findings = run_checks(clean, {})
        if any(findings.values()):
            failures.append(f"the clean tree is reported: {findings}")
        for case, (name, content) in broken.items():
            tree = Path(scratch) / case
            build(tree, {**files_ok, name: content})
            check, needle = expect[case]
            findings = run_checks(tree, {})
            reported = "\n".join(findings[check])
            if needle not in reported:
                failures.append(f"{case}: {check} does not report {needle}: {findings}")
            others = {k: v for k, v in findings.items() if k != check and v}
            if others:
                failures.append(f"{case}: other checks report too: {others}")
        # A listed circle passes, and a listed circle that is gone fails.
        listed = {("src/lib.rs", "", ("a", "b")): "the test's own"}
        if run_checks(Path(scratch) / "rust", listed)["Rust module circles"]:
            failures.append("rust: a listed circle fails the check")
        if not run_checks(clean, listed)["Rust module circles"]:
            failures.append("clean: a listed circle that is gone passes the check")
        if "docs" in broken:
            docs_findings = run_checks(Path(scratch) / "docs", {})["doc paths that do not exist"]
            reported = "\n".join(docs_findings)
            if "missing.md" not in reported:
                failures.append(f"docs: the broken link is not reported: {reported}")
    for failure in failures:
        print(f"self-test: {failure}", file=sys.stderr)
    print("self-test: " + ("FAILED" if failures else f"ok ({len(broken)} broken trees caught)"))
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--self-test", action="store_true", help="show that each check can fail")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    failed = False
    notes: List[str] = []
    for check, findings in run_checks(args.root.resolve(), KNOWN_CIRCLES, notes).items():
        if findings:
            failed = True
            print(f"{check}:")
            for finding in findings:
                print("  " + finding.replace("\n", "\n  "))
        else:
            print(f"{check}: none")
    for note in notes:
        print(note)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
