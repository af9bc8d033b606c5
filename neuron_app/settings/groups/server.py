"""The HTTP server: address, port, share link, queue, basic auth, shutdown, logging, tracing."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr


class ServerSettings(BaseModel):
    """Address, port, share link, the queue and its lanes, basic auth, shutdown, logs, traces."""

    server_name: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 to serve the network.")

    server_port: int = Field(7860, ge=1, le=65535, description="HTTP port.")

    share: bool = Field(False, description="Open a public gradio.live link.")

    behind_proxy: bool = Field(
        False,
        description="A reverse proxy forwards other machines' requests (X-Forwarded-For): the app counts as reachable "
        "by others although it binds to loopback (the page limit and the safety checker turn on).",
    )

    queue_max_size: int = Field(16, ge=1, description="Requests waiting beyond this get 'busy, try again'.")

    concurrency_limit: int = Field(1, ge=1, description="Generations run at once on the device.")
    postprocess_workers: int = Field(
        2,
        ge=0,
        le=64,
        description="Host slots for the work after the device (safety check, marks, encode): a device lane hands "
        "its image over and takes the next request at once, and waits only when all are busy; 0 = in-line.",
    )

    auth_username: str | None = Field(None, description="Basic-auth user (environment only).")

    auth_password: SecretStr | None = Field(None, description="Basic-auth password (environment only).")

    allow_public_without_auth: bool = Field(
        False, description="Permit share=true with no auth (a loud warning is printed)."
    )

    run_history: bool | None = Field(
        None,
        description="Gradio's run history (every run kept in the visitor's browser, /gradio_api/runs); unset: on for a "
        "private server, off on one others can reach (a share link, a non-loopback address, behind a proxy).",
    )

    shutdown_grace_s: float = Field(
        30.0,
        ge=0.0,
        le=3600.0,
        description="On SIGTERM/SIGINT: new requests are refused and running ones get this long to finish "
        "before the server closes.",
    )

    log_level: str = Field("INFO", description="Python logging level.")

    otel_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP endpoint for OpenTelemetry traces (e.g. http://collector:4318); unset: the standard "
        "OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing (the SDK is not imported).",
    )

    strict_env: bool = Field(
        True,
        description="A NEURON_APP_* variable that is not a setting stops the start with one line naming the "
        "closest setting, as an unknown settings-file key does; false: a warning each, and the start goes on.",
    )

    @property
    def device_lanes(self) -> int:
        """Device events the queue runs at once: one per replica (each replica takes one request at a time);
        with replicas = "MIN-MAX", one per replica at the most."""
        return max(self.concurrency_limit, self.replicas_max)

    @property
    def reachable_by_others(self) -> bool:
        """A public link, or bound to an address other machines can reach (not loopback)."""
        import ipaddress

        if self.share or self.behind_proxy:
            return True
        name = self.server_name.strip().strip("[]")
        if name == "localhost":
            return False
        try:
            return not ipaddress.ip_address(name).is_loopback
        except ValueError:
            return True  # a host name other than localhost: assume the network can reach it

    @property
    def edits_compile_on_demand(self) -> bool:
        """`edit_compile_on_demand` in force: the setting, else on only where no one else can reach the server."""
        chosen = getattr(self, "edit_compile_on_demand", None)  # a CompileSettings field of the full Settings
        return (not self.reachable_by_others) if chosen is None else chosen

    @property
    def run_history_on(self) -> bool:
        """What `launch(run_history=...)` gets: the setting, else off where others can reach the server."""
        return (not self.reachable_by_others) if self.run_history is None else self.run_history

    @property
    def auth(self) -> tuple[str, str] | None:
        if self.auth_username and self.auth_password:
            return (self.auth_username, self.auth_password.get_secret_value())
        return None
