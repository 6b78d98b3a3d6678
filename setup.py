"""Packaging beyond what pyproject.toml can say: the top-level `kernels/` directory is installed as
the subpackage `maxtrain.kernels` (DESIGN.md keeps kernels beside, not inside, the trainer).

pyproject.toml's `packages.find` cannot add a remapped package to what it finds, so the package
list is computed here: every `maxtrain*` package plus `maxtrain.kernels` -> `kernels/`. Editable
installs (`pip install -e .`) map it through setuptools' import finder; normal installs copy it.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["maxtrain", "maxtrain.*"]) + ["maxtrain.kernels"],
    package_dir={"maxtrain.kernels": "kernels"},
)
