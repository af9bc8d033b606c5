"""Who may ask, and how much: blocked terms, named API keys with their limits, the per-address page limit.

One launched tiny app (aot_eager, 64x64) configured through the real environment (NEURON_APP_BLOCKED_TERMS,
NEURON_APP_API_KEYS as JSON), driven by the clients people use: gradio_client, the openai SDK, plain HTTP.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from neuron_app.engine.trust.blocked_terms import find_blocked, fold
from neuron_app.errors import ContentRefused, SettingsError
from neuron_app.settings import load_settings
from tests.support import PATIENT_HTTP, openai_client

CI_KEY = f"sk-ci-{uuid.uuid4().hex}"
TEAM_KEY = f"sk-team-{uuid.uuid4().hex}"
PROMPT = "a lighthouse at dawn"
STEPS = {"num_inference_steps": 1}


def metrics(app: Any) -> str:
    return httpx.get(app.url + "metrics", timeout=10).text


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one series of the /metrics text (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    series = f"{name}{{{wanted}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def launched_with(launch_tiny: Callable[..., Any], variables: dict[str, str]) -> Any:
    """The tiny app started with settings from NEURON_APP_* variables (as a deployment sets them), 64x64 compiled:
    the per-minute limits are counted on the clock, and a first-use compile inside a test's first image (minutes on
    a busy host) could let that image leave the minute before the test's third one."""
    os.environ.update(variables)
    try:
        launched = launch_tiny()
    finally:
        for name in variables:
            os.environ.pop(name, None)
    launched.manager.compile_shape("64x64")
    return launched


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    """Blocked terms and two keys. No page limit on loopback: the page limit's test has an app of its own, so no
    test here finds the address's images spent by another."""
    keys = {"ci": {"key": CI_KEY, "images_per_minute": 2}, "team": {"key": TEAM_KEY, "images_per_day": 100}}
    variables = {"NEURON_APP_BLOCKED_TERMS": '["forbiddenword"]', "NEURON_APP_API_KEYS": json.dumps(keys)}
    return launched_with(launch_tiny, variables)


@pytest.fixture(scope="module")
def gradio(app: Any) -> Any:
    from gradio_client import Client

    return Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)


# --- blocked terms ------------------------------------------------------------------------------------


def test_blocked_terms_match_whole_words_after_normalisation() -> None:
    terms = ["forbiddenword", "two words"]
    caught = [
        "A Forbiddenword, at dusk",
        "ＦＯＲＢＩＤＤＥＮＷＯＲＤ",  # full-width letters (NFKC)
        "forbid\u200bdenword",  # a zero-width space inside
        "f\u043erbiddenword",  # a Cyrillic o
        "forbíddenword",  # an accent
        "snake_forbiddenword_case",  # underscores are not letters
        "TWO-words!",
        "two \n  words",
    ]
    for prompt in caught:
        assert find_blocked(prompt, terms) is not None, prompt
    for prompt in ("forbiddenwordy", "unforbiddenword", "twowords", "two wordsmiths", "a calm sea"):
        assert find_blocked(prompt, terms) is None, prompt
    assert fold("ＡＢＣ\u00ad") == "abc"


def test_blocked_terms_file_is_read_again_when_it_changes(tmp_path: Path, make_settings: Any) -> None:
    path = tmp_path / "terms.txt"
    path.write_text("# one term a line\nfirstterm\n\n", encoding="utf-8")
    settings = make_settings(blocked_terms_file=path)
    from neuron_app.engine.requests import validate

    with pytest.raises(ContentRefused, match="firstterm") as caught:
        validate(settings, ["64x64"], "a firstterm here", "64x64", 1, 0)
    assert caught.value.code == "content_policy_violation" and caught.value.param == "prompt"
    validate(settings, ["64x64"], "a secondterm here", "64x64", 1, 0)
    path.write_text("firstterm\nsecondterm\n", encoding="utf-8")
    os.utime(path, ns=(1, 2_000_000_000_000_000_000))  # a new mtime even within the filesystem's granularity
    with pytest.raises(ContentRefused, match="secondterm"):
        validate(settings, ["64x64"], "a secondterm here", "64x64", 1, 0)
    with pytest.raises(SettingsError, match="blocked_terms_file"):
        make_settings(blocked_terms_file=tmp_path / "missing.txt")
    with pytest.raises(SettingsError, match="no letter or digit"):
        make_settings(blocked_terms=["--"])


