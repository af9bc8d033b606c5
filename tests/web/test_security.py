"""Security: nobody let in without credentials, no secret in any log, a fixed model, files kept at home.

Runs the real app on 127.0.0.1: in-process (basic auth on, a Hub token set) and as `python app.py`
with its secrets in the environment, whose whole output is searched for them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gradio_client import Client
from gradio_client.exceptions import AuthenticationError
from openai import OpenAI
from PIL import Image
from pydantic import SecretStr

from neuron_app.engine.cache.manifest import ARTIFACT_DIRS
from neuron_app.errors import SettingsError
from neuron_app.settings import SECRET_FIELDS, Settings, load_settings
from neuron_app.web.server import resolve_auth
from tests.support import PATIENT_HTTP, ROOT, AppProcess

USER = "alice"
PASSWORD = f"pw-{uuid.uuid4().hex}"
HF_TOKEN = f"hf_{uuid.uuid4().hex}"
API_KEY = f"sk-{uuid.uuid4().hex}"
SECRETS = (PASSWORD, HF_TOKEN, API_KEY)
#: Words that would mean an event lets a caller choose what is loaded or where it runs.
FORBIDDEN_INPUTS = ("model", "revision", "token", "backend", "device", "cache", "path")


@pytest.fixture(scope="module")
def auth_app(launch_tiny: Callable[..., Any]) -> Any:
    """The tiny app with basic auth and a Hub token (unused by the local tiny model, but configured)."""
    return launch_tiny(auth_username=USER, auth_password=PASSWORD, hf_token=HF_TOKEN, api_key=API_KEY)


@pytest.fixture(scope="module")
def auth_client(auth_app: Any) -> Client:
    return Client(auth_app.url, auth=(USER, PASSWORD), verbose=False, httpx_kwargs=PATIENT_HTTP)


# --- share and auth policy ----------------------------------------------------------------------


def test_share_without_auth_is_refused(make_settings: Callable[..., Settings]) -> None:
    """share=true with no credentials refuses to start, naming the variables to set or the waiver."""
    with pytest.raises(SettingsError, match="NEURON_APP_AUTH_USERNAME and NEURON_APP_AUTH_PASSWORD"):
        resolve_auth(make_settings(share=True))


def test_share_without_auth_waived_warns_loudly(
    make_settings: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    """With allow_public_without_auth the public link is served without auth, under a WARNING."""
    with caplog.at_level(logging.WARNING, logger="neuron_app.web.server"):
        assert resolve_auth(make_settings(share=True, allow_public_without_auth=True)) is None
    assert any(r.levelno == logging.WARNING and "WITHOUT authentication" in r.getMessage() for r in caplog.records), (
        caplog.text
    )


def test_share_with_auth_uses_it_quietly(
    make_settings: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    """With credentials, share=true passes them to Gradio, and nothing about them is logged."""
    with caplog.at_level(logging.DEBUG):
        auth = resolve_auth(make_settings(share=True, auth_username=USER, auth_password=PASSWORD))
    assert auth == (USER, PASSWORD)
    assert PASSWORD not in caplog.text and "WITHOUT" not in caplog.text


def test_app_py_refuses_public_link_without_auth(tmp_path: Path) -> None:
    """`python app.py` with NEURON_APP_SHARE=true and no auth exits 2 with one clear line, before any
    model work or network access (no tunnel is opened)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    env |= {"NEURON_APP_SHARE": "true", "NEURON_APP_MODEL": "tiny", "NEURON_APP_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: share=true opens a public link")
    assert "Traceback" not in done.stderr and not (tmp_path / "models").exists()


# --- secrets ---------------------------------------------------------------------------------------


def test_secrets_are_secretstr_and_never_shown(make_settings: Callable[..., Settings]) -> None:
    """auth_password and hf_token are SecretStr: repr, str and JSON dumps of the settings mask them."""
    settings = make_settings(auth_username=USER, auth_password=PASSWORD, hf_token=HF_TOKEN, api_key=API_KEY)
    assert isinstance(settings.auth_password, SecretStr) and isinstance(settings.hf_token, SecretStr)
    assert isinstance(settings.api_key, SecretStr)
    for shown in (repr(settings), str(settings), settings.model_dump_json(), str(settings.model_dump())):
        for secret in SECRETS:
            assert secret not in shown


