"""Request bodies parsed as llama-server would parse them, so a refusal comes from kvproxy.

Python's ``json`` accepts ``NaN``, ``Infinity`` and integers of any size, and fails with a
RecursionError on deep nesting; llama-server's JSON parser refuses the first three (and
``requests`` cannot even send them), so kvproxy answers each with a clear 400 before it
takes the slot.
"""
from __future__ import annotations

import json
import math
from typing import Any

from kvproxy.errors import ClientError


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ClientError(f"request body holds {text}, which is not a finite JSON number")
    return number


def _int_as_double(text: str) -> int:
    """An integer llama-server can hold: it reads numbers past 64 bits as doubles."""
    number = int(text)
    try:
        float(number)
    except OverflowError:
        raise ClientError(f"request body holds {text[:20]}..., which is not a finite JSON number") \
            from None
    return number


def _constant(name: str) -> float:
    raise ClientError(f"request body holds {name}, which is not a finite JSON number")


def parse(data: bytes) -> Any:
    """Strict JSON: finite numbers only, nesting Python can follow; a ``ClientError`` otherwise."""
    try:
        return json.loads(data, parse_constant=_constant, parse_float=_finite_float,
                          parse_int=_int_as_double)
    except ClientError:
        raise
    except RecursionError:
        raise ClientError("request body is nested too deeply") from None
    except ValueError:  # invalid JSON or UTF-8
        raise ClientError("request body is not valid JSON") from None
