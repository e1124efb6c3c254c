"""Can the provider link carry this JSON value? One I/O-free answer for every
place hostile JSON enters (both doors, the broker's facade, a provider's
events, the offer a lane is about to send).

JSON as RFC 8259 parses it is wider than what funduq can pass on:

* a lone surrogate (``"\\ud800"``, in a value or a key) is valid JSON text
  but no UTF-8 string: the link's frames, SQLite's text columns and
  protobuf strings all refuse it (I-JSON, RFC 7493 §2.1, forbids it too);
* ``NaN`` / ``Infinity`` / ``-Infinity`` are not JSON at all, yet Python's
  ``json.loads`` accepts them and the link's encoder turns them into
  ``null`` -- the provider would get a different value than was sent;
* nesting past ``MAX_NESTING`` levels (100): nothing a real caller sends
  comes near it, and every recursive walk on the way stays far from Python's
  recursion limit. (Protobuf stops at 100 *message* levels, two per JSON
  level, so the A2A door refuses params somewhat shallower, as the SDK does.)

`problem(value)` names the first such thing (with where it is, as a JSONPath
like ``$.messages[0].id``) or answers None. It walks iteratively, so a value
nested past Python's recursion limit is answered, not crashed on. `loads`
parses text refusing the non-finite constants.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["MAX_NESTING", "NotCarriable", "loads", "problem"]

#: Deepest nesting of JSON containers funduq takes in from a caller (a scalar
#: is 0, `{}` 1): the AG-UI door's limit from the start.
MAX_NESTING = 100


class NotCarriable(ValueError):
    """JSON text or a value the link cannot carry; the message says what and where."""


def _refuse_constant(name: str) -> Any:
    raise NotCarriable(f"{name} is not JSON (JSON numbers are finite)")


#: `json.loads(..., parse_constant=_refuse_constant)`'s decoder, made once
#: (`json.loads` with an option builds a decoder for each call).
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def loads(text: str | bytes) -> Any:
    """`json.loads`, refusing NaN/Infinity/-Infinity (NotCarriable). Other
    failures raise as `json.loads` raises them (ValueError, RecursionError).
    (`json.loads`' own steps before its decoder, with the decoder made once.)"""
    if isinstance(text, str):
        if text.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    elif isinstance(text, bytes | bytearray):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    else:
        return json.loads(text, parse_constant=_refuse_constant)  # its TypeError
    return _DECODER.decode(text)


def _where(path: tuple[Any, ...] | None) -> str:
    """`$.a[0].b` from the linked path (parent, step) built during the walk."""
    steps: list[Any] = []
    while path is not None:
        path, step = path
        steps.append(step)
    out = "$"
    for step in reversed(steps):
        if isinstance(step, int):
            out += f"[{step}]"
        elif step.isidentifier():
            out += "." + step
        else:
            out += "[" + json.dumps(step) + "]"  # escaped: the key may hold a surrogate
    return out


def _not_utf8(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def problem(value: Any, *, max_nesting: int | None = MAX_NESTING) -> str | None:
    """Why the link cannot carry `value` (a parsed JSON value), or None.

    `max_nesting` bounds the depth (None: no bound); a provider's events get
    a deeper one (`agui.EVENT_MAX_NESTING`): the record keeps them as sent and
    the A2A views degrade past theirs."""
    limit = math.inf if max_nesting is None else max_nesting
    if _clean(value, limit):
        return None
    return _describe(value, limit)


def _bad_scalar(item: Any) -> bool:
    if isinstance(item, str):
        return not item.isascii() and _not_utf8(item)
    return isinstance(item, float) and not math.isfinite(item)


def _clean(value: Any, limit: float) -> bool:
    """The fast walk (every event and body takes it): True when nothing is
    wrong. Scalars are checked in place, only nested containers are stacked
    (a flat event stacks nothing); exact types first (what `json.loads`
    makes), isinstance for anything else. Only a string that is not ASCII
    can fail to be UTF-8: `isascii` is the check nearly every string takes."""
    kind = type(value)
    if kind is not dict and kind is not list and not isinstance(value, dict | list | tuple):
        return not _bad_scalar(value)
    stack: list[tuple[Any, int]] = []
    push = stack.append
    item, depth = value, 1
    while True:
        if depth > limit:
            return False
        if type(item) is dict or isinstance(item, dict):
            for key, child in item.items():
                if type(key) is not str or not key.isascii():
                    if isinstance(key, str) and _not_utf8(key):
                        return False
                kind = type(child)
                if kind is str:
                    if not child.isascii() and _not_utf8(child):
                        return False
                elif kind is int or kind is bool or child is None:
                    continue
                elif kind is dict or kind is list or isinstance(child, dict | list | tuple):
                    push((child, depth + 1))
                elif _bad_scalar(child):
                    return False
        else:
            for child in item:
                kind = type(child)
                if kind is str:
                    if not child.isascii() and _not_utf8(child):
                        return False
                elif kind is int or kind is bool or child is None:
                    continue
                elif kind is dict or kind is list or isinstance(child, dict | list | tuple):
                    push((child, depth + 1))
                elif _bad_scalar(child):
                    return False
        if not stack:
            return True
        item, depth = stack.pop()


def _describe(value: Any, limit: float) -> str:
    """The slow walk, once something is wrong: what, and where."""
    stack: list[tuple[Any, int, Any]] = [(value, 0, None)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            if _not_utf8(item):
                return f"a lone surrogate (not UTF-8 text) at {_where(path)}"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{item!r} at {_where(path)} is not a JSON number"
        elif isinstance(item, dict):
            depth += 1
            if depth > limit:
                return f"nesting deeper than {limit} levels at {_where(path)}"
            for key, child in item.items():
                if isinstance(key, str) and _not_utf8(key):
                    return f"a lone surrogate (not UTF-8 text) in a key at {_where(path)}"
                stack.append((child, depth, (path, key)))
        elif isinstance(item, list | tuple):
            depth += 1
            if depth > limit:
                return f"nesting deeper than {limit} levels at {_where(path)}"
            stack.extend((child, depth, (path, i)) for i, child in enumerate(item))
    return "something the link cannot carry"  # pragma: no cover - _clean and this agree
