"""The Images API as a protocol (web/openai/protocol.py), driven by the official `openai` Python SDK against the
launched tiny app.

Every field the SDK can send is declared or refused by name (none accepted and ignored); the answers echo `size`,
`quality`, `background` and `output_format`; `quality` sets the steps; `user` reaches the usage book per image;
and the OpenAPI document at `/v1/openapi.json` describes what goes over the wire: the SDK's own requests, captured
by an httpx transport on their way to the server, validate against it (with `jsonschema`), and so do the server's
answers (JSON, server-sent events, errors, a job).
"""

from __future__ import annotations

import email
import email.policy
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from openai.types import image_edit_params, image_generate_params
from PIL import Image

from neuron_app.web.jobs.usage_book import UsageBook
from neuron_app.web.openai.errors import ApiError
from neuron_app.web.openai.protocol import (
    REFUSED,
    ImageEditRequest,
    ImageGenerationRequest,
    parse_json,
    quality_of,
    validated,
)
from tests.support import openai_client, run_cli, tiny_env, wait_for

PROMPT = "a lighthouse at dawn"
SDK_PARAMS = (
    (image_generate_params.ImageGenerateParamsStreaming, ImageGenerationRequest),
    (image_edit_params.ImageEditParamsStreaming, ImageEditRequest),
)