def test_blocked_term_is_refused_by_gradio_and_openai_before_any_compile(app: Any, gradio: Any) -> None:
    from gradio_client.exceptions import AppError

    compiles = gradio.predict(api_name="/status")["compiles"]
    with pytest.raises(AppError, match="'forbiddenword', a term this server does not allow"):
        gradio.predict("A Forbiddenword, at dusk", "64x64", 1, 0, api_name="/generate")
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(app, TEAM_KEY).images.generate(
            prompt="ＦＯＲＢＩＤＤＥＮＷＯＲＤ at noon", size="64x64", extra_body=STEPS
        )
    assert caught.value.status_code == 400
    assert caught.value.body["code"] == "content_policy_violation" and caught.value.body["param"] == "prompt"
    assert gradio.predict(api_name="/status")["compiles"] == compiles  # nothing was compiled or run
    text = metrics(app)
    assert sample(text, "neuron_app_content_refused_total", entry="gradio_api", what="prompt") == 1
    assert sample(text, "neuron_app_content_refused_total", entry="openai", what="prompt") == 1
    assert sample(text, "neuron_app_api_refusals_total", key="team", reason="content_policy_violation") == 1
    result = openai_client(app, TEAM_KEY).images.generate(
        prompt="forbiddenwordy at noon", size="64x64", extra_body=STEPS
    )
    assert result.data[0].b64_json  # a longer word is not the term


# --- API keys and their limits --------------------------------------------------------------------------


def test_named_keys_limits_and_metrics(app: Any, caplog: pytest.LogCaptureFixture) -> None:
    """ci may make 2 images a minute: its third request is a 429 with Retry-After naming the limit; team still
    works; a wrong key is a 401; /metrics counts per key name and never shows a key."""
    caplog.set_level(logging.DEBUG)
    ci, team = openai_client(app, CI_KEY), openai_client(app, TEAM_KEY)
    before = sample(metrics(app), "neuron_app_api_images_total", key="team")
    for seed in (1, 2):
        assert ci.images.generate(prompt=PROMPT, size="64x64", extra_body=STEPS | {"seed": seed}).data
    with pytest.raises(openai.RateLimitError) as caught:
        ci.images.generate(prompt=PROMPT, size="64x64", extra_body=STEPS)
    reply = caught.value.response
    assert reply.status_code == 429 and caught.value.body["code"] == "rate_limit_exceeded"
    message = caught.value.body["message"]
    assert re.fullmatch(r"key 'ci' is over its limit of 2 images per minute; retry in \d+ s", message), message
    retry = int(reply.headers["retry-after"])
    assert 1 <= retry <= 60 and f"retry in {retry} s" in message
    with pytest.raises(openai.BadRequestError, match="at most 2 images per minute"):  # can never fit: 400, on n
        ci.images.generate(prompt=PROMPT, size="64x64", n=3, extra_body=STEPS)
    assert team.images.generate(prompt=PROMPT, size="64x64", n=2, extra_body=STEPS).data  # the other key works
    with pytest.raises(openai.AuthenticationError) as wrong:
        openai_client(app, CI_KEY[:-1] + "x").images.generate(prompt=PROMPT, size="64x64")
    assert wrong.value.status_code == 401 and wrong.value.body["code"] == "invalid_api_key"
    text = metrics(app)
    assert sample(text, "neuron_app_api_images_total", key="ci") == 2
    assert sample(text, "neuron_app_api_images_total", key="team") == before + 2
    assert sample(text, "neuron_app_api_refusals_total", key="ci", reason="images_per_minute") == 1
    assert sample(text, "neuron_app_api_auth_failures_total") >= 1
    for secret in (CI_KEY, TEAM_KEY, CI_KEY[6:], TEAM_KEY[8:]):
        assert secret not in text and secret not in caplog.text


def test_api_keys_are_environment_only_and_checked(tmp_path: Path) -> None:
    toml = tmp_path / "settings.toml"
    toml.write_text(f'[api_keys.ci]\nkey = "{CI_KEY}"\n', encoding="utf-8")
    env = os.environ.copy()
    os.environ["NEURON_APP_SETTINGS"] = str(toml)
    try:
        with pytest.raises(SettingsError, match="api_keys must not be set in the settings file"):
            load_settings()
    finally:
        os.environ.clear()
        os.environ.update(env)
    with pytest.raises(SettingsError, match="too short"):
        load_settings(api_keys={"ci": {"key": "short"}})
    with pytest.raises(SettingsError, match="is not allowed"):
        load_settings(api_keys={'bad"name': {"key": CI_KEY}})
    with pytest.raises(SettingsError, match="same key"):
        load_settings(api_keys={"a": {"key": CI_KEY}, "b": {"key": CI_KEY}})
    settings = load_settings(api_keys={"ci": {"key": CI_KEY, "images_per_minute": 2}})
    assert CI_KEY not in repr(settings) and CI_KEY not in settings.model_dump_json()


