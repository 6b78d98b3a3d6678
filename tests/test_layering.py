"""The layer order of `maxtrain/` and `kernels/` (docs/architecture.md, "Layers"): no import circle, no
import from a lower layer up to a higher one, every module placed in exactly one layer.

The scan is static (ast, nothing imported) and counts every way one module can load another:
`import`/`from ... import` anywhere in the file (module level, inside functions and classes, under
`if TYPE_CHECKING:`), relative imports resolved, a string literal handed to `importlib.import_module`,
`__import__`, `imports.quietly` or `config.require_module`, and the names a lazy module `__getattr__`
hands out (read from the module-level `{name: module}` table it looks names up in). A package's
`__init__.py` is the package's node; `from P import x` is an import of `P.x` when that is a module,
else of `P`. Importing `a.b.c` is not counted as importing `a` and `a.b` too (Python runs their
`__init__` first, but a package that imports its own modules would otherwise be a circle with each).

LAYERS below is the order; the doc's table must list the same layers with the same modules (this file
is the source of truth, the doc its explanation: the failure prints the row to write). Planned
modules (`maxtrain.step`, `maxtrain.run.*`, ...) are rows already, so the new code lands placed.
KNOWN_VIOLATIONS holds today's circles and upward imports, each with its reason; the tests fail on
any violation not in it and on any entry of it that no longer occurs, so the list only shrinks.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import re

from conftest import ROOT

# Bottom to top. A pattern is a module (`maxtrain.config`) or a package with everything under it
# (`maxtrain.models.*`); a module takes its layer from its longest matching pattern.
LAYERS = (
    ("leaves", ("maxtrain.exit_codes", "maxtrain.errors", "maxtrain.imports", "maxtrain.storage", "maxtrain.devices",
                "maxtrain.targets", "maxtrain.parallel.schedules", "maxtrain.checkpoint.meta")),
    ("kernels", ("maxtrain.kernels.*",)),
    ("config", ("maxtrain.config", "maxtrain.outputs")),
    ("mesh", ("maxtrain.mesh", "maxtrain.sharding", "maxtrain.distributed", "maxtrain.launcher")),
    ("layers", ("maxtrain.layers.*", "maxtrain.parallel.*", "maxtrain.models.specs", "maxtrain.loss",
                "maxtrain.optim")),
    ("models", ("maxtrain.models.*",)),
    ("data", ("maxtrain.data.*",)),
    ("reliability", ("maxtrain.reliability.*",)),
    ("step", ("maxtrain.step",)),
    ("checkpoint", ("maxtrain.checkpoint.*",)),
    ("decode", ("maxtrain.generate",)),
    ("run", ("maxtrain.run.*", "maxtrain.loop", "maxtrain.rundir", "maxtrain.metrics")),
    ("tools", ("maxtrain.analysis.*", "maxtrain.harness", "maxtrain.convert", "maxtrain.models.hf_llama")),
    ("entry", ("maxtrain.cli", "maxtrain")),
)

# Today's violations, each with what it is and what removing it needs. An upward import is
# "importer -> imported"; a circle is "circle: " and its modules, sorted (it still occurs while those
# modules share one strongly connected component, which may have grown).
KNOWN_VIOLATIONS: dict[str, str] = {}

PROJECT = pathlib.Path(ROOT)
LAZY_IMPORTERS = ("import_module", "__import__", "quietly", "require_module")  # first argument: a module name


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: str
    line: int  # 0: through the importer's lazy `__getattr__`

    def __str__(self):
        return f"{self.importer} -> {self.imported} ({self.path}:{self.line or ' __getattr__'})"


def module_name(path: pathlib.Path, root: pathlib.Path = PROJECT) -> str:
    """The dotted name a file imports as: `kernels/` is installed as `maxtrain.kernels`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "kernels":
        parts.insert(0, "maxtrain")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files(root: pathlib.Path = PROJECT) -> dict[str, pathlib.Path]:
    """Module name -> file, for every module of maxtrain/ and kernels/."""
    return {module_name(p, root): p for d in ("maxtrain", "kernels") for p in sorted((root / d).rglob("*.py"))}


