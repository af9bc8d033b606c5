"""Who may ask for images, and how many: API keys with names and limits, a per-client page limit, and their counts.

- API keys (`api_key`, and `api_keys` name -> {key, images_per_minute, images_per_day}): a bearer token is
  hashed once and compared with every configured key's hash by `hmac.compare_digest`, all of them every time
  (no early exit, equal lengths), so neither timing nor the order of keys tells which one nearly matched.
  Keys are never logged, shown or counted; their *names* are `/metrics` labels.
- Limits count images (`n`), in sliding windows of 60 s and 24 h kept as a log of (time, images) per caller:
  exact (no burst at a window edge as with fixed windows), and a refusal says when enough images have left the
  window. Images are charged when a request is admitted and given back if it fails or is refused later, so
  a caller pays for images made, not for mistakes. Counts live in this process: a restart forgets them.
- The page (and gradio_client, MCP, and the OpenAI API while no key is configured) is limited per client
  address, one budget per address, `page_images_per_minute`: the address
  Gradio reports (`gr.Request.client.host`). uvicorn takes it from `X-Forwarded-For` only when the connection
  comes from an address in `FORWARDED_ALLOW_IPS` (default 127.0.0.1): behind a proxy on another host every
  user shares the proxy's address unless that variable names it. Unset, the limit is on (10) whenever others can
  reach the app. MCP calls reach the queue through Gradio's own loopback client: web/mcp/tools.py gives that client
  a per-process secret and the MCP caller's address, so an MCP call is charged to its caller's address, the same
  budget as its page calls. The route decides; no header a caller can send (`X-Gradio-User: mcp`) does.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from neuron_app.errors import RateLimited, RequestError, app_error_of
from neuron_app.settings import DEFAULT_KEY_NAME, Settings

PREFIX = "neuron_app"
MINUTE_S, DAY_S = 60.0, 86400.0
#: Page callers kept before idle ones are forgotten (addresses whose windows are empty).
MAX_CALLERS = 4096
#: `page_images_per_minute` unset: this limit whenever others can reach the app, none on loopback.
REACHABLE_IMAGES_PER_MINUTE = 10
#: What web/mcp/tools.py adds to the MCP loopback client's requests: a secret of this process (so no caller can
#: pass for MCP) and the MCP caller's own address; Gradio's direct path for unqueued events keeps the MCP route.
MCP_SECRET = secrets.token_urlsafe(32)
MCP_SECRET_HEADER = "x-neuron-app-mcp"
MCP_CLIENT_HEADER = "x-neuron-app-mcp-client"
MCP_PATH = "/gradio_api/mcp"


def page_limit(settings: Settings) -> int:
    """Images per address per minute in force: the setting, or unset, REACHABLE_IMAGES_PER_MINUTE when reachable."""
    if settings.page_images_per_minute is not None:
        return settings.page_images_per_minute
    return REACHABLE_IMAGES_PER_MINUTE if settings.reachable_by_others else 0


@dataclass(frozen=True)
class Limit:
    images: int  # 0 = no limit
    span_s: float
    words: str  # "per minute", "per day"
    reason: str  # the /metrics label of a refusal: images_per_minute, images_per_day
    unit: str = "images"  # or "bytes" (uploads, web/door/)

    def amount(self, count: int) -> str:
        return f"{count / (1 << 20):.1f} MB" if self.unit == "bytes" else _images(count)


@dataclass
class _Window:
    """The images a caller asked for in the last `span_s` seconds, as (time, images) entries."""

    span_s: float
    entries: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0  # the images of `entries` (a day's window may hold thousands)

    def used(self, now: float) -> int:
        while self.entries and self.entries[0][0] <= now - self.span_s:
            self.total -= self.entries.popleft()[1]
        return self.total

    def add(self, entry: tuple[float, int]) -> None:
        self.entries.append(entry)
        self.total += entry[1]

    def remove(self, entry: tuple[float, int]) -> None:
        """Give a refunded entry back (it may have left the window already)."""
        with contextlib.suppress(ValueError):
            self.entries.remove(entry)
            self.total -= entry[1]

    def wait_s(self, now: float, images: int, limit: int) -> float:
        """Seconds until `images` more fit under `limit` (the oldest entries leave the window first)."""
        excess = self.used(now) + images - limit
        for at, n in self.entries:
            excess -= n
            if excess <= 0:
                return max(0.0, at + self.span_s - now)
        return self.span_s


def _images(count: int) -> str:
    return f"{count} image" if count == 1 else f"{count} images"


class Limiter:
    """Sliding-window image limits for many callers; `charge` is atomic over all of a caller's limits."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # monotonic seconds; the tests pass their own to step through a day
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, float], _Window] = {}
        self.refusals: Counter[tuple[str, str]] = Counter()

    def charge(self, caller: str, images: int, limits: list[Limit], who: str) -> Callable[[], None]:
        """Take `images` from every limit of `caller` or raise `RateLimited` naming the limit; returns a refund."""
        active = [limit for limit in limits if limit.images > 0]
        if not active:
            return lambda: None
        for limit in active:
            if images > limit.images:
                raise RequestError(
                    f"{who} may ask for at most {limit.amount(limit.images)} {limit.words}; this request asks for "
                    f"{limit.amount(images)}",
                    param="n",
                )
        now = self.clock()
        with self._lock:
            if len(self._windows) > MAX_CALLERS:
                self._forget_idle(now)
            windows = [self._windows.setdefault((caller, limit.span_s), _Window(limit.span_s)) for limit in active]
            for limit, window in zip(active, windows, strict=True):
                if window.used(now) + images > limit.images:
                    wait = math.ceil(window.wait_s(now, images, limit.images))
                    self.refusals[(caller, limit.reason)] += 1
                    raise RateLimited(
                        f"{who} is over its limit of {limit.amount(limit.images)} {limit.words}; retry in {wait} s",
                        retry_after_s=wait,
                    )
            entry = (now, images)
            for window in windows:
                window.add(entry)

        def refund() -> None:
            with self._lock:
                for window in windows:
                    window.remove(entry)

        return refund

    def refusal_counts(self) -> dict[tuple[str, str], int]:
        """(caller, reason) -> refusals, copied under the lock (read at scrape time while requests come in)."""
        with self._lock:
            return dict(self.refusals)

    def _forget_idle(self, now: float) -> None:
        for key in [key for key, window in self._windows.items() if window.used(now) == 0]:
            del self._windows[key]


