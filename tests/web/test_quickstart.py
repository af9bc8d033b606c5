"""The README's quick start as a new user runs it: `NEURON_APP_SETTINGS=quickstart.toml python app.py`, one app for
the module (its compile backend aot_eager, so that the warm-up's compile takes seconds here; the warm-up and the
readiness are the quick start's own). Turn 7's first hour: /readyz turns 200 with no request sent (T7-1), the API's
OpenAPI document passes a stock validator (T7-6), an image made through gradio_client is booked by `usage` with its
interface (T7-8), the gradio_client size refusal lists the offered shapes and names size_policy (T7-9), and every
docs/api.md example runs as written against it (T7-10)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import PATIENT_HTTP, ROOT, AppProcess, free_port, run_cli, wait_for

pytestmark = pytest.mark.slow  # one app.py process for the module

#: What /readyz may say before it is ready on the quick start: loading, then the warm-up's compile.
NOT_READY_YET = (
    "the model is loading",
    "the model is not loaded yet",
    "warming up (warmup = default): compiling 128x128",
)


def quickstart_env(cache_dir: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    return env | {
        "NEURON_APP_SETTINGS": "quickstart.toml",
        "NEURON_APP_CACHE_DIR": str(cache_dir),
        "NEURON_APP_SERVER_PORT": str(port),
        "NEURON_APP_COMPILE_BACKEND": "aot_eager",
    }


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppProcess]:
    """The quick start, waited on until /readyz says 200 with no other request sent (every reason it gave before
    is kept on the app as `reasons`)."""
    cache_dir = tmp_path_factory.mktemp("quickstart")
    env = quickstart_env(cache_dir, free_port())
    app = AppProcess(cache_dir, env, cache_dir.parent / "quickstart.log")
    app.env = env  # type: ignore[attr-defined]
    reasons: list[str] = []

    def ready() -> dict[str, Any] | None:
        if app.proc.poll() is not None:
            raise AssertionError(f"app.py exited with {app.proc.returncode}:\n{app.output()[-3000:]}")
        try:
            answer = httpx.get(app.url + "readyz", timeout=10)
        except httpx.HTTPError:
            return None  # not listening yet
        body = answer.json()
        if answer.status_code == 200:
            return body
        reasons.append(body["reason"])
        return None

    try:
        # Generous: a first-use compile on a busy 2-core machine; the test waits on the event, not on the time.
        app.ready_body = wait_for(ready, 900, "/readyz to answer 200 on the quick start")  # type: ignore[attr-defined]
        app.reasons = reasons  # type: ignore[attr-defined]
        yield app
    finally:
        app.stop()


def test_readyz_turns_200_without_a_request(quick: AppProcess) -> None:
    """The warm-up compiles the default shape at start: no request was sent before /readyz said 200, and what it
    said before is one of the documented reasons (docs/api.md, "What to wait for")."""
    first = quick.output().splitlines()[0]  # printed before the imports (turn 7: 24 s of silence)
    assert first.startswith(f"starting tiny-shapes on http://127.0.0.1:{quick.port}/") and "/readyz" in first, first
    body = quick.ready_body  # type: ignore[attr-defined]
    assert body["ready"] is True and body["loaded"] is True and "128x128" in body["ready_shapes"], body
    assert all(r.startswith(NOT_READY_YET) for r in quick.reasons), set(quick.reasons)  # type: ignore[attr-defined]
    assert "warmup = default" in (ROOT / "docs" / "api.md").read_text().replace('"', "")


def test_the_openapi_document_passes_a_stock_validator(quick: AppProcess) -> None:
    from openapi_spec_validator import validate

    document = httpx.get(quick.url + "v1/openapi.json", timeout=30).json()
    validate(document)  # raises on the first error (turn 7: `mask`'s null default on a string)


def test_a_gradio_client_size_refusal_lists_the_shapes_and_names_size_policy(quick: AppProcess) -> None:
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    client = Client(quick.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    for size in ("300x300", "1024x1024", "big"):
        with pytest.raises(AppError) as refused:
            client.predict("a red circle on a blue background", size, 4, 7, api_name="/generate")
        message = str(refused.value)
        assert "choose one of 128x128, 256x128, 128x256, 256x256" in message and "size_policy" in message, message


def test_an_image_made_through_gradio_client_is_booked_with_its_interface(quick: AppProcess) -> None:
    from gradio_client import Client

    client = Client(quick.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    _path, info = client.predict("a red circle on a blue background", "128x128", 4, 7, api_name="/generate")
    assert info["resolution"] == "128x128"
    out = run_cli(quick.env, "usage", "--json", timeout=120)  # type: ignore[attr-defined]
    assert out.returncode == 0, out.stderr
    rows = [r for r in json.loads(out.stdout) if r["interface"] == "gradio_api"]
    assert len(rows) == 1 and rows[0]["images"] >= 1 and rows[0]["device_seconds"] > 0, out.stdout
    table = run_cli(quick.env, "usage", timeout=120).stdout  # type: ignore[attr-defined]
    assert "interface" in table.splitlines()[0] and "gradio_api" in table


# --- docs/api.md, run as written (the port substituted; 1024x1024 as its note says: 256x256 on the quick start) ---

#: Examples that need what a running app alone does not give: a webhook delivery to verify.
NOT_AGAINST_AN_APP = ("standardwebhooks",)


def api_examples() -> list[tuple[int, str, str]]:
    """(line, language, code) of each python and bash block of docs/api.md, in order."""
    text = (ROOT / "docs" / "api.md").read_text()
    return [
        (text[: m.start()].count("\n") + 1, m.group(1), m.group(2))
        for m in re.finditer(r"```(python|bash)\n(.*?)```", text, re.DOTALL)
    ]


def as_run_here(code: str, port: int) -> str:
    return code.replace("127.0.0.1:7860", f"127.0.0.1:{port}").replace("1024x1024", "256x256")


def test_every_api_example_runs_as_written(quick: AppProcess, tmp_path: Path) -> None:
    """Each python example in its own interpreter; one that continues an earlier one (`client` without defining
    it) runs after the example that defines its client: the gradio_client one for `api_name=`, else the OpenAI
    SDK's. The curl example through bash, its images written where it says."""
    examples = api_examples()
    python = [(line, code) for line, lang, code in examples if lang == "python"]
    gradio_setup = next(code for _, code in python if "Client(" in code and "gradio_client" in code)
    openai_setup = next(code for _, code in python if "OpenAI(" in code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the curl example's `python`
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")  # gradio_client's download staging folders stay out of the machine's /tmp
    ran = []
    for line, lang, code in examples:
        if any(word in code for word in NOT_AGAINST_AN_APP) or "python app.py" in code:
            continue
        script = as_run_here(code, quick.port)
        if lang == "bash":
            if "curl" not in script:
                continue
            done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)  # fmt: skip
        else:
            defines = re.search(r"^client = ", script, re.MULTILINE)
            if not defines and "client." in script:
                setup = gradio_setup if "api_name=" in script else openai_setup
                script = as_run_here(setup, quick.port) + "\n" + script
            done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, f"docs/api.md line {line}:\n{script}\n{done.stdout}\n{done.stderr}"
        ran.append(line)
    assert len(ran) >= 7, ran  # gradio_client, curl, openai, streaming, raw headers, the job, submit
    assert {p.name for p in tmp_path.glob("*.png")} >= {"img0.png", "img1.png", "partial0.png", "final.png"}


