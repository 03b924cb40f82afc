"""OpenAPI pages that render with no internet: Swagger UI and ReDoc from local files.

FastAPI's own /docs loads its JavaScript and CSS from a CDN, so on an internal network (or any
host without internet) the page is blank. The assets come from the `fastapi-offline` wheel
(Swagger UI 5, which renders OpenAPI 3.1 as FastAPI writes it; ReDoc), served from its package
folder; only its static files are used, the pages are FastAPI's own.

Who may read them is OCRQ_API_DOCS: "token" (default) puts them behind the bearer token like
every other path, "public" serves them to anyone (the schema holds no secrets: it is the
contract docs/api.md already publishes), "off" serves none of them.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS = "/docs"
REDOC = "/redoc"
OPENAPI = "/openapi.json"
STATIC = "/docs/static"


def static_folder() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def open_paths(mode: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """Paths (exact, and prefixes) served without the token under this OCRQ_API_DOCS mode."""
    if mode == "public":
        return frozenset({DOCS, REDOC, OPENAPI}), (STATIC + "/",)
    return frozenset(), ()


def mount(app: FastAPI) -> None:
    """Add the pages to an app created with openapi_url=OPENAPI and no docs of its own."""
    app.mount(STATIC, StaticFiles(directory=static_folder()), name="docs-static")

    @app.get(DOCS, include_in_schema=False)
    def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=OPENAPI,
            title=f"{app.title} api",
            swagger_js_url=f"{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC}/favicon.png",
        )

    @app.get(REDOC, include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=OPENAPI,
            title=f"{app.title} api",
            redoc_js_url=f"{STATIC}/redoc.standalone.js",
            redoc_favicon_url=f"{STATIC}/favicon.png",
            with_google_fonts=False,
        )
