"""Who may use the server: an API key (TEI's `--api-key`) and a Host / Origin allow-list.

    rules = AccessRules.for_bind("127.0.0.1", api_key="secret")
    refusal(rules, "POST", "/predict", headers)   # None, or (status, message)
    app = AccessGuard(app, rules, on_refusal)      # the ASGI wrapper that applies it

- API key: with a key set, every route but the probes (`/health`, `/ready`: a load
  balancer's or Kubernetes' checks carry no credentials) needs `Authorization: Bearer KEY`,
  compared in constant time; 401 otherwise, as TEI answers.
- Host: a server bound to one address answers only requests whose Host header names that
  address, localhost, 127.0.0.1 or ::1 (any port), or a name given with `--allowed-hosts`;
  421 otherwise. Without it a web page the user opens could reach the local server by
  rebinding its own domain's DNS to 127.0.0.1 (DNS rebinding): the browser would send the
  page's domain as Host. A server bound to every address (0.0.0.0, ::) is meant to be
  reached by names this process cannot know: it checks Host only against `--allowed-hosts`
  when given. `--allowed-hosts` adds names; it never takes loopback away from a client on
  the machine itself (its own health checks: `curl localhost:PORT/ready`), since a rebound
  page's request names the page's domain, not localhost.
- An empty key (`--api-key "$KEY"` with KEY unset, or `API_KEY=`) is refused when the server
  starts (AccessRules raises ValueError): it would otherwise mean no authentication at all.
- Origin: a browser names the page that sent a request in `Origin`; a request from a page
  whose host is not allowed gets 403, whatever its Content-Type (a `text/plain` POST needs
  no CORS preflight, so CORS alone would not stop it). Clients that are not browsers send
  no Origin and are not affected.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

PROBES = ("/health", "/ready")
LOOPBACK = ("localhost", "127.0.0.1", "::1")
ANY_ADDRESS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class AccessRules:
    """api_key: None (no key) or the key; allowed_hosts: host names (lower case, no port)
    a request's Host and Origin may name, or None: any."""

    api_key: str | None = None
    allowed_hosts: frozenset | None = None

    @classmethod
    def for_bind(cls, bind_host: str, api_key: str | None = None, allowed_hosts=None) -> AccessRules:
        """The defaults for a server bound to `bind_host` (see the module's docstring)."""
        if api_key is not None and not api_key.strip():
            raise ValueError(
                "--api-key is empty (or $API_KEY is set to an empty value): an empty key would leave "
                "the server without authentication; give a key, or leave both unset to serve without one"
            )
        bound = set() if bind_host in ANY_ADDRESS else {bind_host.lower().strip("[]"), *LOOPBACK}
        if allowed_hosts:
            hosts = frozenset({*(h.lower().strip("[]") for h in allowed_hosts), *bound})
        else:
            hosts = None if bind_host in ANY_ADDRESS else frozenset(bound)
        return cls(api_key, hosts)


def host_of(value: str) -> str:
    """'example.com:8080' -> 'example.com'; '[::1]:80' -> '::1' (lower case)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(address: str | None) -> bool:
    """127.0.0.0/8, ::1 or an IPv4-mapped loopback address."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def refusal(
    rules: AccessRules, method: str, path: str, headers: dict, client: str | None = None
) -> tuple[int, str] | None:
    """Why this request is refused, as (HTTP status, message), or None to serve it.
    headers: lower-case names -> values; client: the peer's address (None: unknown)."""
    if rules.allowed_hosts is not None:
        host = host_of(headers.get("host", ""))
        own_machine = host in LOOPBACK and is_loopback(client)
        if host not in rules.allowed_hosts and not own_machine:
            return (
                421,
                f"Host {host or '(none)'!r} is not served here; allowed: {', '.join(sorted(rules.allowed_hosts))} (--allowed-hosts)",
            )
        origin = headers.get("origin")
        if origin is not None and origin != "null":
            origin_host = (urlsplit(origin).hostname or "").lower()
            if origin_host not in rules.allowed_hosts:
                return (
                    403,
                    f"requests from web pages of {origin_host or origin!r} are not served here (--allowed-hosts)",
                )
        elif origin == "null":
            return 403, "requests from opaque origins (Origin: null) are not served here"
    if rules.api_key is not None and path not in PROBES:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), rules.api_key.encode()
        ):
            return 401, "a valid API key is required: send Authorization: Bearer <key> (--api-key)"
    return None


class AccessGuard:
    """An ASGI wrapper: refuses (status + TEI's error body) what `refusal` refuses before
    the app sees the request; `on_refusal(status)` counts it."""

    def __init__(self, app, rules: AccessRules, on_refusal=None):
        self.app, self.rules, self.on_refusal = app, rules, on_refusal
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        client = (scope.get("client") or (None,))[0]
        refused = refusal(self.rules, scope.get("method", ""), scope.get("path", ""), headers, client)
        if refused is None:
            return await self.app(scope, receive, send)
        status, message = refused
        if self.on_refusal is not None:
            self.on_refusal(status)
        kind = {401: "unauthorized", 403: "forbidden", 421: "misdirected"}.get(status, "validation")
        body = json.dumps({"error": message, "error_type": kind}).encode()
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *extra]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
