"""The web dashboard: static files shipped in the package (coordinator/ui/static), served at /ui/.

The files need no token and hold no data: the page asks for a token (or reads it from the URL fragment, which
browsers never send), keeps it in sessionStorage and reads everything through the REST API with it. Nothing is
fetched from any other origin; the Content-Security-Policy says so to the browser too, which also keeps an
injected script from reading the token.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from importlib.resources.abc import Traversable

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse

from coordinator.errors import NotFound

router = APIRouter(tags=["ui"], include_in_schema=False)

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".md": "text/plain; charset=utf-8",
    ".LICENSE": "text/plain; charset=utf-8",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    # revalidate every load (ETag), so a coordinator upgrade is never mixed with an old page
    "Cache-Control": "no-cache",
}


def _static() -> Traversable:
    return resources.files("coordinator.ui") / "static"


def _find(name: str) -> Traversable:
    """A file of the dashboard by its relative name; only names of files shipped there (no `..`, no dirs)."""
    node = _static()
    for part in name.split("/"):
        names = {child.name for child in node.iterdir()} if node.is_dir() else set()
        if part in ("", ".", "..") or part not in names:
            raise NotFound(f"the dashboard has no file {name!r}")
        node = node / part
    if not node.is_file():
        raise NotFound(f"the dashboard has no file {name!r}")
    return node


def _serve(name: str, request: Request) -> Response:
    node = _find(name)
    body = node.read_bytes()
    etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'
    headers = {"ETag": etag, **SECURITY_HEADERS}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    return Response(body, media_type=MEDIA_TYPES.get(suffix, "application/octet-stream"), headers=headers)


@router.get("/ui")
def ui_redirect() -> RedirectResponse:
    return RedirectResponse("ui/", status_code=307)  # relative: works behind a reverse proxy's path prefix


@router.get("/ui/")
def ui_index(request: Request) -> Response:
    """The dashboard page (no data in it: it reads the REST API with the token the person gives it)."""
    return _serve("index.html", request)


@router.get("/ui/{name:path}")
def ui_file(name: str, request: Request) -> Response:
    return _serve(name, request)
