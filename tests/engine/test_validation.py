"""Bad input, through the public API, the page's event and the validation layer.

Every bad input gets a clear, specific error (a `gr.Error` whose message reaches the client) or a
documented normalization; none compiles anything (an API caller must never make the server compile a
shape of their choosing: each compile costs minutes of Neuron time) and the server keeps answering.
Runs against the real tiny app launched on 127.0.0.1 (conftest's `launched_app` / `client`).
"""

from __future__ import annotations

import json
import math
import unicodedata
from typing import Any

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from neuron_app.engine.manager import PipelineManager
from neuron_app.engine.requests import MAX_SEED
from neuron_app.errors import RequestError, ShapeError
from neuron_app.shapes import MAX_SIDE, MULTIPLE, Resolution
from tests.support import page_generate

MAX_PROMPT = 2000  # settings default, kept by the tiny test settings
MAX_STEPS = 8  # conftest's TINY_OVERRIDES
OFFERED = "64x64, 128x64, 64x128, 128x128"
HYPOTHESIS = settings(max_examples=300, deadline=None)

#: (prompt, resolution, steps, seed) -> the error message the client must get (a substring of it).
BAD_INPUTS: dict[str, tuple[tuple[Any, Any, Any, Any], str]] = {
    "prompt-empty": (("", "64x64", 4, 0), "prompt is empty: describe the image you want"),
    "prompt-whitespace": (("  \n\t  ", "64x64", 4, 0), "prompt is empty: describe the image you want"),
    "prompt-only-control-chars": (("\x00\x07\x1b", "64x64", 4, 0), "prompt is empty"),
    "prompt-100k-chars": (("a" * 100_000, "64x64", 4, 0), "prompt is 100000 characters long; the limit is 2000"),
    "prompt-null": ((None, "64x64", 4, 0), "prompt must be text"),
    "res-trailing-space": (("x", "1024x1024 ", 4, 0), "resolution '1024x1024 ' is not of the form WIDTHxHEIGHT"),
    "res-trailing-newline": (("x", "64x64\n", 4, 0), "is not of the form WIDTHxHEIGHT"),
    "res-capital-X": (("x", "1024X1024", 4, 0), "resolution '1024X1024' is not of the form WIDTHxHEIGHT"),
    "res-leading-zero": (("x", "064x64", 4, 0), "resolution '064x64' is not of the form WIDTHxHEIGHT"),
    "res-0x0": (("x", "0x0", 4, 0), "width 0 in '0x0' must be a positive multiple of 16"),
    "res-99999x99999": (("x", "99999x99999", 4, 0), "width 99999 in '99999x99999' must be a positive multiple of 16"),
    "res-above-max-side": (("x", "8192x8192", 4, 0), "width 8192 in '8192x8192' is above the maximum of 4096"),
    "res-path": (("x", "../etc", 4, 0), "resolution '../etc' is not of the form WIDTHxHEIGHT"),
    # gradio's Textbox turns a number into its text before the manager sees it
    "res-number": (("x", 1024, 4, 0), "resolution '1024' is not of the form WIDTHxHEIGHT"),
    "res-null": (("x", None, 4, 0), "resolution must be a string like '1024x1024', got NoneType"),
    # well formed but not configured: refused before any model work, never compiled
    "res-not-offered": (("x", "1024x1024", 4, 0), f"resolution 1024x1024 is not offered; choose one of {OFFERED}"),
    "res-not-offered-small": (("x", "16x16", 4, 0), "resolution 16x16 is not offered"),
    "steps-0": (("x", "64x64", 0, 0), "steps must be between 1 and 8, got 0"),
    "steps-negative": (("x", "64x64", -1, 0), "steps must be between 1 and 8, got -1"),
    "steps-1e9": (("x", "64x64", 10**9, 0), "steps must be between 1 and 8, got 1000000000"),
    "steps-fraction": (("x", "64x64", 4.5, 0), "steps must be a whole number between 1 and 8, got 4.5"),
    # gradio's Number (no precision, no bounds on the API input) passes a string through unchanged
    "steps-string": (("x", "64x64", "4", 0), "steps must be a whole number between 1 and 8, got str"),
    "steps-null": (("x", "64x64", None, 0), "steps must be a whole number between 1 and 8; it is missing (null)"),
    "seed-negative": (("x", "64x64", 4, -1), "seed must be between 0 and 4294967295, got -1"),
    "seed-2**32": (("x", "64x64", 4, 2**32), "seed must be between 0 and 4294967295, got 4294967296"),
    "seed-fraction": (("x", "64x64", 4, 1.5), "seed must be a whole number between 0 and 4294967295, got 1.5"),
    "seed-string": (("x", "64x64", 4, "7"), "seed must be a whole number between 0 and 4294967295, got str"),
    "seed-null": (
        ("x", "64x64", 4, None),
        "seed must be a whole number between 0 and 4294967295; it is missing (null)",
    ),
}


