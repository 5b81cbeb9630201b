"""Package mapping only; everything else is in pyproject.toml.

The repository keeps the design card's layout (services/, shared/, tui/ at the
top) while every installed import name lives under `llmgw.`: `llmgw` is a
namespace package and each top folder is mapped beneath it, so a wheel never
installs a generic top-level `shared`, `services` or `tui` module. The list is
computed, so a new subpackage cannot be forgotten.
"""

from setuptools import find_packages, setup

ROOTS = ("services", "shared", "tui")

setup(
    packages=[f"llmgw.{p}" for p in find_packages(include=[f"{r}*" for r in ROOTS])],
    package_dir={f"llmgw.{r}": r for r in ROOTS},
)
