"""An image URL fetched without trusting it: allowed hosts only, every address the host resolves
to checked, the connection pinned to a checked address (the Host header, TLS name and
certificate check stay the URL's), each redirect checked again, the body capped in bytes.

httpx is imported where a URL is parsed or fetched, not with the module: a front end that never
fetches an image URL (the Python API embedding texts) loads no HTTP client."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

from poolserve.types.errors import ImageTooLargeError, InvalidImageError, clip

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DEFAULT_PORTS = {"http": 80, "https": 443}
REDIRECTS = frozenset({301, 302, 303, 307, 308})
# NAT64's well-known prefix (RFC 6052): its last 32 bits are the IPv4 address reached
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# What a body may be labelled: an image, or bytes of no stated type (the decoder decides)
BODY_TYPES = ("image/", "application/octet-stream")
HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "poolserve"}


@dataclass(frozen=True)
class FetchPolicy:
    """What a fetch may reach and bring back."""

    allowed_domains: tuple[str, ...]
    allow_private: bool
    max_bytes: int
    max_redirects: int


@dataclass(frozen=True)
class Target:
    """One hop's URL, its host (lower case, IDNA ASCII, an IPv6 address without brackets) and
    port."""

    url: httpx.URL
    host: str
    port: int

    @property
    def host_header(self) -> str:
        """The Host header the URL implies (the port only when it is not the scheme's)."""
        name = f"[{self.host}]" if ":" in self.host else self.host
        default = DEFAULT_PORTS[self.url.scheme]
        return name if self.port == default else f"{name}:{self.port}"


async def fetch(url: str, policy: FetchPolicy, what: str) -> bytes:
    """The body of an allowed image URL, following at most max_redirects checked redirects.

    The caller bounds the whole fetch in time; every refusal is an InvalidImageError (400) or
    an ImageTooLargeError (413) naming `what`.
    """
    import httpx

    async with httpx.AsyncClient(
        verify=tls_context(),
        trust_env=False,  # a proxy from the environment would connect to names, not addresses
        follow_redirects=False,
        # no connection outlives its response: one pinned to an address for one TLS name
        # must never carry a request for another name
        limits=httpx.Limits(max_keepalive_connections=0),
        timeout=None,  # the caller's deadline covers the whole fetch
    ) as client:
        for _ in range(policy.max_redirects + 1):
            target = check_url(url, policy, what)
            addresses = await checked_addresses(target, policy, what)
            response = await _send(client, target, addresses, what)
            try:
                location = response.headers.get("location")
                if response.status_code in REDIRECTS and location:
                    url = _join(target.url, location, what)
                    continue
                _check_response(response, policy.max_bytes, what)
                return await _read(response, policy.max_bytes, what)
            finally:
                await response.aclose()
    raise InvalidImageError(
        f"{what}: more than {policy.max_redirects} redirects (--max-media-redirects)",
        what,
        "image_fetch_failed",
    )


def check_url(url: str, policy: FetchPolicy, what: str) -> Target:
    """The URL's target when it is http(s), without credentials, on an allowed host."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise InvalidImageError(
            f"{what}: {clip(url)!r} is not a valid URL", what, "invalid_image_url"
        ) from None
    if parsed.scheme not in DEFAULT_PORTS or not parsed.raw_host:
        raise InvalidImageError(
            f"{what}: only http and https image URLs are fetched, not {clip(url)!r}",
            what,
            "image_url_not_allowed",
        )
    if parsed.userinfo:
        raise InvalidImageError(
            f"{what}: an image URL may not carry credentials", what, "image_url_not_allowed"
        )
    host = parsed.raw_host.decode("ascii").lower().rstrip(".")
    if not host_allowed(host, policy.allowed_domains):
        hint = "" if policy.allowed_domains else "; send the image as a data URL or base64"
        raise InvalidImageError(
            f"{what}: the host {clip(host)!r} is not in --allowed-media-domains{hint}",
            what,
            "image_url_not_allowed",
        )
    return Target(parsed, host, parsed.port or DEFAULT_PORTS[parsed.scheme])


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a host is listed: exactly, under a *.name or .name entry, or by *."""
    for entry in allowed:
        if entry in ("*", host):
            return True
        suffix = entry[1:] if entry.startswith("*.") else entry
        if suffix.startswith(".") and host.endswith(suffix):
            return True
    return False


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address host resolves to, in the resolver's order (an address: itself)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = (
        ipaddress.ip_address(info[4][0])
        for info in infos
        if info[0] in (socket.AF_INET, socket.AF_INET6)
    )
    return list(dict.fromkeys(found))


