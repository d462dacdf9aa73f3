"""What the parsers of every request shape share: the error they raise and its wording.

Any malformed body raises ``RequestError`` and nothing else, so the router can answer 400
without guarding against surprises; the helpers here check one JSON value each and name
the place in the body that is wrong.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import msgspec

from smetric.core.errors import UserError

# A message as the renderers take it: OpenAI-shaped, ``role`` and ``content`` strings (parts
# already flattened to text), optionally ``tool_calls`` and whatever other keys the client
# sent, which chat templates may read.
Message = Mapping[str, Any]


_ENCODERS = {False: msgspec.json.Encoder(), True: msgspec.json.Encoder(order="sorted")}


class RequestError(UserError):
    """A request body the router cannot analyse; the message says why, for a 400 reply."""


def kind(value: object) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def message_list(body: dict[str, Any]) -> list[object]:
    """The body's non-empty ``messages``, each left for its API's reader to check
    (``checked_message`` first): an agent's history is hundreds of messages."""
    if "messages" not in body:
        raise RequestError("the request has no 'messages'")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise RequestError(f"messages must be a list, got {kind(messages)}")
    if not messages:
        raise RequestError("messages must not be empty")
    return messages


def checked_message(message: object, i: int) -> dict[str, Any]:
    """``messages[i]`` as an object with a string ``role``."""
    if not isinstance(message, dict):
        raise RequestError(f"messages[{i}] must be an object, got {kind(message)}")
    if "role" not in message:
        raise RequestError(f"messages[{i}] has no role")
    if not isinstance(message["role"], str):
        raise RequestError(f"messages[{i}].role must be a string, got {kind(message['role'])}")
    return message


def part_type(part: object, where: str) -> str:
    if not isinstance(part, dict):
        raise RequestError(f"{where} must be an object, got {kind(part)}")
    part_type = part.get("type")
    if not isinstance(part_type, str):
        raise RequestError(f"{where}.type must be a string, got {kind(part_type)}")
    return part_type


def text_field(part: dict[str, Any], field: str, where: str) -> str:
    text = part.get(field)
    if not isinstance(text, str):
        raise RequestError(f"{where}.{field} must be a string, got {kind(text)}")
    return text


def placeholder(part_type: str, part: object) -> str:
    """A short stand-in for an image or other non-text part, named by its content's digest.

    Counting a base64 image's characters as prompt would swamp every number, while one
    shared placeholder for all images would let different images look like a cached prefix.
    """
    return f"<|{part_type}:{digest(to_json(part, sort_keys=True))}|>"


def to_json(value: object, *, sort_keys: bool = False) -> str:
    """Compact JSON of client data, by msgspec (an agent's history holds dozens of tool calls
    to serialise per request); nesting too deep to serialise is the client's error.

    Text msgspec cannot encode (lone surrogates) goes through ``json``: a different but
    equally deterministic text, which is all rendering needs.
    """
    try:
        return _ENCODERS[sort_keys].encode(value).decode()
    except UnicodeEncodeError:
        pass
    except RecursionError as error:
        raise RequestError(f"cannot serialise part of the request: {error}") from None
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=sort_keys)
    except (RecursionError, ValueError) as error:
        raise RequestError(f"cannot serialise part of the request: {error}") from None


def digest(data: str | bytes) -> str:
    """16 hex digits of BLAKE2b, the same in every process (unlike ``hash()``)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def decode_body(raw: bytes) -> object:
    """A request body's JSON, by msgspec, which decodes agent-sized bodies about twice as
    fast as ``json``. What msgspec refuses but ``json`` accepts (lone surrogates, ``NaN``)
    goes through ``json``, so the router accepts exactly the bodies it always did."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        pass
    except RecursionError:
        raise RequestError("body is not valid JSON: nested too deeply") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too deep, huge ints
        raise RequestError(f"body is not valid JSON: {exc}") from None