def owner(name: str, modules) -> str | None:
    """The module `name` (a module or a module's attribute) lives in: its longest known prefix."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module of a `from ... import`, relative levels resolved against the importer."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")[: None if is_package else -1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def lazy_table(tree: ast.Module, modules) -> dict[str, str]:
    """Name -> module of a module whose `__getattr__` imports on first use: the module-level dicts of
    name -> module (or module suffix, completed by an f-string prefix the module formats with)."""
    prefixes = {""} | {v.values[0].value for v in ast.walk(tree) if isinstance(v, ast.JoinedStr)
                       and v.values and isinstance(v.values[0], ast.Constant)}
    table = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str):
                    for p in prefixes:
                        if p + v.value in modules:
                            table[k.value] = p + v.value
    return table


def has_lazy_getattr(tree: ast.Module) -> bool:
    """A module-level `__getattr__`, or one on the class the module makes itself an instance of."""
    def getattr_in(body):
        return any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in body)

    sets_class = any(isinstance(t, ast.Attribute) and t.attr == "__class__"
                     for n in tree.body if isinstance(n, ast.Assign) for t in n.targets)
    return getattr_in(tree.body) or sets_class and any(getattr_in(c.body) for c in tree.body
                                                        if isinstance(c, ast.ClassDef))


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def named_imports(tree: ast.Module, importer: str, is_package: bool) -> list[tuple[str, str | None, int]]:
    """(module, name imported from it or None, line) for every import in the file, wherever it is."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, importer, is_package)
            out += [(base, a.name, node.lineno) for a in node.names]
        elif (isinstance(node, ast.Call) and _call_name(node) in LAZY_IMPORTERS and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, None, node.lineno))
    return out


@dataclasses.dataclass(frozen=True)
class Graph:
    modules: frozenset[str]
    imports: tuple[Import, ...]
    unreadable_lazy: tuple[str, ...]  # modules with a __getattr__ whose table this scan cannot read

    @functools.cached_property
    def edges(self) -> dict[str, set[str]]:
        out = {m: set() for m in self.modules}
        for i in self.imports:
            out[i.importer].add(i.imported)
        return out


def targets(module: str, name: str | None, modules, lazy: dict[str, dict[str, str]]) -> list[str]:
    """The project modules `from module import name` (or `import module`) loads."""
    if name is not None and f"{module}.{name}" in modules:
        return [f"{module}.{name}"]
    found = owner(module, modules)
    if found is None:
        return []
    return [found] + ([lazy[found][name]] if name in lazy.get(found, {}) else [])


def scan(root: pathlib.Path = PROJECT) -> Graph:
    files = project_files(root)
    modules = frozenset(files)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in files.items()}
    lazy = {m: lazy_table(t, modules) for m, t in trees.items() if has_lazy_getattr(t)}
    imports = set()
    for m, tree in trees.items():
        rel = str(files[m].relative_to(root))
        for module, name, line in named_imports(tree, m, files[m].name == "__init__.py"):
            imports |= {Import(m, t, rel, line) for t in targets(module, name, modules, lazy) if t != m}
        imports |= {Import(m, t, rel, 0) for t in lazy.get(m, {}).values() if t != m}
    first = {}  # one import line per (importer, imported) pair is enough to name it
    for i in sorted(imports, key=lambda i: (i.importer, i.imported, i.line)):
        first.setdefault((i.importer, i.imported), i)
    return Graph(modules, tuple(first.values()), tuple(sorted(m for m, t in lazy.items() if not t)))


