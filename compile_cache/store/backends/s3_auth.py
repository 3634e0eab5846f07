"""What the small S3 client (:mod:`.s3`) needs before its first request: where the credentials,
region and endpoint come from, and AWS Signature Version 4.

Only standard-library modules, so a store on ``s3://`` whose credentials are plain keys in the
environment or a shared credentials file never imports s3fs, aiobotocore or botocore (0.6 to
0.8 s of a fresh process on 2 cores). :func:`settings` says whether this client can serve a URL
the way botocore would; when it cannot (a role to assume, SSO, web identity, a credential
process, instance or pod credentials, a proxy, an endpoint or S3 option in
the config file, no region and no endpoint), it returns None and a reason, and the store uses
fsspec/s3fs as before. Nothing here logs a credential or puts one in a repr or an exception.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import quote, urlsplit

from ...redact import check_credential

if TYPE_CHECKING:
    import configparser

__all__ = ["Credentials", "S3Settings", "check_environment", "credential_sources", "settings", "sign"]

#: Config-file keys this client understands; any other key in the profile means s3fs.
_PROFILE_KEYS = frozenset({"aws_access_key_id", "aws_secret_access_key", "aws_session_token",
                           "aws_security_token", "region", "output", "cli_pager", "cli_history"})
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class Credentials(NamedTuple):
    """An access key, its secret and an optional session token (never shown: the repr names
    only their source). A named tuple, not a dataclass: a fresh node imports this module inside
    its restore, and a frozen dataclass costs ~0.7 ms to define."""

    access_key: str
    secret_key: str
    token: str | None = None
    #: Where they came from, as shown (a source, never a value).
    source: str = ""

    def __repr__(self) -> str:
        return f"Credentials(source={self.source!r})"


class S3Settings(NamedTuple):
    """Everything the small client needs for one store URL (a named tuple: see Credentials)."""

    credentials: Credentials
    region: str
    scheme: str  # http or https
    host: str  # host[:port] as sent in the Host header
    path_style: bool
    endpoint: str | None  # as configured, None for AWS's own
    #: ``AWS_CA_BUNDLE``: the CA certificates an https endpoint is verified against (else the system's).
    ca_bundle: str | None = None


def _profile_section(parser: configparser.ConfigParser | None, name: str,
                     config_file: bool) -> dict[str, str] | None:
    section = name if not config_file or name == "default" else f"profile {name}"
    if parser is not None and parser.has_section(section):
        return dict(parser.items(section, raw=True))
    return None


def _unreadable(parser: configparser.ConfigParser | None) -> bool:
    return parser is not None and parser.has_section("\x00unreadable")


def _read(path: str) -> configparser.ConfigParser | None:
    """The AWS config or credentials file at ``path``, None if there is none (as botocore, no
    file is no profile); one it cannot parse has the section ``"\\x00unreadable"``.
    ``configparser`` is imported only for a file that exists: 5 ms of a fresh node's start
    whose keys are in the environment."""
    path = os.path.expanduser(path)
    if not os.path.lexists(path):
        return None
    import configparser

    parser = configparser.ConfigParser(interpolation=None, default_section="\x00no-defaults")
    try:
        parser.read(path)
    except (configparser.Error, OSError, UnicodeDecodeError):
        parser = configparser.ConfigParser(default_section="\x00no-defaults")
        parser.add_section("\x00unreadable")
    return parser


def _credentials(env: Mapping[str, str]) -> tuple[Credentials | None, dict[str, str], str]:
    """(credentials, the profile's config-file section, reason if None), in botocore's order for
    the sources this client supports; None wherever botocore would ask something else first."""
    check_environment(env)
    key, secret = env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", "")
    if key and secret:
        token = env.get("AWS_SESSION_TOKEN") or env.get("AWS_SECURITY_TOKEN") or None
        profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
        config = _profile_section(_read(env.get("AWS_CONFIG_FILE", "~/.aws/config")), profile, True) or {}
        return Credentials(key, secret, token, "environment (AWS_ACCESS_KEY_ID)"), config, ""
    if key or secret:
        return None, {}, "only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY is set"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") or env.get("AWS_ROLE_ARN"):
        return None, {}, "web-identity credentials"
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    config_parser = _read(env.get("AWS_CONFIG_FILE", "~/.aws/config"))
    shared_parser = _read(env.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"))
    if _unreadable(config_parser) or _unreadable(shared_parser):
        return None, {}, "an AWS config or credentials file it cannot parse"
    config = _profile_section(config_parser, profile, True) or {}
    shared = _profile_section(shared_parser, profile, False) or {}
    unknown = sorted((set(config) | set(shared)) - _PROFILE_KEYS)
    if unknown:
        return None, {}, f"profile {profile!r} sets {unknown[0]}"
    for where, values in (("credentials file", shared), ("config file", config)):
        for name in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "aws_security_token"):
            check_credential(f"{name} of profile {profile!r} ({where})", values.get(name) or None)
        if values.get("aws_access_key_id") and values.get("aws_secret_access_key"):
            token = values.get("aws_session_token") or values.get("aws_security_token") or None
            creds = Credentials(values["aws_access_key_id"], values["aws_secret_access_key"], token,
                                f"profile {profile!r} ({where})")
            return creds, config, ""
    return None, {}, "no keys in the environment or a profile (instance, pod or SSO credentials)"


def credential_sources(env: Mapping[str, str] | None = None) -> list[tuple[str, bool | None]]:
    """The credential sources of botocore's chain, in its order, each with whether it is there
    (None: only a request could tell): names of variables and files, never a value. What
    doctor shows beside the client that serves the store."""
    env = os.environ if env is None else env
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    shared = env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"
    config = env.get("AWS_CONFIG_FILE") or "~/.aws/config"
    metadata_off = (env.get("AWS_EC2_METADATA_DISABLED") or "").strip().lower() == "true"
    return [
        ("AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY",
         bool(env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"))),
        ("AWS_WEB_IDENTITY_TOKEN_FILE", bool(env.get("AWS_WEB_IDENTITY_TOKEN_FILE"))),
        (f"profile {profile!r} in {shared}", os.path.lexists(os.path.expanduser(shared))),
        (f"profile {profile!r} in {config}", os.path.lexists(os.path.expanduser(config))),
        ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI/FULL_URI",
         bool(env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"))),
        ("the instance metadata service" + (" (off: AWS_EC2_METADATA_DISABLED)" if metadata_off else ""),
         False if metadata_off else None),
    ]


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`~compile_cache.errors.ConfigError` (naming the variable, never its value)
    if an AWS credential variable holds a control character or surrounding whitespace."""
    env = os.environ if env is None else env
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        check_credential(name, env.get(name) or None)


def _proxied(scheme: str, host: str, env: Mapping[str, str]) -> bool:
    names = (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY")
    if not any(env.get(n) for n in names):
        return False
    from urllib.request import proxy_bypass_environment

    return not proxy_bypass_environment(host.rsplit(":", 1)[0] if host.count(":") == 1 else host,
                                        {"no": env.get("no_proxy") or env.get("NO_PROXY") or ""})


def settings(url: str, env: Mapping[str, str] | None = None) -> tuple[S3Settings | None, str]:
    """``(settings, "")`` if the small client can serve ``url`` (``s3://bucket/prefix``) as
    botocore would, else ``(None, why not)``: the store then uses s3fs."""
    env = os.environ if env is None else env
    creds, profile, why = _credentials(env)
    if creds is None:
        return None, why
    if env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        return None, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS is set"
    if set(profile) - _PROFILE_KEYS:
        return None, f"the profile's config sets {sorted(set(profile) - _PROFILE_KEYS)[0]}"
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    if not bucket:
        return None, "no bucket in the URL"
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or profile.get("region") or ""
    endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or "").strip() or None
    if endpoint is None:
        if not region:  # botocore finds the bucket's region by its redirects; we do not
            return None, "no region and no endpoint"
        dns_ok = bucket.replace("-", "").isalnum() and bucket.islower() and 3 <= len(bucket) <= 63
        host = f"{bucket}.s3.{region}.amazonaws.com" if dns_ok else f"s3.{region}.amazonaws.com"
        scheme, path_style = "https", not dns_ok
    else:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") \
                or parts.query or parts.username or parts.password:
            return None, "an endpoint URL it does not support"
        scheme, host, path_style = parts.scheme, parts.netloc, True
    if _proxied(scheme, host, env):
        return None, "a proxy is configured for the endpoint"
    ca_bundle = os.path.expanduser(env["AWS_CA_BUNDLE"]) if env.get("AWS_CA_BUNDLE") else None
    return S3Settings(creds, region or "us-east-1", scheme, host, path_style, endpoint, ca_bundle), ""


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def uri_encode(text: str, safe: str = "") -> str:
    """SigV4's URI encoding: everything but ``A-Za-z0-9-_.~`` (and ``safe``) as %XX."""
    return quote(text, safe="-_.~" + safe)


def sign(method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str],
         payload_sha256: str, creds: Credentials, region: str, amz_date: str) -> dict[str, str]:
    """The headers to send: ``headers`` (each signed; ``host`` among them) plus
    ``x-amz-date``, ``x-amz-content-sha256``, the session token if any, and ``Authorization``
    (AWS4-HMAC-SHA256 for service ``s3``). ``path`` is the URI path, not yet encoded;
    ``amz_date`` is ``YYYYMMDDTHHMMSSZ``."""
    out = {k.lower(): str(v).strip() for k, v in headers.items()}
    out["x-amz-date"] = amz_date
    out["x-amz-content-sha256"] = payload_sha256
    if creds.token:
        out["x-amz-security-token"] = creds.token
    names = sorted(out)
    canonical_query = "&".join(f"{uri_encode(k)}={uri_encode(v)}" for k, v in sorted(query.items()))
    canonical = "\n".join([
        method, uri_encode(path, "/"), canonical_query,
        "".join(f"{n}:{' '.join(out[n].split())}\n" for n in names), ";".join(names), payload_sha256,
    ])
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{creds.secret_key}".encode(), amz_date[:8]), region), "s3"),
                "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                            f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return out