def is_public(address: IPAddress) -> bool:
    """Whether an address is a public unicast one; IPv6 forms that carry an IPv4 address
    (mapped, 6to4, NAT64) are judged by that address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public(embedded)
    special = (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )
    return address.is_global and not special


async def checked_addresses(target: Target, policy: FetchPolicy, what: str) -> list[IPAddress]:
    """The addresses to connect to: all the host's, each public unless private ones are
    allowed (one that is not refuses the URL: the resolver may hand out any of them)."""
    try:
        addresses = await resolve(target.host, target.port)
    except (OSError, UnicodeError):
        addresses = []
    if not addresses:
        raise InvalidImageError(
            f"{what}: the host {clip(target.host)!r} cannot be resolved", what, "image_fetch_failed"
        )
    if not policy.allow_private:
        refused = [a for a in addresses if not is_public(a)]
        if refused:
            logger.info("image URL refused: %s resolves to %s", target.host, refused[0])
            raise InvalidImageError(
                f"{what}: the host {clip(target.host)!r} resolves to a private, loopback, "
                "link-local or reserved address, which image URLs may not reach",
                what,
                "image_url_not_allowed",
            )
    return addresses


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One certificate-checking TLS context for every fetch (building one reads the CA file):
    certifi's authorities, or SSL_CERT_FILE's / SSL_CERT_DIR's where the environment sets them."""
    import httpx

    return httpx.create_ssl_context(trust_env=True)


async def _send(
    client: httpx.AsyncClient, target: Target, addresses: list[IPAddress], what: str
) -> httpx.Response:
    """The response's head from the first address that connects, the body left to stream."""
    import httpx

    extensions = {"sni_hostname": target.host} if target.url.scheme == "https" else {}
    failure: Exception | None = None
    for address in addresses:
        request = client.build_request(
            "GET",
            target.url.copy_with(host=str(address)),
            headers={**HEADERS, "Host": target.host_header},
            extensions=extensions,
        )
        try:
            return await client.send(request, stream=True)
        except httpx.ConnectError as exc:  # refused, unreachable, or the certificate
            failure = exc
        except httpx.HTTPError as exc:
            raise _fetch_failed(target, what, exc) from None
    assert failure is not None
    raise _fetch_failed(target, what, failure) from None


def _reason(exc: Exception) -> str:
    return clip(str(exc) or type(exc).__name__)


def _fetch_failed(target: Target, what: str, exc: Exception) -> InvalidImageError:
    return InvalidImageError(
        f"{what}: the image URL on {clip(target.host)!r} could not be fetched: {_reason(exc)}",
        what,
        "image_fetch_failed",
    )


def _join(base: httpx.URL, location: str, what: str) -> str:
    """A redirect's target as an absolute URL."""
    import httpx

    try:
        return str(base.join(location))
    except (httpx.InvalidURL, ValueError):
        raise InvalidImageError(
            f"{what}: the image URL redirects to an invalid URL {clip(location)!r}",
            what,
            "image_fetch_failed",
        ) from None


def _check_response(response: httpx.Response, max_bytes: int, what: str) -> None:
    """A 2xx answer with an image (or untyped), unencoded body within max_bytes."""
    if not response.is_success:
        raise InvalidImageError(
            f"{what}: the image URL answered HTTP {response.status_code}",
            what,
            "image_fetch_failed",
        )
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type and not media_type.startswith(BODY_TYPES):
        raise InvalidImageError(
            f"{what}: the image URL answered {clip(media_type)!r}, not an image",
            what,
            "unsupported_image_format",
        )
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidImageError(
            f"{what}: the image URL answered a {clip(encoding)}-encoded body; images are "
            "fetched unencoded",
            what,
            "image_fetch_failed",
        )
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_many_bytes(what, int(length), max_bytes)


async def _read(response: httpx.Response, max_bytes: int, what: str) -> bytes:
    """The body, read no further than one byte past max_bytes."""
    import httpx

    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > max_bytes:
                raise too_many_bytes(what, None, max_bytes)
            parts.append(chunk)
    except httpx.HTTPError as exc:
        raise InvalidImageError(
            f"{what}: the image URL's body could not be read: {_reason(exc)}",
            what,
            "image_fetch_failed",
        ) from None
    return b"".join(parts)


def too_many_bytes(what: str, size: int | None, max_bytes: int) -> ImageTooLargeError:
    """413 for an encoded image above --max-image-bytes."""
    size_text = f"{size} bytes" if size is not None else "larger"
    return ImageTooLargeError(
        f"{what}: the image is {size_text}, above the limit of {max_bytes} bytes "
        "(--max-image-bytes)",
        what,
    )