@dataclass(frozen=True)
class _Key:
    name: str
    digest: bytes
    limits: list[Limit]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class Access:
    """One app's keys, limits and their counts; shared by the page, the OpenAI API and /metrics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys: list[_Key] = []
        if settings.api_key is not None:  # the old single key: unnamed, unlimited
            self.keys.append(_Key(DEFAULT_KEY_NAME, _digest(settings.api_key.get_secret_value()), []))
        for name, entry in settings.api_keys.items():
            limits = [
                Limit(entry.images_per_minute, MINUTE_S, "per minute", "images_per_minute"),
                Limit(entry.images_per_day, DAY_S, "per day", "images_per_day"),
            ]
            self.keys.append(_Key(name, _digest(entry.key.get_secret_value()), limits))
        self.page_limits = [Limit(page_limit(settings), MINUTE_S, "per minute", "images_per_minute")]
        self.limiter = Limiter()
        self._lock = threading.Lock()
        self.images: Counter[str] = Counter({key.name: 0 for key in self.keys})
        self.refused: Counter[tuple[str, str]] = Counter()
        self.auth_failures = 0
        self.page_images = 0
        self.content_refused: Counter[tuple[str, str]] = Counter()

    # --- API keys ---------------------------------------------------------------------------------
    @property
    def keys_required(self) -> bool:
        return bool(self.keys)

    def identify(self, token: str) -> str | None:
        """The name of the key `token` is, or None; every key is compared, in constant time."""
        digest = _digest(token)
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key.name
        if found is None:
            with self._lock:
                self.auth_failures += 1
        return found

    @contextlib.contextmanager
    def api_images(self, name: str | None, client: str | None, images: int) -> Iterator[None]:
        """Charge an OpenAI API request to its key (or, with no keys configured, to the client's address under
        the page limit); given back if the body raises; counted per key name when it succeeds."""
        refund = self._charge_api(name, client, images)
        try:
            yield
        except BaseException:
            refund()
            raise
        with self._lock:
            self.images[name or "(none)"] += images

    def _charge_api(self, name: str | None, client: str | None, images: int) -> Callable[[], None]:
        if name is None:
            caller = client or "unknown"  # one budget per address, shared with the page
            return self.limiter.charge(f"page:{caller}", images, self.page_limits, f"address {caller}")
        key = next(k for k in self.keys if k.name == name)
        return self.limiter.charge(f"key:{name}", images, key.limits, f"key {name!r}")

    def api_room(self, name: str | None, client: str | None) -> None:
        """RateLimited now if the caller could not be charged one image: checked before a large body is read."""
        self._charge_api(name, client, 1)()

    def api_refused(self, name: str | None, reason: str | None) -> None:
        """An API request refused after its key was known (content policy, invalid value, ...)."""
        with self._lock:
            self.refused[(name or "(none)", reason or "refused")] += 1

    # --- the page, gradio_client and MCP --------------------------------------------------------------
    @contextlib.contextmanager
    def page_images_for(self, request: Any, images: int) -> Iterator[None]:
        """Charge a Gradio event to the caller's address; given back if it raises."""
        caller = page_caller(request)
        refund = self.limiter.charge(f"page:{caller}", images, self.page_limits, f"address {caller}")
        try:
            yield
        except BaseException:
            refund()
            raise
        with self._lock:
            self.page_images += images

    def observe_error(self, exc: BaseException, entry: str) -> None:
        """Count a content-policy refusal (`ContentRefused`, by what it refused: prompt or image) from any entry."""
        known = app_error_of(exc)
        if known is not None and known.code == "content_policy_violation":
            with self._lock:
                self.content_refused[(entry, "prompt" if known.param == "prompt" else "image")] += 1

    # --- /metrics ------------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        """Prometheus families (registered on the app's registry): names of keys, never keys."""
        with self._lock:
            images, refused, page = dict(self.images), dict(self.refused), self.page_images
            failures, content = self.auth_failures, dict(self.content_refused)
        limited = self.limiter.refusal_counts()
        for (caller, reason), count in limited.items():
            kind, _, name = caller.partition(":")
            if kind == "key":
                refused[(name, reason)] = refused.get((name, reason), 0) + count
        family = CounterMetricFamily(
            f"{PREFIX}_api_images", "Images made through the OpenAI-compatible API, per API key name.", labels=["key"]
        )
        for name, count in sorted(images.items()):
            family.add_metric([name], count)
        yield family
        family = CounterMetricFamily(
            f"{PREFIX}_api_refusals",
            "OpenAI-compatible API requests refused, per API key name and reason (images_per_minute, images_per_day, "
            "or the error code).",
            labels=["key", "reason"],
        )
        for (name, reason), count in sorted(refused.items()):
            family.add_metric([name, reason], count)
        yield family
        yield CounterMetricFamily(
            f"{PREFIX}_api_auth_failures", "OpenAI-compatible API requests with a missing or wrong key.", value=failures
        )
        yield CounterMetricFamily(
            f"{PREFIX}_page_images", "Images made through the page, gradio_client and MCP.", value=page
        )
        page_limited = sum(n for (caller, _r), n in limited.items() if caller.startswith("page:"))
        yield CounterMetricFamily(
            f"{PREFIX}_page_rate_limited",
            "Page, gradio_client and MCP requests refused by page_images_per_minute (all addresses together).",
            value=page_limited,
        )
        family = CounterMetricFamily(
            f"{PREFIX}_content_refused",
            "Requests refused by the content policy, per entry (page, gradio_api, mcp, openai) and what was "
            "refused (prompt: a blocked term; image: the safety checker).",
            labels=["entry", "what"],
        )
        for entry in ("page", "gradio_api", "mcp", "openai"):
            family.add_metric([entry, "prompt"], content.get((entry, "prompt"), 0))
        for (entry, what), count in sorted(content.items()):
            if what != "prompt":
                family.add_metric([entry, what], count)
        yield family

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only (no duplicate-name check at registration)


