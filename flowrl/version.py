"""The version of flowrl (pyproject.toml's ``version``): :data:`flowrl.__version__`, and what a layer below the package
facade reads (the model card's install line)."""

__version__ = "0.1.0"
