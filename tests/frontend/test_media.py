"""Image inputs loaded safely: data URLs and base64, URLs on allowed hosts only, never a private
address, redirects checked hop by hop, bytes, pixels and time bounded, exact RGB conversion.

Remote URLs are served by a local HTTP(S) server on 127.0.0.1; tests that must reach it allow
private addresses, or resolve made-up names to it through the module's resolver.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import ipaddress
import ssl
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Coroutine, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from poolserve.config.flags import parse_settings
from poolserve.config.settings import ServerSettings
from poolserve.frontend import media_fetch
from poolserve.frontend.media import Budget, Budgets, MediaLimits, load_image
from poolserve.http.errors import response_for
from poolserve.types.errors import (
    APIError,
    ImageFetchTimeoutError,
    ImageTooLargeError,
    InvalidImageError,
)
from tests.deploy.tools import require_tool

WHAT = "input 3"
LIMITS = MediaLimits(
    allowed_domains=("127.0.0.1",),
    allow_private=True,
    fetch_timeout_s=5.0,
    max_bytes=1 << 20,
    max_redirects=3,
    max_pixels=1_000_000,
)
Action = Callable[[BaseHTTPRequestHandler], None]


def limits(**changes: Any) -> MediaLimits:
    return dataclasses.replace(LIMITS, **changes)


def load(ref: str, lim: MediaLimits = LIMITS) -> Image.Image:
    return asyncio.run(load_image(ref, lim, Budgets.new(), what=WHAT))


def refused(ref: str, lim: MediaLimits = LIMITS) -> APIError:
    """The error loading ref raises; it names the input and maps to its own status."""
    with pytest.raises(APIError) as info:
        load(ref, lim)
    error = info.value
    assert WHAT in error.message and error.param == WHAT
    assert response_for(error).status_code == error.status
    return error


def encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def noise(mode: str, size: tuple[int, int] = (37, 23), seed: int = 0) -> Image.Image:
    """A random image of mode (every band random, alpha included)."""
    bands = len(Image.new(mode, (1, 1)).getbands())
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], bands), dtype=np.uint8)
    return Image.fromarray(pixels[:, :, 0] if bands == 1 else pixels, mode)


def palette_with_transparency() -> Image.Image:
    image = noise("RGB").quantize(16)
    image.info["transparency"] = 3
    return image


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height and holds no pixel data (a bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# --- data URLs and base64 -------------------------------------------------------------------

SAMPLES: dict[str, Callable[[], bytes]] = {
    "png rgb": lambda: encoded(noise("RGB"), "PNG"),
    "png rgba": lambda: encoded(noise("RGBA"), "PNG"),
    "png grey": lambda: encoded(noise("L"), "PNG"),
    "png grey alpha": lambda: encoded(noise("LA"), "PNG"),
    "png palette transparency": lambda: encoded(palette_with_transparency(), "PNG"),
    "png 16-bit": lambda: encoded(
        Image.fromarray(np.arange(851, dtype=np.uint16).reshape(23, 37) * 71), "PNG"
    ),
    "jpeg rgb": lambda: encoded(noise("RGB"), "JPEG", quality=90),
    "jpeg grey": lambda: encoded(noise("L"), "JPEG"),
    "jpeg cmyk": lambda: encoded(noise("CMYK"), "JPEG"),
    "webp lossy": lambda: encoded(noise("RGB"), "WEBP"),
    "webp rgba lossless": lambda: encoded(noise("RGBA"), "WEBP", lossless=True),
    "gif transparency": lambda: encoded(palette_with_transparency(), "GIF", transparency=3),
    "gif animated": lambda: encoded(
        noise("RGB", seed=1), "GIF", save_all=True, append_images=[noise("RGB", seed=2)]
    ),
    "webp animated": lambda: encoded(
        noise("RGBA", seed=1), "WEBP", save_all=True, append_images=[noise("RGBA", seed=2)]
    ),
}


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_a_data_url_gives_what_transformers_convert_to_rgb_gives(sample: str) -> None:
    data = SAMPLES[sample]()
    image = load(data_url(data, "image/" + sample.split()[0]))
    reference = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)  # frame 0
    assert image.mode == "RGB" and image.size == (37, 23)
    np.testing.assert_array_equal(np.asarray(image), reference)
    # the processors' own conversion changes nothing more
    np.testing.assert_array_equal(convert_to_rgb(image, return_numpy=True), reference)


def test_an_opaque_image_is_what_pil_decodes() -> None:
    data = SAMPLES["jpeg rgb"]()
    direct = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(np.asarray(load(data_url(data, "image/jpeg"))), direct)


def test_transparency_is_composited_onto_white() -> None:
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert np.asarray(load(data_url(encoded(clear, "PNG")))).tolist() == [[[255] * 3] * 4] * 4


def test_bare_base64_with_or_without_line_breaks_and_padding() -> None:
    data = SAMPLES["png rgb"]()
    expected = np.asarray(Image.open(io.BytesIO(data)))
    for ref in (
        base64.b64encode(data).decode(),
        base64.encodebytes(data).decode(),  # MIME lines
        base64.b64encode(data).decode().rstrip("="),
    ):
        np.testing.assert_array_equal(np.asarray(load(ref)), expected)


@pytest.mark.parametrize(
    "ref",
    ["not base64!", "aGVsbG8=aGVsbG8=x", "data:image/png;base64,@@@@", "éèà", "A"],
)
def test_invalid_base64_is_400(ref: str) -> None:
    error = refused(ref)
    assert isinstance(error, InvalidImageError) and error.status == 400


@pytest.mark.parametrize(
    ("ref", "said"),
    [
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64", "base64"),
        ("data:text/plain;base64,aGVsbG8=", "'text/plain'"),
        ("data:image/bmp;base64,Qk0=", "'image/bmp'"),
        ("file:///etc/passwd", "'file:'"),
        ("ftp://127.0.0.1/a.png", "'ftp:'"),
    ],
)
def test_other_references_are_refused_naming_why(ref: str, said: str) -> None:
    error = refused(ref)
    assert error.status == 400 and said in error.message


def test_an_oversized_payload_is_refused_before_it_is_decoded() -> None:
    lim = limits(max_bytes=1000)
    # not base64 at all: refused for its length (413), so it was never decoded
    assert refused("!" * 1500, lim).status == 413
    assert refused("data:image/png;base64," + "!" * 1500, lim).status == 413
    # within the characters' slack, over the limit once decoded: 413 too
    error = refused(base64.b64encode(b"\x89PNG" + b"\0" * 1050).decode(), lim)
    assert isinstance(error, ImageTooLargeError) and "--max-image-bytes" in error.message


# --- decoding --------------------------------------------------------------------------------


def test_a_pixel_bomb_is_refused_from_its_header() -> None:
    # declares 2000 x 2000 and has no pixel data: decoding it would fail as corrupt (400)
    error = refused(data_url(png_header(2000, 2000)))
    assert error.status == 413 and "2000x2000" in error.message
    assert "--max-image-pixels" in error.message
    # a real one: a solid image compresses to almost nothing
    solid = encoded(Image.new("RGB", (1250, 1000), (9, 9, 9)), "PNG")
    assert len(solid) < 10_000
    assert refused(data_url(solid)).status == 413
    # beyond PIL's own bomb limit, whatever ours is
    assert refused(data_url(png_header(100_000, 100_000)), limits(max_pixels=10**12)).status == 413


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_truncated_images_are_400(fmt: str) -> None:
    data = encoded(noise("RGB", (64, 64)), fmt)
    error = refused(data_url(data[: len(data) // 2]))
    assert error.status == 400 and "truncated or corrupt" in error.message


def test_corrupt_bytes_with_a_png_signature_are_400() -> None:
    error = refused(data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20))
    assert error.status == 400 and error.code == "invalid_image"


@pytest.mark.parametrize(("fmt", "name"), [("BMP", "BMP"), ("TIFF", "TIFF"), ("ICO", "ICO")])
def test_other_formats_are_refused_naming_them(fmt: str, name: str) -> None:
    error = refused(data_url(encoded(noise("RGB", (16, 16)), fmt)))
    assert error.status == 400 and error.code == "unsupported_image_format"
    assert f"a {name} image" in error.message


def test_unknown_bytes_are_refused() -> None:
    error = refused(base64.b64encode(b"just some text, not an image").decode())
    assert error.code == "unsupported_image_format"


# --- remote URLs -----------------------------------------------------------------------------


class LocalServer(ThreadingHTTPServer):
    """Answers each path with its action and records every request (path, Host header)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes: dict[str, Action] = {}
        self.seen: list[tuple[str, str | None]] = []

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, path: str, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"


