"""``/ui``: the live dashboard, plain HTML and JavaScript over the JSON and server-sent events of the other routes.

The page itself holds no data, so it is served to anyone; everything it shows comes from routes that need the
caller's API key (typed into the page, kept in the tab's session storage), so a key sees its own jobs only."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

UI = Path(__file__).resolve().parent.parent / "ui"
router = APIRouter(include_in_schema=False)


@router.get("/ui")
async def dashboard() -> FileResponse:
    return FileResponse(UI / "dashboard.html", media_type="text/html")


@router.get("/ui/dashboard.js")
async def dashboard_script() -> FileResponse:
    return FileResponse(UI / "dashboard.js", media_type="text/javascript")
