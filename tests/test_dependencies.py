"""Every third-party import is declared in pyproject.toml, and a missing optional package is one error line.

The scan is static (the source's import statements and `pytest.importorskip` calls), so an undeclared
import fails here on any machine, even one where the package happens to be installed by hand."""

import ast
import functools
import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

import pytest

from conftest import ROOT
from maxtrain import cli

SCANNED = ("maxtrain", "kernels", "tests", "bench", "examples")
# Imported by code that runs in another interpreter, never in maxtrain's environment.
ELSEWHERE = {"maxtext": "bench/vs_maxtext.py runs it in MaxText's own Python 3.12 venv (MAXTEXT_PYTHON)"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])


def _declared() -> dict[str, set[str]]:
    """Distribution name -> the places that declare it ('dependencies' or the extra's name)."""
    project = tomllib.loads((pathlib.Path(ROOT) / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project.get("optional-dependencies", {})}
    declared: dict[str, set[str]] = {}
    for group, reqs in groups.items():
        for req in reqs:
            declared.setdefault(_requirement_name(req), set()).add(group)
    return declared


def _imports(tree: ast.AST) -> set[str]:
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("importorskip", "import_module", "require_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            mods.add(node.args[0].value.split(".")[0])
    return mods


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level module -> the files importing it, for every module outside the standard library and the project."""
    root = pathlib.Path(ROOT)
    own = ({"maxtrain", "kernels", "conftest"} | {p.stem for d in SCANNED for p in (root / d).glob("*.py")}
           | {p.parent.name for d in SCANNED for p in (root / d).glob("*/__init__.py")})  # tests/toy_family
    found: dict[str, list[str]] = {}
    for d in SCANNED:
        for path in sorted((root / d).rglob("*.py")):
            for mod in _imports(ast.parse(path.read_text(), str(path))):
                if mod not in sys.stdlib_module_names and mod not in own:
                    found.setdefault(mod, []).append(str(path.relative_to(root)))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    return md.packages_distributions()


def _distributions(module: str) -> set[str]:
    """The distributions that provide `module` here; by its own name when it is not installed here."""
    return {_norm(d) for d in _installed().get(module, [])} or {_norm(module)}


def test_every_third_party_import_is_declared():
    declared, imports = _declared(), _third_party_imports()
    assert {"jax", "numpy", "pytest", "tokenizers", "pyarrow", "sentencepiece"} <= set(imports)  # the scan sees them
    undeclared = [f"{mod} (package {' or '.join(sorted(_distributions(mod)))}; imported in {', '.join(files[:3])})"
                  for mod, files in sorted(imports.items())
                  if mod not in ELSEWHERE and not _distributions(mod) & set(declared)]
    assert not undeclared, ("imported but not declared in pyproject.toml's dependencies or extras (a fresh "
                            "install lacks them): " + "; ".join(undeclared))


def test_the_test_extra_brings_everything_the_suite_and_prepare_import():
    """`pip install -e ".[test]"` (the README's command) installs the data, eval and hf extras and
    everything tests/ imports; the hf extra (docs: loading an export in transformers) holds
    transformers, torch and the tokenizer packages."""
    declared = _declared()
    test_extra = {"dependencies", "test", "data", "eval", "hf", "ray"}
    project = tomllib.loads((pathlib.Path(ROOT) / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {"maxtrain[data]", "maxtrain[eval]", "maxtrain[hf]", "maxtrain[ray]"} <= set(extras["test"])
    assert {"transformers", "torch", "maxtrain[data]"} <= {_requirement_name(r) if "[" not in r else r
                                                           for r in extras["hf"]}
    imports = _third_party_imports()
    needed = {mod for mod, files in imports.items() if any(f.startswith(("tests/", "maxtrain/data/")) for f in files)}
    missing = [mod for mod in sorted(needed)
               if not any(declared.get(d, set()) & test_extra for d in _distributions(mod))]
    assert not missing, f"tests/ or maxtrain/data/ import {missing}, which `.[test]` does not install"


def _prepare(tmp_path, *args):
    return cli.main(["prepare", "--output", str(tmp_path / "out"), "--workers", "1", *args])


@pytest.mark.parametrize("hidden,kind,package,extra", [
    (("pyarrow", "pyarrow.parquet"), "parquet", "pyarrow", "data"),
    (("sentencepiece",), "sentencepiece", "sentencepiece", "data"),
    (("tokenizers",), "tokenizer.json", "tokenizers", "data"),
    (("tokenizers",), "train", "tokenizers", "data"),
    (("ray",), "--engine ray", "ray", "ray"),
])
def test_missing_optional_package_is_one_error_line(tmp_path, monkeypatch, capsys, hidden, kind, package, extra):
    (tmp_path / "in.txt").write_text("some text\n")
    args = ["--input", str(tmp_path / "in.txt")]
    if kind == "parquet":
        args = ["--input", str(tmp_path / "in.parquet")]
        (tmp_path / "in.parquet").write_bytes(b"PAR1 not really")
    elif kind == "sentencepiece":
        (tmp_path / "tok.model").write_bytes(b"\0")
        args += ["--tokenizer", str(tmp_path / "tok.model")]
    elif kind == "tokenizer.json":
        (tmp_path / "tokenizer.json").write_text("{}")
        args += ["--tokenizer", str(tmp_path / "tokenizer.json")]
    elif kind == "--engine ray":
        args += ["--engine", "ray"]
    else:
        args += ["--train-tokenizer", "300"]
    for mod in hidden:
        monkeypatch.setitem(sys.modules, mod, None)  # `import mod` raises ImportError
    assert _prepare(tmp_path, *args) == cli.USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxtrain: error: "), err
    assert f"needs the {package} package" in err[0] and f"pip install 'maxtrain[{extra}]'" in err[0], err[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial-*"))


# ---------------------------------------------------------------- the checkout's root on sys.path


def test_python_in_the_checkouts_root_imports_transformers_and_maxtrain_together():
    """Python started in the checkout (`python -c`, a script or notebook there) has the root first on
    sys.path, where the top-level kernels/ directory (maxtrain.kernels) would shadow Hugging Face's
    `kernels` package, which transformers imports: it must give way to the installed one."""
    import subprocess

    code = ("from transformers import LlamaConfig; import kernels; import maxtrain.kernels as mk; "
            "print(kernels.__spec__.origin); print(mk.__spec__.origin); print(mk.flash_attention.__module__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    hf, ours, flash = r.stdout.split()
    assert not hf.startswith(str(pathlib.Path(ROOT) / "kernels")), hf  # Hugging Face's package
    assert ours == str(pathlib.Path(ROOT) / "kernels" / "__init__.py") and flash == "maxtrain.kernels.flash"


def test_no_test_edits_sys_path():
    """The suite imports maxtrain as installed; a test that edits sys.path hides what a user meets."""
    edits = re.compile(r"sys\.path\s*(\[.*\]\s*=|\.(insert|append|extend|remove|pop)\()")
    found = [f"{p.name}:{i}" for p in sorted((pathlib.Path(ROOT) / "tests").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if edits.search(line)]
    assert not found, found
