"""JSON text that is no Unicode: a lone surrogate escape such as "\\ud800".

Python's json module accepts the escape and makes a str that cannot be encoded as UTF-8, so it
would fail later, as an HTTP 500 (Triton's parser refuses it; encoding it for gRPC raises). The
fronts refuse it up front as the client's error, naming where it is.
"""
from __future__ import annotations

from kvforge.errors import quote


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate(value, path: str = "") -> tuple[str | None, str] | None:
    """(where, error) for the first string or field name of a parsed JSON value that holds a lone
    surrogate, or None. `where` is dot-separated, as the OpenAI API's `param` (messages.0.content);
    None for the whole body."""
    if isinstance(value, str):
        if _is_text(value):
            return None
        return path or None, (f"{path or 'the request body'} is not valid Unicode text: "
                              f"it holds a lone surrogate escape, got {quote(value)}")
    if isinstance(value, dict):
        for key in value:
            if not _is_text(key):
                return path or None, f"the field name {quote(key)} is not valid Unicode text (a lone surrogate escape)"
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), item) for i, item in enumerate(value))
    else:
        return None
    return next((found for key, item in items
                 if (found := lone_surrogate(item, f"{path}.{key}" if path else key)) is not None), None)
