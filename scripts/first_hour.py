"""The README's first hour, measured: `NEURON_APP_SETTINGS=quickstart.toml python app.py` in a fresh cache folder,
seconds to the page, to the model, to the first image (gradio_client: a compile, `miss`), the openai SDK's image
on the same shape, then a restart on the same folder and its first image (`disk`). Prints one JSON object.

    python scripts/first_hour.py            # takes a few minutes on a 2-core machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neuron_app.bench.common import free_port  # noqa: E402


def start(cache: Path, port: int, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    env |= {"NEURON_APP_SETTINGS": "quickstart.toml", "NEURON_APP_CACHE_DIR": str(cache)}
    env |= {"NEURON_APP_SERVER_PORT": str(port)}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    return proc, t0


def wait(predicate, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("timed out")


def run_once(cache: Path, label: str, openai_too: bool) -> dict[str, object]:
    from gradio_client import Client

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc, t0 = start(cache, port, cache.parent / f"{label}.log")
    try:
        wait(lambda: urllib.request.urlopen(url + "gradio_api/info", timeout=2).status == 200)
        page_s = time.monotonic() - t0
        client = Client(url, verbose=False, httpx_kwargs={"timeout": 60})  # httpx's 5 s: too short on a busy machine
        wait(lambda: client.predict(api_name="/status")["loaded"])
        model_s = time.monotonic() - t0
        t1 = time.monotonic()
        _path, info = client.predict("a lighthouse at dawn", "256x256", 4, 7, api_name="/generate")
        row: dict[str, object] = {
            "page_s": round(page_s, 1),
            "model_loaded_s": round(model_s, 1),
            "first_image_s": round(time.monotonic() - t1, 1),
            "cache": info["cache"],
        }
        if openai_too:
            from openai import OpenAI

            t2 = time.monotonic()
            OpenAI(base_url=url + "v1", api_key="unused", max_retries=0).images.generate(prompt="a fox", size="256x256")
            row["openai_image_s"] = round(time.monotonic() - t2, 1)
        return row
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)  # --help says what it does, and starts nothing
    with tempfile.TemporaryDirectory(prefix="first-hour-") as folder:
        cache = Path(folder) / "cache"
        result = {
            "load_average": os.getloadavg()[0],
            "cores": os.cpu_count(),
            "first_start": run_once(cache, "first", openai_too=True),
            "restart": run_once(cache, "restart", openai_too=False),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
