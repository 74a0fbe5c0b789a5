"""Who may reach the server through a browser: the Host and Origin checks.

A server on 127.0.0.1 without an API key trusts whoever can connect, and any web page the user
visits can make the browser connect. Two checks close that:

- **Origin**: a request whose `Origin` is another site's (or, with no Origin, whose
  `Sec-Fetch-Site` is `cross-site` or `same-site`) is refused with 403 unless `--allowed-origins`
  lists it. Browsers set both headers themselves and a page cannot remove them; clients that are
  not browsers (curl, the openai client, routers) send neither and are not affected. This catches
  what the Content-Type check cannot: a `fetch` with a Blob body or `navigator.sendBeacon` sends
  a POST without a preflight.
- **Host**: DNS rebinding points an attacker's name at 127.0.0.1, so that the attacker's page is
  same-origin with the server and can read its answers; the browser still sends the attacker's
  name in `Host`. A Host that is not a localhost name, the `--host` address or in
  `--allowed-hosts` is refused with 403. Bound to all interfaces (0.0.0.0, ::) there is no single
  name to expect, so the Host is checked only when `--allowed-hosts` is given.

An allowed origin also gets CORS headers (`Access-Control-Allow-Origin`, and answers to preflight
requests), so a browser application there can read the responses. The API has no cookies, so no
`Access-Control-Allow-Credentials`: a key still has to be sent by the page itself.
"""

from __future__ import annotations

import argparse
import ipaddress
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hybridserve.server.protocol import APIError