# --- the page -----------------------------------------------------------------------------------------


def test_page_limit_per_client_address(launch_tiny: Callable[..., Any]) -> None:
    """page_images_per_minute = 2: this address's third image in a minute is refused with the limit named;
    refused requests (a bad shape) cost nothing."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    app = launched_with(launch_tiny, {"NEURON_APP_PAGE_IMAGES_PER_MINUTE": "2"})
    gradio = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)

    with pytest.raises(AppError, match="resolution 1024x1024 is not offered"):
        gradio.predict(PROMPT, "1024x1024", 1, 0, api_name="/generate")
    for seed in (1, 2):
        _path, info = gradio.predict(PROMPT, "64x64", 1, seed, api_name="/generate")
        assert info["seed"] == seed
    with pytest.raises(AppError, match=r"address 127\.0\.0\.1 is over its limit of 2 images per minute; retry in"):
        gradio.predict(PROMPT, "64x64", 1, 3, api_name="/generate")
    from neuron_app.bench.wire import WireClient

    wire = WireClient(app.url, timeout=60)  # the page's own Generate (the browser's event): the same address
    try:
        fn_index, fn = next((fid, fn) for fid, fn in app.demo.fns.items() if fn.name == "ui_generate")
        data = [PROMPT, "64x64", 1, 4, 1, False]  # prompt, shape, steps, seed, images, randomize
        data += [getattr(component, "value", None) for component in fn.inputs[len(data) :]]  # the rest as shown
        answer = wire.event(fn_index, data)
    finally:
        wire.close()
    assert not answer["success"] and "127.0.0.1 is over its limit of 2 images per minute" in str(answer["output"])
    text = metrics(app)
    assert sample(text, "neuron_app_page_images_total") == 2
    assert sample(text, "neuron_app_page_rate_limited_total") == 2  # gradio_client and the page


def test_mcp_calls_are_charged_to_the_callers_address(launch_tiny: Callable[..., Any]) -> None:
    """MCP tool calls meet the blocked terms (counted as entry mcp) and the page limit of the MCP caller's own
    address, the budget its page and gradio_client calls use: the route decides. A gradio_client sending what
    Gradio's MCP loopback client sends (`X-Gradio-User: mcp`), a guessed secret and another address stays in
    its own address's bucket (it used to move into a shared MCP bucket with a budget of its own)."""
    import asyncio

    from gradio_client import Client
    from gradio_client.exceptions import AppError
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    app = launch_tiny(page_images_per_minute=2, blocked_terms=["forbiddenword"])

    async def mcp_generate(*prompts: str) -> list[Any]:
        async with (
            streamablehttp_client(app.url + "gradio_api/mcp/") as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            calls = [{"prompt": prompt, "resolution": "64x64", "steps": 1, "seed": 1} for prompt in prompts]
            return [await session.call_tool("generate", args) for args in calls]

    blocked, first = asyncio.run(mcp_generate("one forbiddenword here", PROMPT))
    assert blocked.isError and "does not allow" in str(blocked.content)
    assert not first.isError, first.content
    forged = {"x-gradio-user": "mcp", "x-neuron-app-mcp": "a-guess", "x-neuron-app-mcp-client": "203.0.113.9"}
    posing = Client(app.url, verbose=False, headers=forged, httpx_kwargs=PATIENT_HTTP)
    assert posing.predict(PROMPT, "64x64", 1, 2, api_name="/generate")  # the address's second image
    with pytest.raises(AppError, match=r"address 127\.0\.0\.1 is over its limit of 2 images per minute"):
        posing.predict(PROMPT, "64x64", 1, 3, api_name="/generate")
    (over,) = asyncio.run(mcp_generate(PROMPT))
    assert over.isError and "address 127.0.0.1 is over its limit of 2 images per minute" in str(over.content)
    assert sample(metrics(app), "neuron_app_content_refused_total", entry="mcp", what="prompt") == 1


def test_sliding_windows_count_images_and_say_when_they_fit() -> None:
    """Two images a minute and three a day: the wait is until enough images leave the window (not a fixed
    window's edge); a refund gives the images back; the day limit names itself."""
    from neuron_app.errors import RateLimited, RequestError
    from neuron_app.web.access import DAY_S, MINUTE_S, Limit, Limiter

    now = [1000.0]
    limiter = Limiter(clock=lambda: now[0])
    limits = [Limit(2, MINUTE_S, "per minute", "images_per_minute"), Limit(3, DAY_S, "per day", "images_per_day")]
    limiter.charge("key:ci", 1, limits, "key 'ci'")
    now[0] += 10
    limiter.charge("key:ci", 1, limits, "key 'ci'")
    now[0] += 10
    with pytest.raises(RateLimited, match=r"^key 'ci' is over its limit of 2 images per minute; retry in 40 s$") as hit:
        limiter.charge("key:ci", 1, limits, "key 'ci'")
    assert hit.value.retry_after_s == 40 and hit.value.http_status == 429
    with pytest.raises(RateLimited, match="retry in 50 s"):  # two images wait for both to leave
        limiter.charge("key:ci", 2, limits, "key 'ci'")
    limiter.charge("key:other", 2, limits, "key 'other'")  # callers are apart
    now[0] += 40.5  # the first image left the minute
    refund = limiter.charge("key:ci", 1, limits, "key 'ci'")
    now[0] += 61
    refund()  # that request failed: its image is given back to both windows
    limiter.charge("key:ci", 1, limits, "key 'ci'")
    with pytest.raises(RateLimited, match=r"over its limit of 3 images per day; retry in \d+ s") as day:
        limiter.charge("key:ci", 1, limits, "key 'ci'")
    assert DAY_S - 200 < day.value.retry_after_s <= DAY_S
    with pytest.raises(RequestError, match="may ask for at most 2 images per minute; this request asks for 3"):
        limiter.charge("key:ci", 3, limits, "key 'ci'")
    assert limiter.refusals == {("key:ci", "images_per_minute"): 2, ("key:ci", "images_per_day"): 1}
    limiter.charge("page:x", 100, [Limit(0, MINUTE_S, "per minute", "images_per_minute")], "address x")  # 0 = off


def test_old_api_key_is_one_unlimited_key_named_default(make_settings: Any) -> None:
    """`api_key` keeps working beside named keys, as `default` without limits; every name is a /metrics label
    from the start, and no key is."""
    from neuron_app.web.access import Access

    old = f"sk-old-{uuid.uuid4().hex}"
    access = Access(make_settings(api_key=old, api_keys={"ci": {"key": CI_KEY, "images_per_minute": 1}}))
    assert access.keys_required
    assert access.identify(old) == "default" and access.identify(CI_KEY) == "ci"
    assert access.identify(old + "x") is None and access.identify("") is None
    for _ in range(3):
        with access.api_images("default", None, 4):  # no limit on the old key
            pass
    text = "\n".join(str(sample) for family in access.collect() for sample in family.samples)
    assert "'key': 'default'" in text and "'key': 'ci'" in text and old not in text and CI_KEY not in text
    assert access.images["default"] == 12 and access.auth_failures == 2
    with pytest.raises(SettingsError, match="api_key is also one of api_keys"):
        make_settings(api_key=CI_KEY, api_keys={"ci": {"key": CI_KEY}})


def test_without_keys_the_api_shares_the_page_budget_of_the_address(launch_tiny: Callable[..., Any]) -> None:
    """No API key configured: the OpenAI API draws on the address's page budget, so the API and gradio_client
    together make page_images_per_minute images, not twice that."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    app = launch_tiny(page_images_per_minute=1)
    assert openai_client(app, "unused").images.generate(prompt=PROMPT, size="64x64", extra_body=STEPS).data
    with pytest.raises(openai.RateLimitError, match=r"address 127\.0\.0\.1 is over its limit of 1 image per minute"):
        openai_client(app, "unused").images.generate(prompt=PROMPT, size="64x64", extra_body=STEPS)
    with pytest.raises(AppError, match="over its limit of 1 image per minute"):
        Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(PROMPT, "64x64", 1, 0, api_name="/generate")
    assert sample(metrics(app), "neuron_app_page_rate_limited_total") == 2
