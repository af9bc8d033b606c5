"""The Gradio API never answers `{"error": null}`.

The app's own errors reach callers as `gr.Error` with their message (web/page/ui.py). Errors Gradio raises itself
before the app runs (too few inputs, a value its components refuse) are shown only with `show_error=True`,
which would also show any exception's text as it is. Off (this app's choice), Gradio answers
`{"error": null}` and the caller learns nothing. Here such an error says what it is in one line, with every
absolute path replaced by `<path>`: a caller learns what was wrong with its request, never where the server keeps
its files.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from neuron_app.errors import one_line

log = logging.getLogger(__name__)
#: An absolute POSIX path (not the path part of a URL: no letter, digit, colon or slash just before it).
_PATH = re.compile(r"(?<![\w:/.])/(?:[^\s/'\"]+/)*[^\s/'\"]*")


def scrubbed(error: BaseException) -> str:
    """`error` as one line, without server paths."""
    return _PATH.sub("<path>", one_line(error, limit=300))


def mend_error_payload() -> bool:
    """Wrap Gradio's `error_payload` where its queue and routes call it (idempotent; process-wide, as Gradio's is)."""
    try:
        from gradio import queueing, routes, utils
    except ImportError:  # pragma: no cover - gradio is a dependency of the web wing
        return False
    original = utils.error_payload
    if getattr(original, "_mended", False):
        return True

    def error_payload(error: BaseException | None, show_error: bool) -> dict[str, Any]:
        content = original(error, show_error)
        if content.get("error") is None:
            content["error"] = scrubbed(error) if error is not None else "the request failed on the server"
        return content

    error_payload._mended = True  # type: ignore[attr-defined]
    utils.error_payload = error_payload  # routes.py calls utils.error_payload
    if getattr(queueing, "error_payload", None) is original:  # queueing.py imported the name itself
        queueing.error_payload = error_payload
    if getattr(routes, "error_payload", None) is original:
        routes.error_payload = error_payload
    return True
