"""`cancel_job`: the OpenAI API's job cancel as a named endpoint, so Gradio's MCP server offers it as a tool (and
gradio_client as /cancel_job).

An MCP client has no API key: it reaches the jobs made without one (while no key is configured); with keys, a
job is visible only to its own key, so MCP gets the same "no job" as for an unknown id. Added to the built page
(`with demo:`) because the jobs belong to the OpenAI API, which is built after it.
"""

from __future__ import annotations

from typing import Any

from neuron_app.errors import AppError
from neuron_app.web.jobs.jobs import Jobs


def add_cancel_job(demo: Any, jobs: Jobs) -> None:
    import gradio as gr

    def cancel_job(job_id: str) -> dict[str, Any]:
        """Cancel an image job by its id. A queued job is dropped; a running one stops at its next denoising step
        and its images are never stored. Returns at once, the job as it now reads: status "cancelled", how it
        ended, or "running" with cancel_requested true (read it again to see it stop).

        Args:
            job_id: the job's id ("imgjob_..."), from an asynchronous request (header Prefer: respond-async) to
                /v1/images/generations or /v1/images/edits.
        """
        try:
            return jobs.cancel(str(job_id), None)
        except AppError as exc:
            raise gr.Error(str(exc)) from None

    with demo:
        gr.api(cancel_job, api_name="cancel_job", concurrency_limit=None, queue=False)
