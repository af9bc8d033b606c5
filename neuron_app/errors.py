"""Errors as one line for users and logs: the root cause, never a traceback."""

from __future__ import annotations


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line` of the root cause; wrappers such as dynamo's BackendCompilerFailed hide it."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(text[0] if text else '')[:limit]}"