class Handler(BaseHTTPRequestHandler):
    server: LocalServer

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Host")))
        action = self.server.routes.get(self.path)
        try:
            if action is None:
                self.send_error(404)
            else:
                action(self)
        except OSError:  # the client hung up, as it should past a limit
            pass

    def log_message(self, *args: object) -> None:
        pass


def serve(body: bytes, content_type: str = "image/png", length: int | None = None) -> Action:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body) if length is None else length))
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def redirect(location: str) -> Action:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return answer


def stall(handler: BaseHTTPRequestHandler) -> None:
    """Headers and a few bytes, then nothing for long."""
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    handler.send_header("Content-Length", "100000")
    handler.end_headers()
    handler.wfile.write(b"\x89PNG\r\n\x1a\n")
    handler.wfile.flush()
    time.sleep(5)


def endless(handler: BaseHTTPRequestHandler) -> None:
    """A body without a length that never ends (until the client leaves)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/octet-stream")
    handler.end_headers()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        handler.wfile.write(b"\0" * 16384)


@pytest.fixture(scope="module")
def local_server() -> Iterator[LocalServer]:
    server = LocalServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def server(local_server: LocalServer) -> LocalServer:
    local_server.routes.clear()
    local_server.seen.clear()
    return local_server


PNG = encoded(noise("RGB"), "PNG")


def names(table: dict[str, str]) -> Callable[[str, int], Coroutine[Any, Any, list[Any]]]:
    """A resolver that knows only table's names and addresses as themselves (the real one is
    never asked)."""

    async def resolve(host: str, port: int) -> list[Any]:
        addresses = host if host.replace(".", "").isdigit() or ":" in host else table[host]
        return [ipaddress.ip_address(a) for a in addresses.split()]

    return resolve


def test_an_allowed_url_is_fetched(server: LocalServer) -> None:
    server.routes["/a.png"] = serve(PNG)
    np.testing.assert_array_equal(
        np.asarray(load(server.url("/a.png"))), np.asarray(Image.open(io.BytesIO(PNG)))
    )
    assert server.seen == [("/a.png", f"127.0.0.1:{server.port}")]


def test_the_connection_goes_to_the_checked_address_with_the_urls_host(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # images.test resolves nowhere but here: the fetch connects to the address checked, and
    # never asks another resolver (no second lookup a rebinding DNS server could answer)
    monkeypatch.setattr(media_fetch, "resolve", names({"images.test": "127.0.0.1"}))
    server.routes["/a.png"] = serve(PNG)
    load(server.url("/a.png", "images.test"), limits(allowed_domains=("images.test",)))
    assert server.seen == [("/a.png", f"images.test:{server.port}")]


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "10.0.0.1", "169.254.169.254", "[::1]", "[::ffff:127.0.0.1]"]
)
def test_private_addresses_are_refused_before_any_connection(
    server: LocalServer, host: str
) -> None:
    server.routes["/a.png"] = serve(PNG)
    error = refused(server.url("/a.png", host), limits(allowed_domains=("*",), allow_private=False))
    assert error.status == 400 and error.code == "image_url_not_allowed"
    assert "private" in error.message
    assert server.seen == []


def test_a_name_with_any_private_address_is_refused(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(media_fetch, "resolve", names({"mixed.test": "8.8.8.8 10.1.2.3"}))
    lim = limits(allowed_domains=("mixed.test",), allow_private=False)
    assert refused(server.url("/a.png", "mixed.test"), lim).code == "image_url_not_allowed"


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("64:ff9b::808:808", True),  # NAT64 of a public address
        ("127.0.0.1", False),
        ("10.0.0.1", False),
        ("172.16.5.4", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),  # shared (carrier-grade NAT) space
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
    ],
)
def test_which_addresses_are_public(address: str, public: bool) -> None:
    assert media_fetch.is_public(ipaddress.ip_address(address)) is public


def test_hosts_off_the_allow_list_are_refused_without_a_lookup(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(media_fetch, "resolve", names({}))  # any lookup would raise KeyError
    error = refused(server.url("/a.png", "other.test"), limits(allowed_domains=("images.test",)))
    assert error.code == "image_url_not_allowed" and "'other.test'" in error.message
    error = refused(server.url("/a.png"), limits(allowed_domains=()))
    assert "data URL or base64" in error.message
    userinfo = f"http://images.test@127.0.0.1:{server.port}/a.png"
    assert refused(userinfo).code == "image_url_not_allowed"
    assert server.seen == []


def test_allow_list_forms() -> None:
    allowed = ("images.example", "*.cdn.example", ".static.example")
    ok = ("images.example", "a.cdn.example", "a.b.cdn.example", "x.static.example")
    for host in ok:
        assert media_fetch.host_allowed(host, allowed), host
    for host in ("cdn.example", "static.example", "evilimages.example", "images.example.evil"):
        assert not media_fetch.host_allowed(host, allowed), host
    assert media_fetch.host_allowed("anything.example", ("*",))


def test_a_redirect_to_a_private_address_is_refused(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cdn.test stands for a public host (its address, 127.0.0.1, counted as public here)
    monkeypatch.setattr(
        media_fetch, "resolve", names({"cdn.test": "127.0.0.1", "inner.test": "10.0.0.1"})
    )
    monkeypatch.setattr(
        media_fetch, "is_public", lambda a: str(a) == "127.0.0.1" or not a.is_private
    )
    server.routes["/a.png"] = serve(PNG)
    server.routes["/hop"] = redirect(server.url("/a.png", "inner.test"))
    server.routes["/literal"] = redirect(server.url("/a.png", "10.0.0.1"))
    lim = limits(allowed_domains=("cdn.test", "inner.test", "10.0.0.1"), allow_private=False)
    assert load(server.url("/a.png", "cdn.test"), lim).size == (37, 23)  # the stand-in works
    for path in ("/hop", "/literal"):
        server.seen.clear()
        assert refused(server.url(path, "cdn.test"), lim).code == "image_url_not_allowed"
        assert [p for p, _ in server.seen] == [path]
    # and off the allow-list
    server.seen.clear()
    error = refused(
        server.url("/hop", "cdn.test"), dataclasses.replace(lim, allowed_domains=("cdn.test",))
    )
    assert "'inner.test'" in error.message and [p for p, _ in server.seen] == ["/hop"]


def test_redirects_are_followed_up_to_the_limit(server: LocalServer) -> None:
    server.routes["/a.png"] = serve(PNG)
    for hop in range(3):
        server.routes[f"/r{hop}"] = redirect(f"/r{hop + 1}" if hop < 2 else "/a.png")
    assert load(server.url("/r0"), limits(max_redirects=3)).size == (37, 23)
    server.seen.clear()
    error = refused(server.url("/r0"), limits(max_redirects=2))
    assert error.status == 400 and "--max-media-redirects" in error.message
    assert [p for p, _ in server.seen] == ["/r0", "/r1", "/r2"]


def test_a_stalled_server_is_given_up_at_the_timeout(server: LocalServer) -> None:
    server.routes["/slow.png"] = stall
    start = time.monotonic()
    error = refused(server.url("/slow.png"), limits(fetch_timeout_s=0.5))
    assert time.monotonic() - start < 1.5
    assert isinstance(error, ImageFetchTimeoutError) and error.status == 408
    assert "--media-fetch-timeout" in error.message


def test_bodies_above_the_cap_are_413(server: LocalServer) -> None:
    server.routes["/declared"] = serve(PNG, length=10_000_000)
    server.routes["/endless"] = endless
    lim = limits(max_bytes=65536, fetch_timeout_s=5.0)
    error = refused(server.url("/declared"), lim)
    assert error.status == 413 and "10000000 bytes" in error.message
    start = time.monotonic()
    assert refused(server.url("/endless"), lim).status == 413  # not the timeout's 408
    assert time.monotonic() - start < 2


@pytest.mark.parametrize(
    ("action", "code", "said"),
    [
        (serve(b"<html></html>", "text/html"), "unsupported_image_format", "'text/html'"),
        (serve(encoded(noise("RGB"), "BMP"), "image/bmp"), "unsupported_image_format", "BMP"),
        (serve(PNG[:100]), "invalid_image", "truncated"),
        (None, "image_fetch_failed", "HTTP 404"),
    ],
)
def test_bad_answers_are_400_naming_why(
    server: LocalServer, action: Action | None, code: str, said: str
) -> None:
    if action is not None:
        server.routes["/x"] = action
    error = refused(server.url("/x"))
    assert (error.status, error.code) == (400, code) and said in error.message


def test_an_octet_stream_or_untyped_body_is_decoded(server: LocalServer) -> None:
    server.routes["/bytes"] = serve(PNG, "application/octet-stream")
    server.routes["/untyped"] = serve(PNG, "")
    for path in ("/bytes", "/untyped"):
        assert load(server.url(path)).size == (37, 23)


def test_an_unreachable_host_is_400(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket_bound() as port:  # bound, not listening: the connection is refused
        error = refused(f"http://127.0.0.1:{port}/a.png")
    assert error.code == "image_fetch_failed"
    monkeypatch.setattr(media_fetch, "resolve", names({"none.test": ""}))
    lim = limits(allowed_domains=("none.test",))
    assert "cannot be resolved" in refused("http://none.test/a.png", lim).message


def test_the_next_address_is_tried_when_one_refuses(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nothing listens on 127.0.0.2 (the server is bound to 127.0.0.1 alone)
    monkeypatch.setattr(media_fetch, "resolve", names({"two.test": "127.0.0.2 127.0.0.1"}))
    server.routes["/a.png"] = serve(PNG)
    assert load(server.url("/a.png", "two.test"), limits(allowed_domains=("two.test",))).size == (
        37,
        23,
    )


class socket_bound:
    """A port bound and not listening, for the time of a with block."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


