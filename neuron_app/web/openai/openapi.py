"""The OpenAPI document of the Images API, served at `/v1/openapi.json`: built from the protocol's models
(web/openai/protocol.py), so a client, a gateway or a code generator reads the requests the server takes and the
answers it sends. It names no setting of this server (its shapes, its model), so it needs no key."""

from __future__ import annotations

import copy
import functools
from typing import Any

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse

from neuron_app.web.openai import protocol as p

REQUESTS = (p.ImageGenerationRequest, p.ImageEditRequest)
ANSWERS = (p.ImagesResponse, p.ImagePartialEvent, p.ImageCompletedEvent, p.ErrorEvent, p.ErrorResponse, p.ImageJob)
ERRORS = {
    "400": "Invalid request: the field is named in error.param",
    "401": "Missing or wrong API key",
    "413": "Body too large",
    "429": "Over the key's limits, or the queue is full (Retry-After)",
    "500": "A failure on the server",
    "501": "Editing is off on this server",
    "503": "Loading or shutting down (Retry-After)",
}


def _ref(model: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _image_operation(summary: str, request: type, media: str, prefix: str) -> dict[str, Any]:
    """generations or edits: the request, and each answer by status and media type."""
    events = {"oneOf": [_ref(p.ImagePartialEvent), _ref(p.ImageCompletedEvent), _ref(p.ErrorEvent)]}
    body: dict[str, Any] = {"schema": _ref(request)}
    if media == "multipart/form-data":
        body["encoding"] = {"image": {"contentType": "image/png, image/jpeg, image/webp"}}
    responses: dict[str, Any] = {
        "200": {
            "description": "The images; with stream=true, server-sent events whose data is one of these "
            f"({prefix}.partial_image, {prefix}.completed, error)",
            "content": _json(p.ImagesResponse) | {"text/event-stream": {"schema": events}},
            "headers": {
                "X-Queue-Position": {"schema": {"type": "integer"}},
                "X-Queue-Eta-Seconds": {"schema": {"type": "number"}},
            },
        },
        "202": {"description": "With Prefer: respond-async, the job", "content": _json(p.ImageJob)},
    }
    responses |= {code: {"description": text, "content": _json(p.ErrorResponse)} for code, text in ERRORS.items()}
    return {
        "summary": summary,
        "operationId": f"create_{prefix}",
        "parameters": [
            {
                "name": "Prefer",
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "respond-async: answer 202 with a job at once",
            }
        ],
        "requestBody": {"required": True, "content": {media: body}},
        "responses": responses,
        "security": [{}, {"bearer": []}],
    }


def _job_operation(summary: str, operation: str) -> dict[str, Any]:
    errors = {code: {"description": ERRORS[code], "content": _json(p.ErrorResponse)} for code in ("401",)}
    return {
        "summary": summary,
        "operationId": operation,
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "The job", "content": _json(p.ImageJob)}}
        | errors
        | {"404": {"description": "No such job (or another key's)", "content": _json(p.ErrorResponse)}},
    }


@functools.cache
def _document() -> dict[str, Any]:
    modes = [(m, "validation") for m in REQUESTS] + [(m, "serialization") for m in ANSWERS]
    _, top = models_json_schema(modes, ref_template="#/components/schemas/{model}")
    jobs = "/v1/images/jobs/{id}"
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "neuron-app Images API",
            "version": "1",
            "description": "OpenAI's Images API (generations, edits) as this server takes and answers it: "
            "every OpenAI field honoured, mapped and echoed, or refused with a 400 naming it (docs/api.md).",
        },
        "paths": {
            "/v1/images/generations": {
                "post": _image_operation(
                    "Make images from a prompt", p.ImageGenerationRequest, "application/json", "image_generation"
                )
            },
            "/v1/images/edits": {
                "post": _image_operation(
                    "Edit images (references, a mask, image-to-image)",
                    p.ImageEditRequest,
                    "multipart/form-data",
                    "image_edit",
                )
            },
            jobs: {
                "get": _job_operation("Read a job", "get_image_job"),
                "delete": _job_operation("Cancel a job", "cancel_image_job"),
            },
        },
        "components": {
            "schemas": top["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def document() -> dict[str, Any]:
    """The document (a copy: callers may change theirs)."""
    return copy.deepcopy(_document())


async def document_route(_request: Request) -> JSONResponse:
    return JSONResponse(_document())
