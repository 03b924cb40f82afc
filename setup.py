"""Only what pyproject.toml cannot say: the top-level `migrations/` folder ships inside the
wheel as the package data `ocrq/_migrations` (ocrq/core/migrate.py finds it there when
installed, and at the top of the checkout otherwise). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["ocrq*"]), "ocrq._migrations", "ocrq._migrations.versions"],
    package_dir={"ocrq._migrations": "migrations"},
    package_data={
        "ocrq": ["py.typed", "api/viewer_static/*"],
        "ocrq._migrations": ["*.py", "*.mako", "versions/*.py"],
    },
)
