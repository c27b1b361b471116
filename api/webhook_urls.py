"""Which URLs webhooks may call: the server-side allow-list (SSRF guard).

A project must not be able to make the server call its own internal addresses (cloud metadata at
169.254.169.254, a database on 10.0.0.5, the API itself on 127.0.0.1). A URL passes when

1. its scheme is http or https, it names a host and carries no credentials;
2. if ``webhook_allowed_hosts`` is set, its host is one of them (``*.example.com`` matches subdomains);
3. every address its host resolves to is public (``ipaddress.is_global``), or loopback with
   ``webhook_allow_loopback``, or inside one of ``webhook_allowed_networks``. An IPv6 address that
   carries an IPv4 address reaches that one too (:func:`reached_ipv4`: IPv4-mapped, -compatible and
   -translated forms, NAT64, 6to4, Teredo): each carried IPv4 address is checked as IPv4, and the IPv6
   address itself as well (except a mapped one, which *is* its IPv4 address). So ``[::127.0.0.1]`` is
   checked as 127.0.0.1, and ``[64:ff9b::a9fe:a9fe]`` as 169.254.169.254 and as itself.

The check runs at registration and again before every attempt; the attempt then connects to the very
address that was checked (:func:`pinned_target`), so a DNS answer that changes in between (rebinding) is
not followed to an internal address, and the dispatcher checks the address once more as it connects.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from api.errors import InvalidRequest
from api.settings import Settings

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]


class WebhookUrlRefused(InvalidRequest):
    code = "webhook_url_refused"

    def __init__(self, message: str):
        super().__init__(f"url: {message}", field="url")


@dataclass(frozen=True)
class UrlPolicy:
    allowed_hosts: tuple[str, ...] = ()
    allowed_networks: tuple[IpNetwork, ...] = ()
    allow_loopback: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> UrlPolicy:
        return cls(
            allowed_hosts=tuple(h.lower().rstrip(".") for h in settings.webhook_allowed_hosts),
            allowed_networks=tuple(
                ipaddress.ip_network(n, strict=False) for n in settings.webhook_allowed_networks
            ),
            allow_loopback=settings.webhook_allow_loopback,
        )


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _host_allowed(host: str, allowed: Sequence[str]) -> bool:
    for entry in allowed:
        if entry.startswith("*.") and host.endswith(entry[1:]):
            return True
        if host == entry:
            return True
    return False


# IPv6 forms that carry an IPv4 address in their last 32 bits (the mapped form is ipaddress's ipv4_mapped).
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # ::a.b.c.d, deprecated (RFC 4291 2.5.5.1)
_IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # ::ffff:0:a.b.c.d, SIIT (RFC 2765)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known NAT64 prefix (RFC 6052)
# Never public, whatever this Python's ipaddress tables say: a site's own NAT64 (RFC 8215, where the IPv4
# address may sit at several offsets) and the deprecated site-local range.
_NOT_PUBLIC_V6 = (ipaddress.IPv6Network("64:ff9b:1::/48"), ipaddress.IPv6Network("fec0::/10"))


def reached_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses a connection to ``ip`` may reach: the one an IPv4-mapped, -compatible or
    -translated address stands for, the one behind a NAT64 or 6to4 address, and a Teredo address's server
    and client. Empty for a plain IPv6 address (``::`` and ``::1`` are IPv6's own)."""
    last32 = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
    found: list[ipaddress.IPv4Address] = []
    if ip.ipv4_mapped is not None:
        found.append(ip.ipv4_mapped)
    if (ip in _IPV4_COMPATIBLE and int(ip) > 1) or ip in _IPV4_TRANSLATED or ip in _NAT64:
        found.append(last32)
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found.extend(ip.teredo)
    return found


def _one_refusal(ip: IpAddress, policy: UrlPolicy) -> str | None:
    if ip.is_loopback:
        return None if policy.allow_loopback else "loopback addresses are not allowed on this server"
    if any(ip.version == net.version and ip in net for net in policy.allowed_networks):
        return None
    v6_never = isinstance(ip, ipaddress.IPv6Address) and any(ip in net for net in _NOT_PUBLIC_V6)
    if not ip.is_global or ip.is_multicast or v6_never:
        return f"{ip} is not a public address"
    return None


def address_refusal(ip: IpAddress, policy: UrlPolicy) -> str | None:
    """Why this address may not be called, or None (see the module docstring)."""
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ipaddress.IPv6Address(int(ip))  # drop a %zone: it does not change where the address leads
        for v4 in reached_ipv4(ip):
            reason = _one_refusal(v4, policy)
            if reason is not None:
                return f"{ip} reaches {v4}: {reason}"
        if ip.ipv4_mapped is not None:
            return None  # the IPv4 host itself, checked just above
    return _one_refusal(ip, policy)


def _parts(url: str) -> SplitResult:
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a bad port
    except ValueError as exc:
        raise WebhookUrlRefused(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise WebhookUrlRefused("only http and https URLs can receive webhooks")
    if not parts.hostname:
        raise WebhookUrlRefused("the URL names no host")
    if parts.username is not None or parts.password is not None:
        raise WebhookUrlRefused("credentials in the URL are not allowed; verify the signature instead")
    return parts


def check_webhook_url(url: str, policy: UrlPolicy, resolver: Resolver = resolve) -> str:
    """Refuse ``url`` (:class:`WebhookUrlRefused`, field ``url``) unless the policy allows it; otherwise
    return the checked address to connect to."""
    parts = _parts(url)
    host = (parts.hostname or "").lower().rstrip(".")
    if policy.allowed_hosts and not _host_allowed(host, policy.allowed_hosts):
        raise WebhookUrlRefused(f"host {host!r} is not in this server's webhook allow-list")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        literal: IpAddress | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [str(literal)]
    else:
        try:
            addresses = resolver(host, port)
        except (OSError, UnicodeError) as exc:
            raise WebhookUrlRefused(f"cannot resolve host {host!r} ({exc})") from None
    if not addresses:
        raise WebhookUrlRefused(f"host {host!r} resolves to no address")
    for address in addresses:
        reason = address_refusal(ipaddress.ip_address(address), policy)
        if reason is not None:
            raise WebhookUrlRefused(f"host {host!r} resolves to {address}: {reason}")
    return addresses[0]


@dataclass(frozen=True)
class PinnedTarget:
    """Where one attempt connects: the checked address, with the original host for the ``Host`` header
    and the TLS server name (so certificates are still verified against the host)."""

    url: str
    host_header: str
    server_name: str


def pinned_target(url: str, address: str) -> PinnedTarget:
    """``url`` with its host replaced by the checked ``address``."""
    parts = urlsplit(url)
    ip_host = f"[{address}]" if ":" in address else address
    netloc = f"{ip_host}:{parts.port}" if parts.port else ip_host
    return PinnedTarget(
        url=parts._replace(netloc=netloc).geturl(), host_header=parts.netloc, server_name=parts.hostname or ""
    )
