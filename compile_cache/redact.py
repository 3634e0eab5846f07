"""One redaction for everything compile_cache says: messages, warnings, logs, ``doctor`` and
every ``--json`` output.

A store URL may carry ``user:password@`` (a password may even hold a ``/`` or an ``@``), and an
object store's error may quote a request header, which holds the access key or the session
token. :func:`redact` removes both (and any value of a credential variable this process has, in
whatever form it appears), so a secret never reaches a terminal, a log file or a CI artifact;
:func:`one_line` also escapes control characters, for text that came from outside (a server's
error message) and goes into a one-line warning. :func:`check_credential` refuses, when it is
read, a credential value with control characters or surrounding spaces (a trailing newline left
by a file or a Kubernetes secret), which would otherwise be quoted whole by the HTTP library's
"invalid header" error; its message names the variable, never the value.
"""

from __future__ import annotations

import logging
import os
import re

from .errors import ConfigError

__all__ = ["SECRET_VARIABLES", "RedactingFilter", "check_credential", "one_line", "redact", "shown"]

#: Variables whose values are secrets wherever they appear.
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                    "AWS_ACCESS_KEY_ID", "COMPILE_CACHE_SIGNING_KEY",
                    "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY",
                    "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CLIENT_SECRET", "GOOGLE_OAUTH_ACCESS_TOKEN")
#: ``scheme://<userinfo>@``: the userinfo runs to the last ``@`` of the URL (greedy), so a
#: password holding ``/`` or ``@`` goes whole.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s\"'<>]*@")
#: Parts of a SigV4 Authorization header, should one be quoted; an Azure connection string's
#: key or SAS signature.
_SIGNATURE = re.compile(r"(Credential=|Signature=|x-amz-security-token[:=]\s*|AccountKey=|"
                        r"SharedAccessSignature=|[?&]sig=)[^\s,;\"'&]+", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: What a terminal could act on (an escape sequence: OSC 52 sets the clipboard, CSI moves the
#: cursor): C0 controls but newline and tab, DEL, C1 controls (``\x9b`` is a one-byte CSI).
_TERMINAL_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_HIDDEN = "***"


def _secret_values() -> list[str]:
    values = set()
    for name in SECRET_VARIABLES:
        value = os.environ.get(name) or ""
        for form in (value, value.strip()):
            if len(form) >= 4:  # a shorter "secret" would blank out ordinary words
                values.add(form)
                values.add(repr(form)[1:-1])  # as an exception's repr quotes it (\n escaped)
    return sorted(values, key=len, reverse=True)


def redact(text: object) -> str:
    """``text`` with every URL's ``user:password@``, SigV4 credential parts, and the value of
    every credential variable of this process replaced. Newlines are kept."""
    out = _USERINFO.sub(r"\1", str(text))
    out = _SIGNATURE.sub(lambda m: m.group(1) + _HIDDEN, out)
    for value in _secret_values():
        out = out.replace(value, _HIDDEN)
    return out


def shown(text: object) -> str:
    """:func:`redact` of ``text`` as it may reach a terminal: every control character but
    newline and tab escaped as ``\\x1b`` (text read from a store or a server may hold escape
    sequences a terminal would act on)."""
    return _TERMINAL_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", redact(text))


def one_line(text: object, limit: int = 500) -> str:
    """:func:`redact` of ``text`` on one line: control characters (newlines included) escaped,
    at most ``limit`` characters (a server's error text, before it goes into a warning)."""
    out = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", redact(text))
    return out if len(out) <= limit else out[: limit - 3] + "..."


def check_credential(name: str, value: str | None) -> str | None:
    """``value`` if it is a usable credential; :class:`ConfigError` naming ``name`` (never the
    value) if it holds control characters or surrounding whitespace."""
    if value is None:
        return None
    if _CONTROL.search(value) or value != value.strip():
        raise ConfigError(
            f"{name} holds a control character or surrounding whitespace (a trailing newline, as "
            f"a file or a Kubernetes secret may leave it?); its value is not shown. Strip it, "
            f"e.g. export {name}=\"$(printf %s \"${name}\" | tr -d '\\r\\n')\"")
    return value


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record's message and escapes its control characters
    (:func:`shown`; installed on the package logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: left to logging
            return True
        clean = shown(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_filter = RedactingFilter()
logging.getLogger("compile_cache").addFilter(_filter)