def png(size: tuple[int, int] = (64, 64), colour: tuple[int, int, int] = (20, 120, 220)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


# --- the models, without a server ---------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "model"), SDK_PARAMS, ids=["generations", "edits"])
def test_every_field_the_sdk_sends_is_declared_or_refused_by_name(params: Any, model: Any) -> None:
    """A new field in the SDK fails here until it is honoured, mapped or refused: none is silently ignored."""
    sent = set(params.__required_keys__ | params.__optional_keys__)
    assert not sent - set(model.model_fields) - set(REFUSED), sent - set(model.model_fields)
    for name in sent & set(REFUSED):
        with pytest.raises(ApiError) as caught:
            validated(model, {"prompt": PROMPT, name: "x"})
        assert (caught.value.status, caught.value.param) == (400, name) and name in caught.value.message


def test_quality_is_a_share_of_the_default_steps_and_echoes_the_level_reached() -> None:
    steps = {q: parse_json(json.dumps({"prompt": "p", "quality": q}).encode()).steps(4) for q in ("low", "medium")}
    assert steps == {"low": 2, "medium": 3}
    for q in ("high", "xhigh", "max", "auto", "standard", "hd"):
        assert parse_json(json.dumps({"prompt": "p", "quality": q}).encode()).steps(4) == 4
    assert [quality_of(s, 4) for s in (1, 2, 3, 4, 8)] == ["low", "low", "medium", "high", "high"]
    assert quality_of(1, 1) == "high"  # a model tuned for one step: that step is its best


def test_moderation_low_is_refused_only_where_there_is_something_to_loosen() -> None:
    asked = parse_json(b'{"prompt": "p", "moderation": "low"}')
    assert asked.moderation_used(checks_anything=False) == "low"
    with pytest.raises(ApiError) as caught:
        asked.moderation_used(checks_anything=True)
    assert caught.value.param == "moderation"
    assert parse_json(b'{"prompt": "p"}').moderation_used(checks_anything=True) == "auto"


# --- against the server -------------------------------------------------------------------------------------


class Recording(httpx.BaseTransport):
    """Every request the SDK sends and the answer it got, both read in full, on their way through."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: list[tuple[httpx.Request, httpx.Response]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        response = self.inner.handle_request(request)
        response.read()
        self.seen.append((request, response))
        return response


@pytest.fixture(scope="module")
def api_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny()


@pytest.fixture(scope="module")
def client(api_app: Any) -> OpenAI:
    return openai_client(api_app)


@pytest.fixture(scope="module")
def document(api_app: Any) -> dict[str, Any]:
    reply = httpx.get(api_app.url + "v1/openapi.json", timeout=30)
    assert reply.status_code == 200
    return reply.json()


def check(document: dict[str, Any], schema: dict[str, Any], value: Any) -> None:
    """`value` against a schema of the document (its $refs resolved in the document's components)."""
    jsonschema.Draft202012Validator(schema | {"components": document["components"]}).validate(value)


def form(request: httpx.Request, schema: dict[str, Any]) -> dict[str, Any]:
    """A multipart body as the document's schema reads it: files as (binary) strings, text by the field's type."""
    head = f"Content-Type: {request.headers['content-type']}\r\n\r\n".encode()
    message = email.message_from_bytes(head + request.content, policy=email.policy.HTTP)
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        text = part.get_payload(decode=True).decode("latin-1")
        if part.get_filename() is not None:
            fields[name] = [*fields.get(name, []), text] if name.endswith("[]") or name in fields else text
            continue
        kinds = {s.get("type") for s in schema["properties"][name].get("anyOf", [schema["properties"][name]])}
        fields[name] = int(text) if "integer" in kinds else float(text) if "number" in kinds else text
        fields[name] = text == "true" if "boolean" in kinds else fields[name]
    return fields


def test_the_answer_echoes_what_was_used(client: OpenAI) -> None:
    result = client.images.generate(prompt=PROMPT, size="64x64", quality="low", background="auto",
                                    extra_body={"seed": 1})  # fmt: skip
    assert (result.size, result.quality, result.background, result.output_format) == ("64x64", "low", "opaque", "png")
    assert result.data[0].model_extra["provenance"]["steps"] == 2  # low: half the default 4 steps
    most = client.images.generate(prompt=PROMPT, size="64x64", quality="max", output_format="jpeg")
    assert (most.quality, most.output_format, most.data[0].model_extra["provenance"]["steps"]) == ("high", "jpeg", 4)
    one = client.images.generate(prompt=PROMPT, size="64x64", extra_body={"num_inference_steps": 1})
    assert one.quality == "low" and one.background == "opaque"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"background": "transparent"}, "background", "invalid_value"),
        ({"quality": "low", "extra_body": {"num_inference_steps": 2}}, "quality", "invalid_value"),
        ({"style": "vivid"}, "style", "unsupported_parameter"),
        ({"extra_body": {"num_inference_step": 2}}, "num_inference_step", "unknown_parameter"),
        ({"extra_body": {"input_fidelity": "high"}}, "input_fidelity", "unknown_parameter"),  # edits only
        ({"quality": "ultra"}, "quality", "invalid_value"),
        ({"user": "u" * 257}, "user", "invalid_value"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(
    api_app: Any, client: OpenAI, fields: dict[str, Any], param: str, code: str
) -> None:
    served = api_app.manager.status().stages["device"]["served"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(prompt=PROMPT, size="64x64", **fields)
    assert (caught.value.body["param"], caught.value.body["code"]) == (param, code), caught.value.body
    assert param in caught.value.body["message"]
    if param == "background":
        assert "draws no alpha channel" in caught.value.body["message"]
    assert api_app.manager.status().stages["device"]["served"] == served  # nothing ran


def test_user_reaches_the_usage_book_per_image(api_app: Any, client: OpenAI) -> None:
    client.images.generate(prompt=PROMPT, size="64x64", n=2, user="alice", extra_body={"num_inference_steps": 1})
    client.images.generate(prompt=PROMPT, size="64x64", user="bob", safety_identifier="hashed-bob",
                           extra_body={"num_inference_steps": 1})  # fmt: skip
    stream = client.images.generate(prompt=PROMPT, size="64x64", stream=True, user="carol")
    assert [e.type for e in stream] == ["image_generation.completed"]
    book = UsageBook(api_app.settings.state_folder / "usage.sqlite3")
    try:
        rows = book.images()
    finally:
        book.close()
    users = [r["user"] for r in rows]
    assert users.count("alice") == 2 and users.count("hashed-bob") == 1 and "bob" not in users
    assert users.count("carol") == 1
    alice = next(r for r in rows if r["user"] == "alice")
    assert (alice["key_name"], alice["resolution"], alice["steps"]) == ("-", "64x64", 1)
    assert alice["device_seconds"] > 0
    out = run_cli(tiny_env(Path(api_app.settings.cache_dir)), "usage", "--users", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    per_user = {r["user"]: r for r in json.loads(out.stdout)}
    assert per_user["alice"]["images"] == 2 and per_user["hashed-bob"]["key_name"] == "-"


def test_the_sdks_requests_and_the_answers_validate_against_the_openapi_document(
    api_app: Any, document: dict[str, Any]
) -> None:
    recording = Recording()
    client = OpenAI(base_url=api_app.url + "v1", api_key="unused", max_retries=0,
                    http_client=httpx.Client(transport=recording, timeout=300))  # fmt: skip
    client.images.generate(
        prompt=PROMPT, model="tiny", n=2, size="64x64", quality="medium", background="opaque", moderation="auto",
        output_format="webp", output_compression=80, response_format="b64_json", user="u", safety_identifier="s",
        stream=False, extra_body={"seed": 3},
    )  # fmt: skip
    client.images.generate(prompt=PROMPT, size="auto", response_format="url")
    list(client.images.generate(prompt=PROMPT, size="64x64", stream=True, partial_images=2))
    client.images.edit(
        image=[("a.png", png(), "image/png"), ("b.png", png(colour=(200, 40, 40)), "image/png")], prompt=PROMPT,
        n=1, size="64x64", quality="low", input_fidelity="low", background="auto", user="u",
    )  # fmt: skip
    edited = client.images.edit(image=("a.png", png(), "image/png"), prompt=PROMPT, input_fidelity="high")
    assert (edited.model_extra["input_fidelity"], edited.background) == ("high", "opaque")
    list(client.images.edit(image=("a.png", png(), "image/png"), prompt=PROMPT, stream=True, partial_images=1))
    job = client.images.generate(prompt=PROMPT, size="64x64", extra_headers={"Prefer": "respond-async"})
    for fields in ({"background": "transparent"}, {"extra_body": {"guidance": 2}}):
        with pytest.raises(openai.BadRequestError):
            client.images.generate(prompt=PROMPT, **fields)
    with pytest.raises(openai.BadRequestError):
        client.images.edit(image=("a.png", png(), "image/png"), prompt=PROMPT, output_format="gif")  # type: ignore

    statuses, events = set(), 0
    for request, response in recording.seen:
        operation = document["paths"][request.url.path]["post"]
        media = request.headers["content-type"].split(";")[0]
        schema = operation["requestBody"]["content"][media]["schema"]
        body = json.loads(request.content) if media == "application/json" else form(request, deref(document, schema))
        if response.status_code == 400:  # the document says so too: a request it does not describe
            with pytest.raises(jsonschema.ValidationError):
                check(document, schema, body)
        else:
            check(document, schema, body)
        answers = operation["responses"][str(response.status_code)]["content"]
        kind = response.headers["content-type"].split(";")[0]
        if kind == "text/event-stream":
            for line in response.text.splitlines():
                if line.startswith("data: "):
                    check(document, answers[kind]["schema"], json.loads(line[6:]))
                    events += 1
        else:
            check(document, answers[kind]["schema"], response.json())
        statuses.add(response.status_code)
    assert statuses == {200, 202, 400} and events == 5, (statuses, events)
    done = wait_for(
        lambda: (
            (v := client.get(f"/images/jobs/{job.model_extra['id']}", cast_to=httpx.Response).json())["status"]
            == "succeeded"
            and v
        ),
        300,
        "the job to end",
    )
    check(document, document["paths"]["/v1/images/jobs/{id}"]["get"]["responses"]["200"]["content"]
          ["application/json"]["schema"], done)  # fmt: skip
    assert (done["quality"], done["background"], done["output_format"]) == ("high", "opaque", "png")


def deref(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    name = schema["$ref"].rsplit("/", 1)[1]
    return document["components"]["schemas"][name]


def test_the_document_describes_both_endpoints_and_needs_no_key(launch_tiny: Callable[..., Any]) -> None:
    """With an API key set the document is still served (it names no setting of the server); the images are not."""
    app = launch_tiny(api_key="sk-a-key-the-document-does-not-need")
    reply = httpx.get(app.url + "v1/openapi.json", timeout=30)
    assert reply.status_code == 200 and reply.json()["openapi"].startswith("3.1")
    paths = reply.json()["paths"]
    assert {"/v1/images/generations", "/v1/images/edits"} <= set(paths)
    generation = paths["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert generation == {"$ref": "#/components/schemas/ImageGenerationRequest"}
    schemas = reply.json()["components"]["schemas"]
    assert "background" in schemas["ImageGenerationRequest"]["properties"]
    assert "input_fidelity" in schemas["ImageEditRequest"]["properties"]
    assert set(schemas["ImagesResponse"]["required"]) >= {"size", "quality", "background", "output_format", "data"}
    assert httpx.post(app.url + "v1/images/generations", json={"prompt": PROMPT}, timeout=30).status_code == 401