@pytest.mark.parametrize("field", SECRET_FIELDS)
def test_settings_file_refuses_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    """A settings file holding a secret is refused (secrets come from the environment only), and the
    error names the field and the variable to use, without echoing the value."""
    secret = f"leak-{uuid.uuid4().hex}"
    toml = tmp_path / "settings.toml"
    toml.write_text(f'model = "tiny"\n{field} = "{secret}"\n')
    monkeypatch.setenv("NEURON_APP_SETTINGS", str(toml))
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert f"{field} must not be set in the settings file" in message
    assert f"NEURON_APP_{field.upper()}" in message and secret not in message


def test_no_secret_in_logs_while_serving(
    auth_app: Any, auth_client: Client, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Logging in, loading the model, compiling, generating and reading the status, at DEBUG level on every
    logger: neither the password nor the Hub token appears in any log record or on stdout/stderr."""
    with caplog.at_level(logging.DEBUG):
        Client(auth_app.url, auth=(USER, PASSWORD), verbose=False, httpx_kwargs=PATIENT_HTTP)  # a fresh login
        _path, info = auth_client.predict("a red fox", "64x64", 4, 3, api_name="/generate")
        status = auth_client.predict(api_name="/status")
        api = OpenAI(base_url=auth_app.url + "v1", api_key=API_KEY, max_retries=0)
        assert api.images.generate(prompt="a red fox", size="64x64", extra_body={"seed": 3}).data[0].b64_json
        with pytest.raises(openai.AuthenticationError):  # a wrong key is refused without echoing the right one
            OpenAI(base_url=auth_app.url + "v1", api_key=API_KEY[:-1], max_retries=0).models.list()
    assert info["resolution"] == "64x64" and status["loaded"]
    out, err = capfd.readouterr()
    everything = caplog.text + out + err + str(status) + str(info)
    assert "neuron_app" in caplog.text  # the app did log (the check is not vacuous)
    for secret in SECRETS:
        assert secret not in everything


# --- who gets in ------------------------------------------------------------------------------------


def test_auth_rejects_clients_without_valid_credentials(auth_app: Any) -> None:
    """With auth set: no credentials, a wrong password, and raw HTTP without a session are all refused
    (config, API info, the generate route); the right credentials are accepted."""
    with pytest.raises(AuthenticationError):
        Client(auth_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    with pytest.raises(ValueError, match="Could not login"):
        Client(auth_app.url, auth=(USER, "wrong"), verbose=False, httpx_kwargs=PATIENT_HTTP)
    for method, path in (("GET", "config"), ("GET", "gradio_api/info"), ("POST", "gradio_api/call/generate")):
        reply = httpx.request(method, auth_app.url + path, json={"data": ["x", "64x64", 4, 0]}, timeout=10)
        assert reply.status_code == 401, (path, reply.status_code)
    assert (
        Client(auth_app.url, auth=(USER, PASSWORD), verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
            api_name="/status"
        )["model"]
        == "tiny"
    )


def test_files_outside_the_app_folders_are_not_served(auth_app: Any) -> None:
    """Even logged in, Gradio's file route serves nothing outside its own folders (the app allows only
    cache_dir/outputs besides Gradio's cache)."""
    with httpx.Client(base_url=auth_app.url, timeout=10) as http:
        http.post("login", data={"username": USER, "password": PASSWORD}).raise_for_status()
        assert http.get("gradio_api/info").status_code == 200  # logged in
        for target in ("/etc/passwd", str(ROOT / "settings.toml"), str(auth_app.settings.cache_dir / "manifest.json")):
            assert http.get(f"gradio_api/file={target}").status_code in (403, 404), target


# --- a fixed model ---------------------------------------------------------------------------------------


def test_api_surface_is_generate_and_status_only(auth_app: Any, auth_client: Client) -> None:
    """The named API is exactly `generate(prompt, resolution, steps, seed[, lora, lora_scale, loras])`, `edit(prompt,
    images, resolution, steps, seed[, lora, lora_scale, loras])` and `status()`; no unnamed endpoint; no event anywhere
    (page included) takes an input that could pick the model, its revision,
    a token, the device or a path."""
    api = auth_client.view_api(return_format="dict", print_info=False)
    assert set(api["named_endpoints"]) == {"/generate", "/edit", "/inpaint", "/status", "/cancel_job"}
    assert [p["parameter_name"] for p in api["named_endpoints"]["/cancel_job"]["parameters"]] == ["job_id"]
    assert not api["unnamed_endpoints"]
    params = api["named_endpoints"]["/generate"]["parameters"]
    assert [(p["parameter_name"], p["component"]) for p in params] == [
        ("prompt", "Textbox"),
        ("resolution", "Textbox"),
        ("steps", "Number"),
        ("seed", "Number"),
        ("lora", "Textbox"),  # a configured LoRA style name, validated against the list (#15)
        ("lora_scale", "Number"),
        ("loras", "Json"),  # several styles: [{"name", "scale"}], validated the same way (#32)
    ]
    assert api["named_endpoints"]["/status"]["parameters"] == []
    edit = api["named_endpoints"]["/edit"]["parameters"]
    assert [(p["parameter_name"], p["component"]) for p in edit] == [
        ("prompt", "Textbox"),
        ("images", "File"),
        ("resolution", "Textbox"),
        ("steps", "Number"),
        ("seed", "Number"),
        ("lora", "Textbox"),
        ("lora_scale", "Number"),
        ("loras", "Json"),
    ]
    inpaint = api["named_endpoints"]["/inpaint"]["parameters"]
    assert [(p["parameter_name"], p["component"]) for p in inpaint] == [
        ("prompt", "Textbox"),
        ("image", "File"),
        ("mask", "File"),
        ("resolution", "Textbox"),
        ("steps", "Number"),
        ("seed", "Number"),
        ("lora", "Textbox"),
        ("lora_scale", "Number"),
        ("strength", "Number"),
        ("loras", "Json"),
    ]
    for fn in auth_app.demo.fns.values():
        for block in fn.inputs:
            names = " ".join(str(getattr(block, a, "") or "") for a in ("label", "elem_id")).lower()
            assert not any(word in names for word in FORBIDDEN_INPUTS), (fn.name, names)


def test_gradio_cache_is_cleaned(auth_app: Any) -> None:
    """Gradio deletes its temporary files older than an hour, every hour, so a long-running demo does not
    fill the disk; the app's own outputs are pruned by ImageStore."""
    assert auth_app.demo.delete_cache == (3600, 3600)


def test_png_metadata_records_how_the_image_was_made(auth_client: Client, auth_app: Any) -> None:
    """The PNG the API returns carries prompt, seed, steps, size and model as text chunks (PIL reads them
    back), and the server's copy is written under cache_dir/outputs."""
    path, info = auth_client.predict("a lighthouse at dawn", "64x64", 4, 42, api_name="/generate")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (64, 64)
        text = dict(image.text)
    assert {k: text[k] for k in ("prompt", "seed", "steps", "size", "model")} == {
        "prompt": "a lighthouse at dawn",
        "seed": "42",
        "steps": "4",
        "size": "64x64",
        "model": "tiny",
    }
    assert info["seed"] == 42
    saved = list((auth_app.settings.cache_dir / "outputs").glob("64x64-42-*.png"))
    assert len(saved) == 1


def test_image_store_keeps_the_newest(tmp_path: Path, make_settings: Callable[..., Any]) -> None:
    """Outputs stay bounded: files already in the folder (an earlier run) count, and the oldest go first."""
    from neuron_app.engine.output.images import ImageStore
    from neuron_app.engine.records import CacheResult, GenerationRecord
    from neuron_app.engine.trust.marks import Marker

    folder = tmp_path / "outputs"
    folder.mkdir()
    for i, name in enumerate(["old-a.png", "old-b.png"]):
        (folder / name).write_bytes(b"png")
        os.utime(folder / name, (1_000_000 + i, 1_000_000 + i))
    store = ImageStore(folder, keep=3, marker=Marker(make_settings()))  # its C2PA chain in the test's cache

    def record(seed: int) -> GenerationRecord:  # a real record: every field write_png reads, now and later
        image = Image.new("RGB", (8, 8))
        return GenerationRecord("8x8", 1, seed, "p", CacheResult.MISS, False, 0.0, 0.0, 0.0, 0, "tiny", image=image)

    saved = [store.save(record(seed)) for seed in range(3)]
    assert sorted(p.name for p in folder.glob("*.png")) == sorted(p.name for p in saved)  # the two old ones went


def test_outputs_are_served_in_place(auth_app: Any) -> None:
    """The API's image is served from the outputs folder itself (Gradio's static paths): no hash and copy into
    Gradio's cache on every answer. The answer names it by its alias (web/door/: no server path), and its URL
    downloads the server's own file, byte-identical."""
    import httpx

    client = Client(auth_app.url, auth=(USER, PASSWORD), verbose=False, download_files=False, httpx_kwargs=PATIENT_HTTP)
    image, _info = client.predict("a lighthouse at dawn", "64x64", 4, 7, api_name="/generate")
    (saved,) = (auth_app.settings.cache_dir / "outputs").glob("64x64-7-*.png")
    assert image["path"] == f"/@outputs/{saved.name}", image
    served = httpx.get(image["url"], auth=(USER, PASSWORD), cookies=client.cookies)
    assert served.status_code == 200 and served.content == saved.read_bytes()


# --- the real entry point ------------------------------------------------------------------------------------


def test_app_py_keeps_secrets_out_of_its_output_and_files_at_home(
    run_app_py: Callable[..., AppProcess], tmp_path: Path
) -> None:
    """`python app.py` with auth and a Hub token in the environment, logging at DEBUG: from start-up through
    a generation to a SIGTERM shutdown, its stdout/stderr never contain either secret; it writes only inside
    cache_dir (outputs/, gradio-tmp/, c2pa/, jobs.sqlite3, the compilers' artifact folders, the manifest), nothing
    in its TMPDIR (Gradio serves the PNG straight from cache_dir/outputs, an allowed path)."""
    tmpdir = tmp_path / "process-tmp"
    tmpdir.mkdir()
    app = run_app_py(
        resolutions=["64x64"],
        log_level="DEBUG",
        auth_username=USER,
        auth_password=PASSWORD,
        hf_token=HF_TOKEN,
        env={"TMPDIR": str(tmpdir)},
    )
    app.wait_up()
    client = Client(app.url, auth=(USER, PASSWORD), verbose=False, httpx_kwargs=PATIENT_HTTP)
    _path, info = client.predict("a quiet harbour", "64x64", 4, 5, api_name="/generate")
    assert info["model"] == "tiny"
    app.proc.send_signal(signal.SIGTERM)
    assert app.proc.wait(timeout=60) == 0
    output = app.output()
    assert "DEBUG" in output and "generate 64x64" in output  # verbose logging really was on
    for secret in SECRETS:
        assert secret not in output

    cache = app.cache_dir
    outputs = list((cache / "outputs").glob("*.png"))
    assert len(outputs) == 1
    assert (cache / "gradio-tmp").is_dir()  # GRADIO_TEMP_DIR, set by server.prepare_environment
    written = {p.name for p in cache.iterdir()}
    # c2pa/: the per-install signing chain (engine/trust/c2pa_signing.py); jobs.sqlite3: the OpenAI API's async jobs
    state = {"c2pa", "jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm", "jobs.sqlite3-journal"}
    state |= {"load-times.json"}  # the model's last load time, for "loading the model (~N s)": no secret in it
    state |= {
        "usage.sqlite3",
        "usage.sqlite3-wal",
        "usage.sqlite3-shm",
    }  # usage per key per day (web/jobs/usage_book.py)
    state |= {"state.lock", "job-images"}  # this process's hold on its state (web/jobs/sqlite_file.py), job PNGs
    expected = {"models", "outputs", "gradio-tmp", "manifest.json", "manifest.json.lock", *ARTIFACT_DIRS, *state}
    assert written <= expected, written
    assert list(tmpdir.iterdir()) == []


def test_the_heartbeat_is_behind_the_login(auth_app: Any) -> None:
    """Row 34: Gradio's `/gradio_api/heartbeat/{id}` never ends and asked for no login with page auth on; now a
    401 without the login cookie, and the stream (a long-lived answer) with it."""
    url = auth_app.url + "gradio_api/heartbeat/zz"
    assert httpx.get(url, timeout=60).status_code == 401
    with httpx.Client(timeout=60) as client:
        assert client.post(auth_app.url + "login", data={"username": USER, "password": PASSWORD}).status_code == 200
        with client.stream("GET", url) as stream:
            assert stream.status_code == 200
            assert next(stream.iter_lines()) == "data: ALIVE"