@pytest.fixture(scope="module")
def warm(client: Client, launched_app: Any) -> int:
    """One good request first, so that the model is loaded and 64x64 compiled: bad input must add no graph."""
    client.predict("warm-up", "64x64", 4, 0, api_name="/generate")
    return launched_app.manager.counter.graphs


def _status(client: Client) -> dict[str, Any]:
    return client.predict(api_name="/status")


def _rest_generate(url: str, data: list[Any], timeout: float = 60.0) -> tuple[str, Any]:
    """Call `generate` through Gradio's plain REST route, as any HTTP client can (`json.dumps` escapes lone
    surrogates as `\\udXXX`, which the server decodes back into a lone surrogate). Returns (event, data).
    Raw HTTP sends all seven inputs (lora, lora_scale, loras included): only gradio_client fills in the defaults."""
    body = json.dumps({"data": data})
    reply = httpx.post(
        f"{url}gradio_api/call/generate", content=body, headers={"content-type": "application/json"}, timeout=timeout
    )
    reply.raise_for_status()
    event_id = reply.json()["event_id"]
    with httpx.stream("GET", f"{url}gradio_api/call/generate/{event_id}", timeout=timeout) as stream:
        text = "".join(stream.iter_text())
    event = data_line = None
    for line in text.splitlines():
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and event in ("complete", "error"):
            data_line = line.split(":", 1)[1].strip()
    assert event in ("complete", "error"), text
    return event, json.loads(data_line or "null")


# --- through the API ----------------------------------------------------------------------------