def layer_of(module: str, layers=LAYERS) -> list[str]:
    """The layer(s) of `module`'s longest matching pattern (exactly one when it is placed well)."""
    best, found = -1, []
    for name, patterns in layers:
        for p in patterns:
            hit = module == p or (p.endswith(".*") and (module == p[:-2] or module.startswith(p[:-1])))
            if hit and len(p) > best:
                best, found = len(p), [name]
            elif hit and len(p) == best and name not in found:
                found.append(name)
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def shortest_cycle(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    """A shortest import path from `start` back to itself (breadth first), or None."""
    parent, frontier = {}, [start]
    while frontier and start not in parent:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    if start not in parent:
        return None
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(parent[path[-1]])
    return path[::-1]


def rank(module: str, layers=LAYERS) -> int:
    names = layer_of(module, layers)
    return [name for name, _ in layers].index(names[0]) if len(names) == 1 else 0


def cycles(component: list[str], edges: dict[str, set[str]], layers=LAYERS) -> list[list[str]]:
    """The circles inside one strongly connected component, one by one: the shortest, then again with
    its most upward import taken out (the likeliest culprit), until none is left. One new import
    that joins a big component (everything imports config) still reads as the short circle it made."""
    inside = set(component)
    sub = {v: edges[v] & inside for v in component}
    found = []
    while comps := circles(sub):
        cycle = min((c for v in comps[0] if (c := shortest_cycle(v, sub))), key=lambda c: (len(c), c))
        found.append(cycle)
        a, b = max(zip(cycle, cycle[1:]), key=lambda e: rank(e[1], layers) - rank(e[0], layers))
        sub[a].discard(b)
    return found


def describe_circle(component: list[str], graph: Graph, layers=LAYERS) -> str:
    """Each circle of a component as its path, `a -> b -> a`, then each step's import line."""
    by_pair = {(i.importer, i.imported): i for i in graph.imports}
    return "\n    ".join(" -> ".join(c) + "".join(f"\n      {by_pair[a, b]}" for a, b in zip(c, c[1:]))
                          for c in cycles(component, graph.edges, layers))


def circle_key(component: list[str]) -> str:
    return "circle: " + ", ".join(sorted(component))


def circle_modules(key: str) -> set[str]:
    return set(key.removeprefix("circle: ").split(", "))


def upward(graph: Graph, layers=LAYERS) -> list[Import]:
    """The imports from a module to one in a higher layer."""
    return [i for i in graph.imports if len(layer_of(i.importer, layers)) == len(layer_of(i.imported, layers)) == 1
            and rank(i.imported, layers) > rank(i.importer, layers)]


def violations(graph: Graph, layers=LAYERS) -> dict[str, str]:
    """Key (as in KNOWN_VIOLATIONS) -> what to show: a component's circles or the upward import's line."""
    found = {circle_key(c): describe_circle(c, graph, layers) for c in circles(graph.edges)}
    for i in upward(graph, layers):
        a, b = layer_of(i.importer, layers)[0], layer_of(i.imported, layers)[0]
        found[f"{i.importer} -> {i.imported}"] = f"{i} imports layer {b!r} from layer {a!r}"
    return found


def still_occurs(key: str, found: dict[str, str]) -> bool:
    """A known circle occurs while its modules are still in one component (it may have grown)."""
    if not key.startswith("circle: "):
        return key in found
    return any(k.startswith("circle: ") and circle_modules(key) <= circle_modules(k) for k in found)


def doc_layers(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(layer, patterns) of each row of the table under docs/architecture.md's "## Layers" heading."""
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # less the header and rule
    out = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        out.append((re.sub(r"^\d+\.\s*", "", cells[0]).strip("*` "), tuple(re.findall(r"`([^`]+)`", cells[1]))))
    return out


def doc_row(n: int, name: str, patterns: tuple[str, ...]) -> str:
    return f"| {n}. {name} | {', '.join(f'`{p}`' for p in patterns)} | ... |"


@functools.cache
def project_graph() -> Graph:
    return scan()


def _report(title: str, items) -> str:
    return title + "\n  " + "\n  ".join(items)


def test_no_import_circle():
    found = violations(project_graph())
    new = {k: v for k, v in found.items() if k.startswith("circle: ") and k not in KNOWN_VIOLATIONS}
    assert not new, _report("import circles (break each, or add it to KNOWN_VIOLATIONS with its reason):",
                            [f"{k}\n    {v}" for k, v in sorted(new.items())])


def test_no_import_from_a_lower_layer_up():
    found = violations(project_graph())
    new = {k: v for k, v in found.items() if not k.startswith("circle: ") and k not in KNOWN_VIOLATIONS}
    assert not new, _report("imports up the layers of docs/architecture.md (move the code down, or the "
                            "module up):", sorted(new.values()))


def test_known_violations_still_occur():
    found = violations(project_graph())
    gone = sorted(k for k in KNOWN_VIOLATIONS if not still_occurs(k, found))
    assert not gone, _report("fixed, so remove from KNOWN_VIOLATIONS (the list only shrinks):", gone)


def test_every_module_is_in_exactly_one_layer():
    bad = {m: layer_of(m) for m in sorted(project_graph().modules) if len(layer_of(m)) != 1}
    assert not bad, _report("modules in no layer or in several (add each to LAYERS and docs/architecture.md):",
                            [f"{m}: {found or 'none'}" for m, found in bad.items()])


def test_every_lazy_getattr_is_read():
    assert not project_graph().unreadable_lazy, (
        f"{project_graph().unreadable_lazy}: a module __getattr__ whose imports this scan cannot see; keep its "
        f"names in a module-level {{name: module}} dict (as maxtrain/__init__.py and kernels/__init__.py do)")


def test_the_docs_table_is_the_tests():
    want = [(name, tuple(patterns)) for name, patterns in LAYERS]
    got = doc_layers((PROJECT / "docs" / "architecture.md").read_text())
    assert got == want, _report("docs/architecture.md's layer table differs from LAYERS; its rows should read:",
                                [doc_row(n, name, p) for n, (name, p) in enumerate(LAYERS, 1)])


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def private_imports(root: pathlib.Path) -> list[str]:
    """`from M import _name` (or of a module `_m`) across modules: a private name used outside its module."""
    found = []
    for module, path in project_files(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(("maxtrain", "kernels"))):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                parts = [p for p in (node.module or "").split(".") if p.startswith("_") and not p.startswith("__")]
                if names or parts:
                    found.append(f"{module} imports {', '.join(names + parts)} from {node.module} "
                                 f"({path.relative_to(root)}:{node.lineno})")
    return found


def test_no_module_imports_a_private_name_from_another():
    """What another module uses is public: a leading underscore means its own module alone uses it."""
    found = private_imports(pathlib.Path(ROOT))
    assert not found, "private names imported across modules (make them public):\n  " + "\n  ".join(found)


def test_the_private_import_scan_sees_one(tmp_path):
    (tmp_path / "maxtrain").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "maxtrain" / "a.py").write_text("def _hidden():\n    pass\n")
    (tmp_path / "maxtrain" / "b.py").write_text("def f():\n    from maxtrain.a import _hidden\n")
    assert [x.split(" (")[0] for x in private_imports(tmp_path)] == ["maxtrain.b imports _hidden from maxtrain.a"]


def test_the_scan_counts_every_kind_of_import(tmp_path):
    """Function-level, relative, `import_module` strings and lazy `__getattr__` tables all count; a
    circle is named by its path and an upward import by its line."""
    _write(tmp_path, {
        "maxtrain/__init__.py": "import importlib, sys, types\n_LAZY = {'run': 'maxtrain.top'}\n"
                                "class _P(types.ModuleType):\n    def __getattr__(self, n):\n"
                                "        return importlib.import_module(_LAZY[n])\n"
                                "sys.modules[__name__].__class__ = _P\n",
        "maxtrain/low.py": "def f():\n    from maxtrain.mid import g\n",  # function level
        "maxtrain/mid.py": "import importlib\ng = importlib.import_module('maxtrain.sub.leaf')\n",  # a string
        "maxtrain/sub/__init__.py": "",
        "maxtrain/sub/leaf.py": "from .. import low\nfrom maxtrain.kernels import kern_fn\n",  # relative, lazy
        "maxtrain/top.py": "import maxtrain.low\n",
        "kernels/__init__.py": "import importlib\n_HOME = {'kern_fn': 'kern'}\ndef __getattr__(n):\n"
                               "    return importlib.import_module(f'maxtrain.kernels.{_HOME[n]}')\n",
        "kernels/kern.py": "",
    })
    g = scan(tmp_path)
    assert {(i.importer, i.imported) for i in g.imports} == {
        ("maxtrain", "maxtrain.top"), ("maxtrain.low", "maxtrain.mid"), ("maxtrain.mid", "maxtrain.sub.leaf"),
        ("maxtrain.sub.leaf", "maxtrain.low"), ("maxtrain.sub.leaf", "maxtrain.kernels"),
        ("maxtrain.sub.leaf", "maxtrain.kernels.kern"), ("maxtrain.kernels", "maxtrain.kernels.kern"),
        ("maxtrain.top", "maxtrain.low")}
    layers = (("bottom", ("maxtrain.low", "maxtrain.mid", "maxtrain.sub.*")), ("kernels", ("maxtrain.kernels.*",)),
              ("top", ("maxtrain.top", "maxtrain")))
    found = violations(g, layers)
    assert set(found) == {"circle: maxtrain.low, maxtrain.mid, maxtrain.sub.leaf",
                          "maxtrain.sub.leaf -> maxtrain.kernels", "maxtrain.sub.leaf -> maxtrain.kernels.kern"}
    assert found["circle: maxtrain.low, maxtrain.mid, maxtrain.sub.leaf"].startswith(
        "maxtrain.low -> maxtrain.mid -> maxtrain.sub.leaf -> maxtrain.low\n      maxtrain.low -> maxtrain.mid "
        "(maxtrain/low.py:2)")
    assert still_occurs("circle: maxtrain.low, maxtrain.mid", found)  # a known circle that grew still occurs
    assert layer_of("maxtrain.sub.leaf", layers) == ["bottom"] and layer_of("maxtrain.other", layers) == []


# ---------------------------------------------------------------- one folder per model family

# The shared files a family must not be named in (issue 42): the config, the step, the run, the
# decoder's driver and the converter's entry point. Comments and docstrings may name one (history,
# examples); code may not: a string or an identifier holding a family's name is a dispatch on it.
SHARED_FILES = ("maxtrain/config.py", "maxtrain/step.py", "maxtrain/generate.py", "maxtrain/convert.py",
                "maxtrain/run/*.py")


def family_names() -> list[str]:
    """The folders under maxtrain/models/ that are packages: one per built-in family."""
    return sorted(p.parent.name for p in (PROJECT / "maxtrain" / "models").glob("*/__init__.py"))


def names_in_code(source: str, names: list[str]) -> list[tuple[int, str]]:
    """(line, token) of each string or identifier token, docstrings aside, holding one of `names` as a
    word of its own (`LlamaTokenizer` is a tokenizer's class, not the family)."""
    import io
    import tokenize

    words = re.compile(r"(?<![a-z])(" + "|".join(map(re.escape, names)) + r")(?![a-z])", re.I)
    kinds = {tokenize.STRING, tokenize.NAME, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL)]
    hits = []
    for i, t in enumerate(toks):
        docstring = t.type == tokenize.STRING and (i == 0 or toks[i - 1].type in (
            tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE)) and toks[i + 1].type == tokenize.NEWLINE
        if t.type in kinds and not docstring and words.search(t.string):
            hits.append((t.start[0], t.string))
    return hits


def test_names_in_code_sees_strings_and_names_but_not_docstrings_or_comments():
    src = 'def f(m):\n    """llama docs"""\n    # deepseek comment\n    x = "LlamaTokenizer"\n' \
          '    if m.name == "llama":\n        return deepseek_layer(f"{m}deepseek")\n'
    assert [line for line, _ in names_in_code(src, ["llama", "deepseek"])] == [5, 6, 6]


def test_no_shared_file_names_a_model_family():
    names = family_names()
    assert {"llama", "deepseek"} <= set(names)
    hits = [f"{path.relative_to(PROJECT)}:{line}: {tok}" for pattern in SHARED_FILES
            for path in sorted(PROJECT.glob(pattern)) for line, tok in names_in_code(path.read_text(), names)]
    assert not hits, "shared files dispatch on a model family (move it into the family's folder):\n" + "\n".join(hits)