def _client_host(request: Any) -> str:
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "unknown"


def mcp_caller(request: Any) -> str | None:
    """The MCP caller's address when a Gradio event came through the MCP route, else None."""
    headers = getattr(request, "headers", None) or {}
    token = headers.get(MCP_SECRET_HEADER)
    if token is not None and hmac.compare_digest(token.encode("utf-8", "surrogatepass"), MCP_SECRET.encode()):
        return headers.get(MCP_CLIENT_HEADER) or "unknown"
    path = getattr(getattr(request, "url", None), "path", None)
    if isinstance(path, str) and path.startswith(MCP_PATH):  # Gradio ran the event on the MCP request itself
        return _client_host(request)
    return None


def page_caller(request: Any) -> str:
    """Who a Gradio event is charged to: its client address, or for an MCP call the MCP caller's address."""
    mcp = mcp_caller(request)
    return _client_host(request) if mcp is None else mcp


def entry_of(request: Any, default: str) -> str:
    """The entry a Gradio event came through: `default` (page or gradio_api), or mcp."""
    return default if mcp_caller(request) is None else "mcp"


def gradio_login(scope: Any) -> bool:
    """The request carries Gradio's login cookie of a known session (Gradio's own check, `get_current_user`, which
    its heartbeat route does not ask for: web/guard.py asks it). Starlette put Gradio's app in the scope."""
    from http.cookies import CookieError, SimpleCookie

    app = scope.get("app")
    tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
    if not isinstance(tokens, dict) or cookie_id is None:
        return False  # a Gradio upgrade moved them: the heartbeat stays behind the login, closed
    jar: SimpleCookie = SimpleCookie()
    for name, value in scope.get("headers", []):
        if name.lower() == b"cookie":
            with contextlib.suppress(CookieError):
                jar.load(value.decode("latin-1"))
    names = (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}")
    return any(name in jar and tokens.get(jar[name].value) is not None for name in names)