# --- the page draws every image whole (turn 7's T7-4) ----------------------------------------------------------

#: Where an <img> is drawn (its object-fit and object-position applied) and what of it can be seen (its own box,
#: clipped by every ancestor that clips), in page pixels; null until the image has loaded.
DRAWN = """(selector) => {
  const img = document.querySelector(selector);
  if (!img || !img.complete || !img.naturalWidth) return null;
  const box = img.getBoundingClientRect(), style = getComputedStyle(img);
  const [nw, nh] = [img.naturalWidth, img.naturalHeight];
  let [w, h] = [box.width, box.height];
  const fit = style.objectFit;
  if (fit === "contain" || fit === "scale-down" || fit === "cover") {
    const pick = fit === "cover" ? Math.max : Math.min;
    let k = pick(box.width / nw, box.height / nh);
    if (fit === "scale-down") k = Math.min(k, 1);
    [w, h] = [nw * k, nh * k];
  } else if (fit === "none") [w, h] = [nw, nh];
  const [px, py] = style.objectPosition.split(" ").map((p) => parseFloat(p) / 100);
  const left = box.left + (box.width - w) * px, top = box.top + (box.height - h) * py;
  let seen = [box.left, box.top, box.right, box.bottom];
  for (let el = img.parentElement; el; el = el.parentElement) {
    const s = getComputedStyle(el);
    if (s.overflowX === "visible" && s.overflowY === "visible") continue;
    const b = el.getBoundingClientRect();
    seen = [Math.max(seen[0], b.left), Math.max(seen[1], b.top),
            Math.min(seen[2], b.right), Math.min(seen[3], b.bottom)];
  }
  return {natural: [nw, nh], fit, drawn: [left, top, left + w, top + h], seen};
}"""


def drawn_whole(page: Any, selector: str, natural: tuple[int, int]) -> dict[str, Any]:
    """The first image under `selector` once loaded at its natural size: drawn at that aspect ratio and nothing of
    it outside what can be seen (1 px of rounding allowed)."""
    from tests.web.test_browser import TIMEOUT_MS

    found = page.wait_for_function(
        f"() => {{ const d = ({DRAWN})({selector!r}); return d && d.natural[0] === {natural[0]} ? d : null; }}",
        timeout=TIMEOUT_MS,
    ).json_value()
    left, top, right, bottom = found["drawn"]
    assert right - left > 16 and bottom - top > 16, found
    assert abs((right - left) / (bottom - top) - natural[0] / natural[1]) < 0.02, found
    seen = found["seen"]
    assert left >= seen[0] - 1 and top >= seen[1] - 1 and right <= seen[2] + 1 and bottom <= seen[3] + 1, found
    return found


@pytest.mark.browser
def test_the_page_draws_a_128x128_image_and_a_wide_reference_whole(quick: AppProcess, tmp_path: Path) -> None:
    """The gallery under Generate and the reference box show each image whole (object-fit contain): turn 7 saw a
    128x128 image cut at its top and bottom, and a strip of a reference."""
    from PIL import Image

    from tests.web.test_browser import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS

    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium not found at {CHROMIUM}: apt-get install chromium (see README, Tests)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(quick.url)
            page.locator("#prompt textarea").fill("a small orange triangle on a purple background at the bottom")
            page.locator("#generate").click()  # 128x128, the quick start's default shape, warm already
            page.locator("#info").filter(has_text="128x128, ").wait_for()
            drawn_whole(page, "#gallery img", (128, 128))
            wide = tmp_path / "wide.png"
            Image.new("RGB", (256, 128), (30, 90, 200)).save(wide)
            page.locator("#references input[type=file]").set_input_files(str(wide))
            drawn_whole(page, "#references img", (256, 128))
        finally:
            browser.close()