@pytest.mark.parametrize("inputs, expected", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_api_bad_input_is_refused_clearly(
    client: Client,
    launched_app: Any,
    warm: int,
    inputs: tuple[Any, Any, Any, Any],
    expected: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Each bad input reaches the API client as its specific message; no stack trace (client or server
    log), no compile, and the server answers the next call."""
    manager = launched_app.manager
    before = manager.counter.graphs
    with pytest.raises(AppError) as info:
        client.predict(*inputs, api_name="/generate")
    message = str(info.value)
    assert expected in message
    assert "Traceback" not in message
    assert manager.counter.graphs == before == warm
    status = _status(client)
    assert status["compiles"] == warm
    assert "Traceback" not in capfd.readouterr().err


def test_api_lone_surrogate_is_refused_clearly(client: Client, launched_app: Any, warm: int) -> None:
    """A prompt with an unpaired surrogate (invalid UTF-8): gradio_client cannot even encode it (it raises
    UnicodeEncodeError before sending); sent as raw JSON, the server answers a clear error, compiles nothing."""
    with pytest.raises(UnicodeEncodeError):
        client.predict("a\ud800b", "64x64", 4, 0, api_name="/generate")
    for prompt in ("a\ud800b", "\udfff", "ok \udc80 ok"):
        event, data = _rest_generate(launched_app.url, [prompt, "64x64", 4, 0, "none", 1.0, None])
        assert event == "error"
        assert data["error"] == "prompt contains invalid characters (unpaired surrogates)"
    assert launched_app.manager.counter.graphs == warm
    assert _status(client)["compiles"] == warm


def test_api_raw_json_oddities_are_refused(launched_app: Any, warm: int) -> None:
    """Values no form can send but raw JSON can (NaN, a list, an object) get clear errors too; a call with
    too few inputs is refused by Gradio itself; nothing compiles."""
    url = launched_app.url
    event, data = _rest_generate(url, ["x", "64x64", float("nan"), 0, "none", 1.0, None])
    assert (event, data["error"]) == ("error", "steps must be a whole number between 1 and 8, got nan")
    event, data = _rest_generate(url, ["x", "64x64", [4], 0, "none", 1.0, None])
    assert (event, data["error"]) == ("error", "steps must be a whole number between 1 and 8, got list")
    event, data = _rest_generate(url, ["x", {"width": 64}, 4, 0, "none", 1.0, None])
    assert event == "error" and "is not of the form WIDTHxHEIGHT" in data["error"]
    # too few inputs: Gradio itself refuses before the app runs, and says so in one line (web/gradio_errors.py;
    # it used to answer {"error": null})
    event, data = _rest_generate(url, ["x", "64x64", 4])
    assert event == "error" and "didn't receive enough input values (needed: 7, got: 3)" in data["error"]
    assert launched_app.manager.counter.graphs == warm


def test_api_control_characters_become_spaces(client: Client, launched_app: Any, warm: int) -> None:
    """Documented normalization: control characters other than newline and tab become spaces, the prompt
    is stripped; the image is made from the cleaned prompt (reported back in the info)."""
    _path, info = client.predict("\x00 a\x07b\r\nc\td\x1b ", "64x64", 4, 0, api_name="/generate")
    assert info["prompt"] == "a b \nc\td"
    assert info["compiled"] is False and launched_app.manager.counter.graphs == warm


def test_api_integral_floats_are_accepted(client: Client, launched_app: Any, warm: int) -> None:
    """Documented normalization: JSON clients send numbers as floats; 4.0 steps and seed 7.0 mean 4 and 7."""
    _path, info = client.predict("x", "64x64", 4.0, 7.0, api_name="/generate")
    assert (info["steps"], info["seed"]) == (4, 7)
    assert launched_app.manager.counter.graphs == warm


def test_api_extra_inputs_are_ignored(client: Client, launched_app: Any, warm: int) -> None:
    """An extra argument (say, a model id) cannot change anything: the endpoint takes seven inputs (the last three,
    LoRA style, scale and the list of styles, optional), a model id in a style's place is refused, one past them is
    ignored, and the model stays the configured one."""
    with pytest.raises(AppError, match="LoRA style 'evil/other-model' is not offered; choose one of none"):
        client.predict("x", "64x64", 4, 0, "evil/other-model", api_name="/generate")
    with pytest.raises(AppError, match="loras must be a JSON list of"):
        client.predict("x", "64x64", 4, 0, "none", 1.0, "evil/other-model", api_name="/generate")
    _path, info = client.predict("x", "64x64", 4, 0, "none", 1.0, None, "evil/other-model", api_name="/generate")
    assert info["model"] == "tiny"
    assert _status(client)["model"] == "tiny"


# --- through the page ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        (["x", "1024x1024", 4, 0, 1, False], "Value: 1024x1024 is not in the list of choices"),
        (["x", "64x64", 400, 0, 1, False], "Value 400 is greater than maximum value 8."),
        (["x", "64x64", 0, 0, 1, False], "Value 0 is less than minimum value 1."),
        (["x", "64x64", 4, -5, 1, False], "Value -5 is less than minimum value 0."),
        (["", "64x64", 4, 0, 1, False], "prompt is empty: describe the image you want"),
        (["x", "64x64", 4, 0, 5, False], "Value 5 is greater than maximum value 4."),
        (["", "64x64", 4, 0, 3, False], "prompt is empty: describe the image you want"),
    ],
    ids=[
        "res-not-in-dropdown",
        "steps-above-slider",
        "steps-below-slider",
        "seed-below-min",
        "prompt-empty",
        "images-above-slider",
        "prompt-empty-3-images",
    ],
)
def test_page_bad_input_is_refused_clearly(
    client: Client, launched_app: Any, warm: int, data: list[Any], expected: str
) -> None:
    """The page's Generate event: the dropdown, slider and number refuse what they never offer (Gradio's
    message), the manager refuses the rest; nothing compiles."""
    message = page_generate(launched_app, data)
    assert message["success"] is False
    assert expected in message["output"]["error"]
    assert launched_app.manager.counter.graphs == warm
    assert _status(client)["compiles"] == warm


def test_page_fractional_seed_is_rounded(launched_app: Any, warm: int) -> None:
    """Documented normalization on the page: the seed box has precision 0, so 1.5 is rounded (to 2)."""
    message = page_generate(launched_app, ["x", "64x64", 4, 1.5, 1, False])
    assert message["success"] is True
    assert message["output"]["data"][2] == 2


# --- the validation layer, property-based ---------------------------------------------------------


@HYPOTHESIS
@given(st.text(max_size=24))
@example("64x64\n")
@example("064x064")
@example("+64x64")
@example("６4x64")
def test_parse_accepts_only_the_canonical_form(text: str) -> None:
    """Resolution.parse either refuses with ShapeError or returns a shape that prints back as exactly
    the input (so no variant spelling reaches the cache keys), within the side rules."""
    try:
        res = Resolution.parse(text)
    except ShapeError:
        return
    assert str(res) == text
    for side in (res.width, res.height):
        assert 0 < side <= MAX_SIDE and side % MULTIPLE == 0


@HYPOTHESIS
@given(st.integers(1, MAX_SIDE // MULTIPLE), st.integers(1, MAX_SIDE // MULTIPLE))
def test_parse_round_trips_valid_shapes(w: int, h: int) -> None:
    """Every multiple-of-16 shape within MAX_SIDE parses to itself and prints back unchanged."""
    text = f"{w * MULTIPLE}x{h * MULTIPLE}"
    res = Resolution.parse(text)
    assert (res.width, res.height, str(res)) == (w * MULTIPLE, h * MULTIPLE, text)


@HYPOTHESIS
@given(
    st.one_of(
        st.text(max_size=16),
        st.sampled_from(["64x64", "128x64", "64x128", "128x128"]).flatmap(
            lambda r: st.sampled_from([r, f" {r}", f"{r} ", r.upper(), f"{r}\n", "0" + r, r.replace("x", "*")])
        ),
        st.builds(lambda w, h: f"{w}x{h}", st.integers(-10, 5000), st.integers(-10, 5000)),
        st.none(),
        st.integers(),
        st.floats(),
        st.lists(st.integers(), max_size=2),
    )
)
def test_validate_refuses_any_resolution_not_configured(launched_app: Any, resolution: Any) -> None:
    """The manager accepts a resolution only if it is exactly one of the configured strings; anything else
    is a RequestError, and validating never compiles."""
    manager: PipelineManager = launched_app.manager
    graphs = manager.counter.graphs
    configured = manager.settings.resolutions
    if isinstance(resolution, str) and resolution in configured:
        assert str(manager.validate("x", resolution, 4, 0).resolution) == resolution
    else:
        with pytest.raises(RequestError):
            manager.validate("x", resolution, 4, 0)
    assert manager.counter.graphs == graphs


def _whole_number_cases(low: int, high: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.integers(),
        st.integers(low - 3, high + 3),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(low, high).map(float),
        st.booleans(),
        st.none(),
        st.text(max_size=4),
    )


def _check_whole_number(value: Any, low: int, high: int, call: Any) -> None:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    integral = is_number and math.isfinite(value) and float(value).is_integer()
    if integral and low <= value <= high:
        result = call(value)
        assert result == value and type(result) is int
    else:
        with pytest.raises(RequestError):
            call(value)


@HYPOTHESIS
@given(_whole_number_cases(1, MAX_STEPS))
def test_validate_steps_only_whole_numbers_in_range(launched_app: Any, steps: Any) -> None:
    """Steps: any whole number outside 1..max_steps, fraction, NaN, bool, text or null is a RequestError;
    a whole number in range (4 or 4.0) comes back as that int."""
    manager: PipelineManager = launched_app.manager
    _check_whole_number(steps, 1, MAX_STEPS, lambda v: manager.validate("x", "64x64", v, 0).steps)


@HYPOTHESIS
@given(_whole_number_cases(0, MAX_SEED))
@example(2**32)
@example(-1)
@example(float(2**32 - 1))
def test_validate_seed_only_whole_numbers_in_range(launched_app: Any, seed: Any) -> None:
    """Seed: only whole numbers 0..2**32-1 pass (as int); everything else is a RequestError."""
    manager: PipelineManager = launched_app.manager
    _check_whole_number(seed, 0, MAX_SEED, lambda v: manager.validate("x", "64x64", 4, v).seed)


@HYPOTHESIS
@given(st.text(st.characters(codec=None), max_size=3000))
@example("\x00\x85\u2028 hello \x7f")
@example("a" * (MAX_PROMPT + 1))
def test_validate_prompt_is_clean_or_refused(launched_app: Any, prompt: str) -> None:
    """Any prompt is refused with RequestError or comes back cleaned: non-empty, within max_prompt_chars,
    no control characters but newline and tab, valid UTF-8, and cleaning it again changes nothing."""
    manager: PipelineManager = launched_app.manager
    try:
        cleaned = manager.validate(prompt, "64x64", 4, 0).prompt
    except RequestError:
        return
    assert cleaned and cleaned == cleaned.strip()
    assert len(cleaned) <= MAX_PROMPT
    assert all(unicodedata.category(ch) != "Cc" or ch in "\n\t" for ch in cleaned)
    cleaned.encode("utf-8")
    assert manager.validate(cleaned, "64x64", 4, 0).prompt == cleaned


@HYPOTHESIS
@given(st.text(max_size=20), st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]), st.text(max_size=20))
def test_validate_refuses_lone_surrogates(launched_app: Any, before: str, surrogate: str, after: str) -> None:
    """A prompt holding an unpaired surrogate anywhere is refused, never passed to the tokenizer."""
    with pytest.raises(RequestError, match="unpaired surrogates"):
        launched_app.manager.validate(before + surrogate + after, "64x64", 4, 0)
