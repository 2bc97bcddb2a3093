"""``/docs``: Swagger UI over ``/openapi.json``, served from the installed ``swagger-ui-bundle-v2`` package.

FastAPI's own ``/docs`` page loads Swagger UI's script and stylesheet from a CDN, so on a machine without internet
access it is a blank page. The ``ui`` extra installs the bundle and the page takes its files from this server
(``/docs/assets/...``); without the package the CDN page of FastAPI is served as before.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

logger = logging.getLogger("lightinfer")

ASSETS = "/docs/assets"


def add_swagger_ui(app: FastAPI, title: str, openapi_url: str = "/openapi.json") -> bool:
    """Serve Swagger UI at ``/docs`` from local files; returns False (nothing added) when the bundle is not
    installed, in which case the caller keeps FastAPI's CDN page (``docs_url="/docs"``).

    Routes added: ``GET /docs`` (the page) and ``/docs/assets/*`` (``swagger-ui-bundle.js``, ``swagger-ui.css``,
    the favicons) from ``swagger_ui_bundle.swagger_ui_path``.
    """
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        logger.debug("swagger-ui-bundle-v2 is not installed: /docs loads Swagger UI from its CDN")
        return False
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{title} - Swagger UI",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")

    return True
