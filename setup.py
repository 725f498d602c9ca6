"""Build configuration that pyproject.toml cannot express: the top-level ``recipes/`` and
``data_cards/`` folders go into the wheel as ``mmviews/_resources/recipes`` and
``mmviews/_resources/data_cards``.

The folders stay where the repository keeps them (the top level); ``package_dir`` maps each one
onto a resource package at build time, so there is no second copy in the source tree.
``[tool.setuptools.package-data]`` in pyproject.toml says which of their files are shipped (the
recipes and their README with the expected results, the cards), which keeps the reproduction
scripts and their result folders (``recipes/reproduce/``) out of the wheel.

An editable install (``pip install -e .``) loads ``mmviews`` from the checkout, and
:mod:`mmviews.resources` finds the same folders at the top level of the checkout.
"""

from setuptools import find_packages, setup

# resource package -> folder at the top of the repository
RESOURCES = {
    "mmviews._resources.recipes": "recipes",
    "mmviews._resources.data_cards": "data_cards",
}

setup(
    packages=find_packages(include=["mmviews", "mmviews.*"]) + list(RESOURCES),
    package_dir=RESOURCES,
)