# --- https: the certificate is checked against the URL's name, not the pinned address ------


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalServer, Path, list[str]]]:
    directory = tmp_path_factory.mktemp("tls")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            require_tool("openssl"),
            *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-nodes", "-days", "1", "-keyout", str(key), "-out", str(cert)),
            *("-subj", "/CN=images.test", "-addext", "subjectAltName=DNS:images.test"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    names_seen: list[str] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: names_seen.append(str(name))
    server = LocalServer()
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, cert, names_seen
    server.shutdown()
    server.server_close()


def test_https_sends_the_urls_name_and_checks_its_certificate(
    tls_server: tuple[LocalServer, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, cert, names_seen = tls_server
    server.routes["/a.png"] = serve(PNG)
    monkeypatch.setattr(media_fetch, "tls_context", lambda: ssl.create_default_context(cafile=cert))
    monkeypatch.setattr(
        media_fetch, "resolve", names({"images.test": "127.0.0.1", "other.test": "127.0.0.1"})
    )
    lim = limits(allowed_domains=("images.test", "other.test"))
    assert load(server.url("/a.png", "images.test", "https"), lim).size == (37, 23)
    assert names_seen[-1] == "images.test"
    assert server.seen[-1] == ("/a.png", f"images.test:{server.port}")
    # the same address under a name the certificate does not carry
    error = refused(server.url("/a.png", "other.test", "https"), lim)
    assert error.code == "image_fetch_failed" and "certificate" in error.message.lower()


# --- bounded memory --------------------------------------------------------------------------


def test_the_budget_serves_in_order_within_its_total() -> None:
    async def scenario() -> list[str]:
        budget = Budget(10)
        order: list[str] = []

        async def taker(name: str, units: int) -> None:
            await budget.take(units)
            order.append(name)

        await budget.take(6)
        tasks = [asyncio.create_task(taker(n, u)) for n, u in (("b", 6), ("c", 1), ("d", 20))]
        await asyncio.sleep(0)
        assert order == []  # c fits but waits behind b
        budget.give(6)
        await asyncio.sleep(0)
        assert order == ["b", "c"] and budget.held == 7
        budget.give(6)
        budget.give(1)
        await asyncio.gather(*tasks)  # d, larger than the total, runs alone
        assert budget.held == 20
        budget.give(20)
        return order

    assert asyncio.run(scenario()) == ["b", "c", "d"]


def test_a_left_waiter_neither_holds_nor_blocks() -> None:
    async def scenario() -> None:
        budget = Budget(2)
        await budget.take(2)
        left = asyncio.create_task(budget.take(1))
        await asyncio.sleep(0)
        left.cancel()
        waiting = asyncio.create_task(budget.take(1))
        await asyncio.sleep(0)
        budget.give(2)
        await waiting
        assert budget.held == 1

    asyncio.run(scenario())


def test_many_images_at_once_all_load_and_give_back_their_budgets() -> None:
    refs = [data_url(encoded(noise("RGB", (64, 64), seed=i), "PNG")) for i in range(40)]

    async def scenario() -> None:
        budgets = Budgets.new()
        loads = (load_image(r, LIMITS, budgets, what=WHAT) for r in refs)
        images = await asyncio.gather(*loads)
        assert all(i.size == (64, 64) for i in images)
        assert budgets.images.held == 0 and budgets.pixels.held == 0

    asyncio.run(scenario())


# --- settings --------------------------------------------------------------------------------


def test_limits_from_the_flags() -> None:
    assert MediaLimits.from_settings(ServerSettings()) == MediaLimits(
        (), False, 5.0, 20 * 1024 * 1024, 3, 50_000_000
    )
    settings = parse_settings(
        [
            *("serve", "--allowed-media-domains", "Images.Example.", "*.cdn.example"),
            *("--allow-private-media-addresses", "--media-fetch-timeout", "2.5"),
            *(
                "--max-image-bytes",
                "1000",
                "--max-image-pixels",
                "4000",
                "--max-media-redirects",
                "0",
            ),
        ]
    )
    assert MediaLimits.from_settings(settings) == MediaLimits(
        ("images.example", "*.cdn.example"), True, 2.5, 1000, 0, 4000
    )


@pytest.mark.parametrize("entry", ["https://images.example", "images.example/path", "a b"])
def test_a_url_is_not_a_media_domain(entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["serve", "--allowed-media-domains", entry])
    assert "--allowed-media-domains" in capsys.readouterr().err
