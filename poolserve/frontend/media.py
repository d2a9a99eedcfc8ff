"""Image inputs as decoded, bounded PIL images: a data URL, bare base64, or an http(s) URL on an
allowed host (fetched by `media_fetch.py`). Sizes are checked before any work they bound: the
base64 text before decoding, the body while it streams, the pixels from the header before the
image is decoded; decoding runs in a worker thread, and a process holds a bounded number of
images and decoded pixels at once."""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from PIL import Image, UnidentifiedImageError

from poolserve.config.settings import ServerSettings
from poolserve.frontend.media_fetch import FetchPolicy, fetch, too_many_bytes
from poolserve.types.errors import (
    ImageFetchTimeoutError,
    ImageTooLargeError,
    InvalidImageError,
    clip,
)

T = TypeVar("T")

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what PIL may parse: no other plugin sees the bytes
DATA_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"})
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # base64 never holds a colon
# Leading bytes of formats, to name what a refused image is.
SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"%PDF", "PDF"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"qoif", "QOI"),
)
# Images loading at once in one process (fetch and decode): each holds up to --max-image-bytes
# of encoded bytes, so 16 bound them at 320 MiB with the default; more wait their turn.
IMAGES_IN_FLIGHT = 16
# Pixels decoding at once in one process: a decode holds up to ~16 bytes a pixel at its peak
# (an RGBA image, its copy, the white ground, the composite), so about 1 GiB; an image larger
# than the budget decodes alone. Small images decode side by side on every core.
DECODE_PIXELS = 64_000_000
# Bytes of a vision-language model's patches cut and not yet sent to the engine, in one process:
# an image's patches are 24 bytes a pixel (float32, 3 channels, 2 frames), up to 24 MiB for
# Qwen2-VL's default 1,003,520 pixels; a request holding more than the budget runs alone.
PATCH_BYTES = 1 << 30


@dataclass(frozen=True)
class MediaLimits:
    """What image inputs may be and reach; one value for the whole server."""

    allowed_domains: tuple[str, ...]  # hosts whose http(s) URLs may be fetched; empty: none
    allow_private: bool  # private/loopback/link-local/reserved addresses allowed (off by default)
    fetch_timeout_s: float  # the whole fetch (connect, redirects, body) of one image
    max_bytes: int  # encoded image bytes (a data URL's payload after base64 decoding, or a body)
    max_redirects: int
    max_pixels: int  # width * height of the decoded image (decompression bombs)

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> MediaLimits:
        """The limits the server's flags set."""
        return cls(
            allowed_domains=tuple(settings.allowed_media_domains),
            allow_private=settings.allow_private_media_addresses,
            fetch_timeout_s=settings.media_fetch_timeout,
            max_bytes=settings.max_image_bytes,
            max_redirects=settings.max_media_redirects,
            max_pixels=settings.max_image_pixels,
        )


async def load_image(ref: str, limits: MediaLimits, budgets: Budgets, *, what: str) -> Image.Image:
    """The image `ref` names, decoded, fully loaded, as an RGB image.

    `ref`: a data URL (data:image/png;base64,...: PNG, JPEG, WebP or GIF), bare base64 (as
    vLLM's, Cohere's and Infinity's clients may send), or an http(s) URL on an allowed host.
    `what` names the input in error messages and as the error's param (e.g. "input 2");
    `budgets` are the process's (the front end's state holds them): what its loads hold at once.

    Returns the first frame (of a GIF or animated WebP) exactly as transformers' `convert_to_rgb`
    (image_transforms, 5.x) gives it for the image PIL opens: transparency (an alpha band or a
    transparency key) composited onto white, any other mode converted to RGB; so the image
    processors' own conversion leaves it unchanged. The EXIF orientation is not applied, as
    neither the processors nor vLLM apply it.

    Raises InvalidImageError (400: bad reference or base64, a URL refused or not fetched, an
    unsupported, corrupt or truncated image), ImageTooLargeError (413: above max_bytes or
    max_pixels) or ImageFetchTimeoutError (408: not fetched within fetch_timeout_s).
    """
    payload = _base64_payload(ref, limits, what)  # a malformed reference waits for nothing
    await budgets.images.take(1)
    try:
        data = payload if payload is not None else await _fetched(ref, limits, what)
        image = await _in_thread(_open, data, limits, what)
        num_pixels = image.width * image.height
        await budgets.pixels.take(num_pixels)
        release = functools.partial(budgets.pixels.give, num_pixels)
        return await _in_thread(_decoded, image, what, release=release)
    finally:
        budgets.images.give(1)