# Names a browser sends only for a page that is itself on this machine's loopback address, so an
# attacker's page can never make them appear in Host: always accepted.
LOCALHOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# The bind addresses that mean every interface: no one name to check the Host against.
_ALL_INTERFACES = frozenset({"", "0.0.0.0", "::"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
# Sec-Fetch-Site values of a request another site's page made (same-site: another port or
# subdomain, which is another application).
_FOREIGN_FETCH_SITES = frozenset({"cross-site", "same-site"})
_PREFLIGHT_MAX_AGE_S = 600


def _split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (or an origin's authority) -> (lower-cased name without brackets or a trailing
    dot, port or None); None when it is not a host[:port]."""
    v = value.strip().lower()
    port_text: str | None = None
    if v.startswith("["):
        name, sep, rest = v[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        if rest:
            port_text = rest[1:]
    elif ":" in v:
        name, _, port_text = v.rpartition(":")
    else:
        name = v
    port: int | None = None
    if port_text is not None:
        if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) <= 65535:
            return None
        port = int(port_text)
    name = name.rstrip(".")  # "localhost." is the same name as "localhost"
    if not name or any(c in name for c in "/@ \t"):
        return None
    return name, port


def _origin_parts(origin: str) -> tuple[str, str, int] | None:
    """A serialized origin ("scheme://host[:port]") -> (scheme, name, port with the scheme's
    default filled in); None for anything else ("null", a path, credentials)."""
    try:
        u = urllib.parse.urlsplit(origin.strip())
    except ValueError:
        return None
    scheme = u.scheme.lower()
    if scheme not in _DEFAULT_PORTS or u.path not in ("", "/") or u.query or u.fragment or "@" in u.netloc:
        return None
    host = _split_host(u.netloc)
    if host is None:
        return None
    name, port = host
    return scheme, name, port if port is not None else _DEFAULT_PORTS[scheme]


def _origin_key(scheme: str, name: str, port: int) -> str:
    shown = f"[{name}]" if ":" in name else name
    return f"{scheme}://{shown}" if port == _DEFAULT_PORTS[scheme] else f"{scheme}://{shown}:{port}"


def parse_allowed_origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: comma-separated origins as a browser writes them in `Origin`
    (`http://localhost:3000`; a default port and a trailing slash may be given), or `*` for any.
    `null` is refused: sandboxed frames and local files of any site send it."""
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            raise argparse.ArgumentTypeError(f"an empty origin in {text!r}")
        if item == "*":
            out.append(item)
            continue
        if item.lower() == "null":
            raise argparse.ArgumentTypeError(
                "'null' cannot be allowed: every sandboxed frame and local file sends it"
            )
        parts = _origin_parts(item)
        if parts is None:
            raise argparse.ArgumentTypeError(
                f"not an origin: {item!r} (expected scheme://host[:port], e.g. http://localhost:3000)"
            )
        out.append(_origin_key(*parts))
    return tuple(out)


def parse_allowed_hosts(text: str) -> tuple[str, ...]:
    """`--allowed-hosts`: comma-separated names the Host header may carry (without a port; any port
    is accepted), or `*` for any Host (no check)."""
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            raise argparse.ArgumentTypeError(f"an empty name in {text!r}")
        if item == "*":
            out.append(item)
            continue
        bare = item.strip("[]")
        try:  # an IPv6 address has colons that are not a port
            name = str(ipaddress.ip_address(bare))
        except ValueError:
            host = _split_host(item)
            if host is None or host[1] is not None or "://" in item:
                raise argparse.ArgumentTypeError(
                    f"not a host name: {item!r} (give the name without scheme or port, e.g. api.example.com)"
                ) from None
            name = host[0]
        out.append(name)
    return tuple(out)


def _is_all_interfaces(host: str) -> bool:
    h = host.strip().strip("[]")
    if h in _ALL_INTERFACES:
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        return False


@dataclass(frozen=True)
class AccessPolicy:
    """The Host and Origin rules of one server. `allowed_hosts` None: any Host."""

    allowed_hosts: frozenset[str] | None = None
    allowed_origins: frozenset[str] = frozenset()
    any_origin: bool = False

    @classmethod
    def for_bind(
        cls,
        host: str | None,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
    ) -> AccessPolicy:
        """The policy of a server listening on `host` (None: an app not started by the CLI, e.g.
        in tests: no Host check unless `allowed_hosts` is given)."""
        extra = set(allowed_hosts)
        origins = set(allowed_origins)
        hosts: frozenset[str] | None
        if "*" in extra or ((host is None or _is_all_interfaces(host)) and not extra):
            hosts = None
        else:
            names = set(LOCALHOST_NAMES) | extra
            if host is not None and not _is_all_interfaces(host):
                try:
                    names.update(parse_allowed_hosts(host))
                except argparse.ArgumentTypeError:
                    pass  # not a name a Host can carry; listening on it fails and says why
            hosts = frozenset(names)
        return cls(hosts, frozenset(origins - {"*"}), "*" in origins)

    # -- the checks

    def host_allowed(self, host: str) -> bool:
        if self.allowed_hosts is None:
            return True
        parts = _split_host(host)
        return parts is not None and parts[0] in self.allowed_hosts

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """`Origin` is listed, or is the server's own address (same-origin) as reached through a
        Host the Host check accepted. Without a Host check a same-origin request proves nothing:
        after DNS rebinding the attacker's page is same-origin too."""
        if self.any_origin:
            return True
        parts = _origin_parts(origin)
        if parts is None:
            return False
        if _origin_key(*parts) in self.allowed_origins:
            return True
        if host is None or self.allowed_hosts is None:
            return False
        own = _split_host(host)
        if own is None or own[0] not in self.allowed_hosts:
            return False
        scheme, name, port = parts
        return own[0] == name and (own[1] if own[1] is not None else _DEFAULT_PORTS[scheme]) == port

    def refusal(self, headers: Mapping[str, str]) -> APIError | None:
        """The 403 for a request these rules refuse, else None. `headers` is the request's
        (a multidict: a repeated Host or Origin must pass with each of its values)."""
        hosts = _all(headers, "Host")
        for host in hosts:
            if not self.host_allowed(host):
                return APIError(
                    f"the Host {host!r} is not a name this server answers to (a web page reaching it "
                    "through another name, as DNS rebinding does, is refused); start the server with "
                    "--allowed-hosts to accept it",
                    status=403,
                    code="host_not_allowed",
                )
        own = hosts[0] if len(hosts) == 1 else None
        origins = _all(headers, "Origin")
        for origin in origins:
            if not self.origin_allowed(origin, own):
                return APIError(
                    f"requests from web pages of the origin {origin!r} are refused (a page on another "
                    "site must not use this server through its visitors' browsers); start the server "
                    "with --allowed-origins to allow an origin",
                    status=403,
                    code="origin_not_allowed",
                )
        site = headers.get("Sec-Fetch-Site", "").strip().lower()
        if not origins and site in _FOREIGN_FETCH_SITES and not self.any_origin:
            return APIError(
                f"a {site} request from a web page is refused (a page on another site must not use "
                "this server through its visitors' browsers); start the server with --allowed-origins "
                "to allow an origin",
                status=403,
                code="origin_not_allowed",
            )
        return None

    # -- CORS for the allowed origins

    def cors_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """Response headers that let a page of an allowed origin read the response (none for a
        request without Origin: it needs none, and for one refused)."""
        origins = _all(headers, "Origin")
        if len(origins) != 1 or self.refusal(headers) is not None:
            return {}
        return {
            "Access-Control-Allow-Origin": origins[0].strip(),
            "Access-Control-Expose-Headers": "Retry-After, X-Request-Id",
            "Vary": "Origin",
        }

    @staticmethod
    def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
        return method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers

    def preflight_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """The answer to an allowed origin's preflight. The request headers it asks for are
        granted as asked: they carry no ambient authority (no cookies here), and browser clients
        send headers of their own (the openai library's x-stainless-*)."""
        out = self.cors_headers(headers)
        out["Access-Control-Allow-Methods"] = "GET, POST, DELETE"  # (DELETE: a kept response)
        asked = headers.get("Access-Control-Request-Headers", "").strip()
        if asked:
            out["Access-Control-Allow-Headers"] = asked
        out["Access-Control-Max-Age"] = str(_PREFLIGHT_MAX_AGE_S)
        return out


def _all(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, []))
    value = headers.get(name)
    return [] if value is None else [value]
