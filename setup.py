"""Only what pyproject.toml cannot say: the top-level `migrations/` folder ships inside the
wheel as the package data `ocrq/_migrations` (ocrq/core/migrate.py finds it there when
installed, and at the top of the checkout otherwise), and the viewer's static files are named
as a data-only package of their own (as package data of `ocrq`, setuptools printed a page of
"Package would be ignored" warnings at every install). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["ocrq*"]),
        "ocrq.api.viewer_static",
        "ocrq._migrations",
        "ocrq._migrations.versions",
    ],
    package_dir={"ocrq._migrations": "migrations"},
    package_data={
        "ocrq": ["py.typed"],
        "ocrq.api.viewer_static": ["*.html", "*.css", "*.js"],
        "ocrq._migrations": ["*.py", "*.mako", "versions/*.py"],
    },
)