def _base64_payload(ref: str, limits: MediaLimits, what: str) -> str | None:
    """The base64 text of a data URL or of bare base64, its length bounded; None for an
    http(s) URL."""
    if ref[:5].lower() == "data:":
        spec, comma, payload = ref[5:].partition(",")
        params = [p.strip().lower() for p in spec.split(";")]
        if not comma or params[-1] != "base64":
            raise InvalidImageError(
                f"{what}: a data URL must be data:image/<type>;base64,<data>", what
            )
        if params[0] not in DATA_TYPES:
            raise InvalidImageError(
                f"{what}: a data URL of {clip(params[0])!r}; PNG, JPEG, WebP and GIF images "
                "are accepted",
                what,
                "unsupported_image_format",
            )
    elif (scheme := SCHEME.match(ref)) is not None:
        if scheme.group().lower() in ("http:", "https:"):
            return None
        raise InvalidImageError(
            f"{what}: {clip(scheme.group())!r} URLs are not accepted; send a data URL, base64 "
            "or an http(s) URL",
            what,
            "image_url_not_allowed",
        )
    else:
        payload = ref
    # 4 characters per 3 bytes, and room for line breaks (MIME's every 76, CRLF included)
    encoded = 4 * -(-limits.max_bytes // 3)
    if len(payload) > encoded + encoded // 16 + 16:
        raise ImageTooLargeError(
            f"{what}: {len(payload)} characters of base64 hold more than the limit of "
            f"{limits.max_bytes} bytes (--max-image-bytes)",
            what,
        )
    return payload


async def _fetched(url: str, limits: MediaLimits, what: str) -> bytes:
    """An image URL's body, the whole fetch within fetch_timeout_s."""
    policy = FetchPolicy(
        limits.allowed_domains, limits.allow_private, limits.max_bytes, limits.max_redirects
    )
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            return await fetch(url, policy, what)
    except TimeoutError:
        raise ImageFetchTimeoutError(
            f"{what}: the image URL was not fetched within {limits.fetch_timeout_s:g} s "
            "(--media-fetch-timeout)",
            what,
        ) from None


def _b64decode(payload: str, what: str) -> bytes:
    """Standard base64, with line breaks and missing padding tolerated."""
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:  # binascii.Error, or a character outside ASCII
        pass
    compact = "".join(payload.split())
    compact += "=" * (-len(compact) % 4)
    try:
        return base64.b64decode(compact, validate=True)
    except ValueError:
        raise InvalidImageError(
            f"{what} is not a data URL, an http(s) URL or valid base64", what
        ) from None


def _open(data: bytes | str, limits: MediaLimits, what: str) -> Image.Image:
    """The image's header read (its size known, its pixels not decoded), within max_pixels."""
    if isinstance(data, str):
        data = _b64decode(data, what)
    if len(data) > limits.max_bytes:
        raise too_many_bytes(what, len(data), limits.max_bytes)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(
            f"{what}: {clip(str(exc), 200)} (--max-image-pixels)", what, "image_too_large"
        ) from None
    except UnidentifiedImageError:
        raise _unsupported(data, what) from None
    except Exception as exc:  # a plugin's own error on hostile bytes is the bytes' fault
        raise _corrupt(what, exc) from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageTooLargeError(
            f"{what}: the image is {width}x{height}, {width * height} pixels, above the limit "
            f"of {limits.max_pixels} (--max-image-pixels)",
            what,
        )
    return image


def _decoded(image: Image.Image, what: str) -> Image.Image:
    """The first frame decoded, as transformers' `convert_to_rgb` converts it."""
    try:
        image.load()
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(f"{what}: {clip(str(exc), 200)}", what) from None
    except MemoryError:
        raise
    except Exception as exc:  # truncated or corrupt data, whatever the decoder raises for it
        raise _corrupt(what, exc) from None


def _unsupported(data: bytes, what: str) -> InvalidImageError:
    """Why PIL found no PNG, JPEG, WebP or GIF: another format, or a broken one of these."""
    name = next((n for magic, n in SIGNATURES if data.startswith(magic)), None)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        name = "WEBP"
    elif data[4:8] == b"ftyp":
        name = "AVIF" if data[8:12] in (b"avif", b"avis") else "HEIF"
    elif data.lstrip()[:5] in (b"<svg ", b"<?xml"):
        name = "SVG"
    if name in FORMATS:
        return _corrupt(what, None)
    said = f"a {name} image" if name else "not an image PIL recognises"
    return InvalidImageError(
        f"{what} is {said}; PNG, JPEG, WebP and GIF images are accepted",
        what,
        "unsupported_image_format",
    )


def _corrupt(what: str, exc: Exception | None) -> InvalidImageError:
    why = f": {clip(str(exc) or type(exc).__name__)}" if exc is not None else ""
    return InvalidImageError(f"{what} is a truncated or corrupt image{why}", what)


async def _in_thread(
    work: Callable[..., T], *args: object, release: Callable[[], None] | None = None
) -> T:
    """work(*args) in a worker thread; `release` runs when the thread ends, not when a caller
    that left stops waiting (a thread cannot be stopped)."""
    running = asyncio.get_running_loop().run_in_executor(None, work, *args)

    def finished(future: asyncio.Future[T]) -> None:
        if release is not None:
            release()
        if not future.cancelled():
            future.exception()  # retrieved: a caller that left cannot log it as unhandled

    running.add_done_callback(finished)
    return await asyncio.shield(running)


class Budget:
    """Units held at once on one event loop, taken in arrival order; a taker asking for more
    than the whole budget runs when nothing else holds any."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def take(self, units: int) -> None:
        """Hold `units`, waiting behind earlier takers until they fit."""
        if not self._waiters and self._fits(units):
            self.held += units
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((units, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give(units)  # granted just as the taker left
            else:
                self._wake()  # the next in line may fit now
            raise

    def give(self, units: int) -> None:
        """Give back what take() held."""
        self.held -= units
        self._wake()

    def _fits(self, units: int) -> bool:
        return self.held == 0 or self.held + units <= self.total

    def _wake(self) -> None:
        while self._waiters:
            units, waiter = self._waiters[0]
            if waiter.done():  # its taker left
                self._waiters.popleft()
            elif self._fits(units):
                self._waiters.popleft()
                self.held += units
                waiter.set_result(None)
            else:
                return


@dataclass(frozen=True)
class Budgets:
    """What one process's image loads hold at once (the front end's state holds its own; a
    waiter belongs to the one event loop the state serves)."""

    images: Budget
    pixels: Budget
    patches: Budget

    @classmethod
    def new(cls) -> Budgets:
        """A process's budgets: IMAGES_IN_FLIGHT loads, DECODE_PIXELS being decoded,
        PATCH_BYTES of patches on their way to the engine."""
        return cls(Budget(IMAGES_IN_FLIGHT), Budget(DECODE_PIXELS), Budget(PATCH_BYTES))
