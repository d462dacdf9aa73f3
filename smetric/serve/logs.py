"""The log of ``serve`` and ``pick``, with every secret a line could carry taken out.

Log lines quote what others sent: an HTTP client's error names the request it failed
(headers and all), a URL may carry a user and password, a library at debug level prints
what it sends. Rather than trusting each call site to leave secrets out, every line is
redacted once, where it is formatted: the values of ``Authorization``, ``x-api-key``,
``api-key`` and the like, bearer and basic credentials wherever they stand, and the user
part of URLs. Bodies are never logged, so prompts need no such pass.
"""

from __future__ import annotations

import logging
import re

REDACTED = "[redacted]"

# A header or field naming a secret, then its value: quoted (a repr, JSON, possibly
# escaped inside JSON) or bare up to a separator.
_NAMED = re.compile(
    r"""(?ix)
    (?P<name>\b(?:proxy-)?authorization|\b(?:x-)?api[-_]?key|\bpassword|\bsecret)
    (?P<sep>\\?['"]?\s*[:=]\s*)
    (?:(?P<quote>\\?['"])(?P<quoted>.*?)(?P=quote)|(?P<bare>[^\r\n'",;&}>)\]]+))
    """
)
# Credentials of any scheme that carries one after its name, wherever they stand.
_SCHEMES = re.compile(r"(?i)\b(bearer)\s+[^\s'\"\\,;]+|\b(basic)\s+[A-Za-z0-9+/]{8,}={0,2}")
# The user (and password) part of a URL.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@")


def _named(match: re.Match[str]) -> str:
    if match.group("quote") is not None:
        quote = match.group("quote")
        return f"{match.group('name')}{match.group('sep')}{quote}{REDACTED}{quote}"
    return f"{match.group('name')}{match.group('sep')}{REDACTED}"


def redact(text: str) -> str:
    """``text`` without the secrets it quotes."""
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    text = _SCHEMES.sub(lambda m: f"{m.group(1) or m.group(2)} {REDACTED}", text)
    return _NAMED.sub(_named, text)


class RedactingFormatter(logging.Formatter):
    """Formats as ``logging.Formatter`` does, exception text included, then redacts."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def log_to_stderr(level: int) -> None:
    """Every line of the process, the libraries' included, through one redacting
    handler on the root logger."""
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
