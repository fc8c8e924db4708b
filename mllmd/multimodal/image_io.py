"""Image sources of chat requests: fetch, check and decode one image to an upright RGB picture.

Torch-free: the main process imports it to refuse bad requests early, the tokenizer worker to decode.
Pillow is imported on first use.

Sources (the `url` of an OpenAI `image_url` part):
  * `data:[<media type>][;params];base64,<data>`: base64 only; whitespace and missing `=` padding are
    tolerated, any other character outside the standard alphabet is an error;
  * an absolute path, or a `file://` URL: symlinks are resolved first (`Path.resolve(strict=True)`), then
    the real path must lie inside one of `server.media_dirs` (none by default: local paths are off). A
    missing file and a file outside the folders get the same answer, so a client cannot probe the disk;
  * `http://` and `https://`: only with `server.allow_remote_images` (off by default). Every address the
    host resolves to is checked: loopback, link-local (cloud metadata), unspecified and multicast
    addresses are refused, IPv4-mapped IPv6 included. The connection goes to the checked address (no
    second DNS lookup to rebind), TLS still verifies the host name, redirects are followed at most
    `MAX_REDIRECTS` times and every hop is checked again. Addresses of the appliance's own LAN
    interfaces are not refused (LAN hosts are the point of allowing remote images).

Limits (`ImageLimits`; defaults in brackets):
  * `max_bytes` [12 MiB]: encoded bytes of one image, checked before decoding (Content-Length and the
    bytes actually read for http, the file size for paths, the base64 length for data URLs);
  * `max_pixels` [50,000,000] (`server.max_image_decode_pixels`): width x height of the stored image,
    read from its header before any pixel is decoded (the decompression-bomb guard). Pillow's own guard
    (`Image.MAX_IMAGE_PIXELS`, raised at 2x that value) is reported under the same rule. This is not
    the resize cap (`server.max_image_pixels`, `image_processing.DEFAULT_RESIZE_MAX_PIXELS`): an
    allowed image is then resized down to that;
  * `max_images` [8]: images per request (`check_image_count`);
  * `remote_timeout` [10 s]: connect/read timeout and the whole download's deadline.
Peak memory while decoding one image is bounded by about 28 bytes x `max_pixels` (decoded pixels, an
RGBA copy, the white background when the image has transparency, a rotated copy for EXIF orientation;
measured: 28 B/px for a lossless RGBA WebP, 24 for an RGBA PNG with EXIF rotation, 20 for RGBA alone):
1.4 GB at the default, so a Jetson deployment may want a lower `max_pixels`.

Formats: PNG, JPEG, WebP, GIF (first frame), BMP; Pillow is told to try only these decoders (never EPS,
which would start Ghostscript, or any other plugin). An aspect ratio over 200 is refused before decoding
(Qwen's `smart_resize` rule). Decoding: EXIF orientation applied (as transformers' `load_image`), then
transparency (an alpha band, or a palette/RGB `transparency` entry) composited onto white, as the
processor's `convert_to_rgb` does (a plain `convert("RGB")` would give black), then RGB.

Every refusal is an `ImageError(message, rule)`; the message names the rule (the config key, or an
`image.*` tag for malformed input) so that the HTTP layer can answer 400 with it.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import logging
import os
import re
import socket
import ssl
import stat
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urljoin, urlsplit

if TYPE_CHECKING:
    from PIL import Image as PILImage

MIB = 1024 * 1024
DEFAULT_MAX_BYTES = 12 * MIB
DEFAULT_MAX_PIXELS = 50_000_000
DEFAULT_MAX_IMAGES = 8
DEFAULT_REMOTE_TIMEOUT = 10.0
MAX_REDIRECTS = 3
MAX_ASPECT_RATIO = 200
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_READ_CHUNK = 64 * 1024

# Rules: config keys for the limits a deployment sets, `image.*` tags for malformed input.
logger = logging.getLogger("mllmd.images")

RULE_BYTES = "server.max_image_bytes"
RULE_PIXELS = "server.max_image_decode_pixels"
RULE_COUNT = "server.max_images_per_request"
RULE_MEDIA_DIRS = "server.media_dirs"
RULE_REMOTE = "server.allow_remote_images"
RULE_REMOTE_ADDRESS = "image.remote_address"
RULE_URL = "image.url"
RULE_BASE64 = "image.base64"
RULE_FORMAT = "image.format"
RULE_DECODE = "image.decode"
RULE_ASPECT = "image.aspect_ratio"
RULE_FETCH = "image.fetch"

_WHITESPACE = re.compile(r"[ \t\r\n\f\v]+")


class ImageError(ValueError):
    """An image was refused; `rule` names the limit or check (e.g. "server.max_image_bytes", "image.decode")."""

    def __init__(self, message: str, rule: str) -> None:
        super().__init__(message)
        self.message = message
        self.rule = rule


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be; one value per deployment (see the module docstring)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES
    allow_remote: bool = False
    media_dirs: tuple[str, ...] = field(default=())
    remote_timeout: float = DEFAULT_REMOTE_TIMEOUT

    def __post_init__(self) -> None:
        object.__setattr__(self, "media_dirs", tuple(str(d) for d in self.media_dirs))
        for name in ("max_bytes", "max_pixels", "max_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImageLimits.{name} must be at least 1 (got {getattr(self, name)})")
        if not self.remote_timeout > 0:
            raise ValueError(f"ImageLimits.remote_timeout must be positive (got {self.remote_timeout})")


def check_image_count(count: int, limits: ImageLimits) -> None:
    """Refuse a request that carries more images than `limits.max_images`."""
    if count > limits.max_images:
        raise ImageError(
            f"{count} images in the request exceeds {RULE_COUNT}={limits.max_images}", RULE_COUNT
        )


def load_images(urls: Sequence[str], limits: ImageLimits) -> list[PILImage.Image]:
    """`load_image` for each URL of a request, in order, after the count check (images numbered from 1)."""
    check_image_count(len(urls), limits)
    return [load_image(url, limits, index=i + 1) for i, url in enumerate(urls)]


def load_image(url: str, limits: ImageLimits, *, index: int | None = None) -> PILImage.Image:
    """Fetch, check and decode one image URL into an upright RGB picture; ImageError on any refusal.

    `index` (1-based) prefixes messages with "image N: " so that a client knows which image failed.
    """
    where = f"image {index}: " if index is not None else "image: "
    return decode_image(read_image_bytes(url, limits, where=where), limits, where=where)


def read_image_bytes(url: str, limits: ImageLimits, *, where: str = "image: ") -> bytes:
    """The encoded bytes behind `url` (data URL, media-dir path or allowed remote URL), size-capped."""
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where}the image URL is empty ({RULE_URL})", RULE_URL)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _decode_data_url(url, limits, where)
    if scheme in ("http", "https"):
        return _fetch_remote(url, limits, where)
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageError(
                f"{where}file URLs must name a local path, not host {parts.netloc!r} ({RULE_URL})", RULE_URL
            )
        return _read_local(unquote(parts.path), limits, where)
    if url.startswith("/"):
        return _read_local(url, limits, where)
    shown = url if len(url) <= 64 else url[:61] + "..."
    raise ImageError(
        f"{where}unsupported image URL {shown!r}: expected a data: URL, an absolute path or file:// URL "
        f"inside {RULE_MEDIA_DIRS}, or http(s) ({RULE_URL})",
        RULE_URL,
    )


# --- data: URLs ---------------------------------------------------------------------------------


def _decode_data_url(url: str, limits: ImageLimits, where: str) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ImageError(f"{where}malformed data URL: no ',' before the data ({RULE_URL})", RULE_URL)
    params = [p.strip().lower() for p in header.split(";")]
    if params[0] and not params[0].startswith("image/") and params[0] != "application/octet-stream":
        shown = params[0] if len(params[0]) <= 64 else params[0][:61] + "..."
        raise ImageError(f"{where}a data URL of type {shown!r} is not an image: expected image/png, image/jpeg, "
                         f"image/webp, image/gif or image/bmp ({RULE_URL})", RULE_URL)
    if "base64" not in params[1:]:
        raise ImageError(f"{where}data URLs must be base64-encoded (';base64,') ({RULE_BASE64})", RULE_BASE64)
    return decode_base64(payload, limits, where=where)


def decode_base64(payload: str, limits: ImageLimits, *, where: str = "image: ") -> bytes:
    """Strict base64 that tolerates whitespace and missing padding; the size cap is checked first."""
    text = _WHITESPACE.sub("", payload)
    body = text.rstrip("=")
    if len(text) - len(body) > 2:
        raise ImageError(
            f"{where}invalid base64 in the data URL: too much '=' padding ({RULE_BASE64})", RULE_BASE64
        )
    if len(body) * 3 // 4 > limits.max_bytes:
        raise ImageError(
            f"{where}about {len(body) * 3 // 4} bytes exceeds {RULE_BYTES}={limits.max_bytes}", RULE_BYTES
        )
    if len(body) % 4 == 1:
        raise ImageError(f"{where}invalid base64 in the data URL: truncated ({RULE_BASE64})", RULE_BASE64)
    try:
        return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(
            f"{where}invalid base64 in the data URL: {exc} ({RULE_BASE64})", RULE_BASE64
        ) from None


# --- local files --------------------------------------------------------------------------------


def _read_local(path_text: str, limits: ImageLimits, where: str) -> bytes:
    if not limits.media_dirs:
        raise ImageError(
            f"{where}local image paths are disabled ({RULE_MEDIA_DIRS} is empty)", RULE_MEDIA_DIRS
        )
    path = Path(path_text)
    if not path.is_absolute():
        raise ImageError(f"{where}image paths must be absolute, got {path_text!r} ({RULE_URL})", RULE_URL)
    refused = ImageError(
        f"{where}{path_text} is not a readable file inside {RULE_MEDIA_DIRS}", RULE_MEDIA_DIRS
    )
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, unreadable, a NUL in the path
        raise refused from None
    roots = [Path(os.path.realpath(d)) for d in limits.media_dirs]
    if not any(real == root or real.is_relative_to(root) for root in roots):
        raise refused
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        fd = os.open(real, flags)
    except OSError:
        raise refused from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a folder, FIFO or device inside a media dir
        os.close(fd)
        raise refused
    with os.fdopen(fd, "rb") as f:
        if info.st_size > limits.max_bytes:
            raise ImageError(
                f"{where}{info.st_size} bytes exceeds {RULE_BYTES}={limits.max_bytes}", RULE_BYTES
            )
        data = f.read(limits.max_bytes + 1)
    if len(data) > limits.max_bytes:  # grew while we read it
        raise ImageError(f"{where}more than {limits.max_bytes} bytes exceeds {RULE_BYTES}", RULE_BYTES)
    return data


# --- remote URLs --------------------------------------------------------------------------------


# Cloud metadata services outside the link-local range (169.254.169.254 is link-local already):
# Alibaba's, AWS's IPv6 one, and Oracle's.
_METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("100.100.100.200", "fd00:ec2::254", "192.0.0.192"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known NAT64 prefix: an IPv4 address in its last 32 bits
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # Linux connects 0.x.y.z to this host


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches (mapped, NAT64, 6to4), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def _address_refusal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why the appliance must not connect to `address` (None: allowed)."""
    if address in _METADATA_ADDRESSES:
        return "cloud metadata"
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None:
            return _address_refusal(inner)
    elif address in _THIS_NETWORK:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    return None


def resolve_remote_host(host: str, port: int, *, where: str = "image: ") -> str:
    """The address to connect to for `host`; ImageError if any address it resolves to is refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise _unfetched(where, host, port, f"cannot resolve the host: {exc}") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise _unfetched(where, host, port, "the host has no address")
    for text in addresses:
        why = _address_refusal(ipaddress.ip_address(text))
        if why is not None:
            raise ImageError(
                f"{where}remote image host {host!r} resolves to the {why} address {text}, which is never fetched "
                f"({RULE_REMOTE_ADDRESS})",
                RULE_REMOTE_ADDRESS,
            )
    return addresses[0]


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """HTTP to an address checked beforehand (the Host header still names the host)."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to an address checked beforehand; the certificate is verified against the host name."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        self._tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self._tls)
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host)


def _fetch_remote(url: str, limits: ImageLimits, where: str) -> bytes:
    if not limits.allow_remote:
        raise ImageError(f"{where}remote image URLs are disabled ({RULE_REMOTE} is false)", RULE_REMOTE)
    deadline = time.monotonic() + limits.remote_timeout
    for _hop in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ImageError(f"{where}unsupported remote image URL {url[:80]!r} ({RULE_URL})", RULE_URL)
        if parts.username is not None or parts.password is not None:
            raise ImageError(f"{where}remote image URLs must not carry credentials ({RULE_URL})", RULE_URL)
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise ImageError(f"{where}invalid port in the image URL ({RULE_URL})", RULE_URL) from None
        address = resolve_remote_host(parts.hostname, port, where=where)
        cls = _PinnedHTTPSConnection if scheme == "https" else _PinnedHTTPConnection
        conn = cls(parts.hostname, port, address, limits.remote_timeout)
        # The socket timeout bounds one read, not the download: a server sending a byte every few
        # seconds (headers or body) would hold the fetch for ever. The watchdog shuts the socket at
        # the deadline, which ends any read in progress.
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (conn,))
        watchdog.daemon = True
        watchdog.start()
        response = None
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"User-Agent": "mllmd", "Accept": "image/*"})
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                if not location:
                    raise _unfetched(where, parts.hostname, port, "a redirect without a Location")
                url = urljoin(url, location)
                continue
            if response.status != 200:
                raise _unfetched(where, parts.hostname, port, f"HTTP {response.status} {response.reason}")
            data = _read_capped(response, limits, deadline, where)
            if time.monotonic() >= deadline:  # the watchdog cut it: what was read is not the whole image
                raise _unfetched(where, parts.hostname, port, f"the download took longer than {limits.remote_timeout:g} s")
            return data
        except (OSError, http.client.HTTPException) as exc:
            why = f"the download took longer than {limits.remote_timeout:g} s" if time.monotonic() >= deadline else str(exc)
            raise _unfetched(where, parts.hostname, port, why) from None
        finally:
            watchdog.cancel()
            if response is not None:
                response.close()
            conn.close()
    raise _unfetched(where, urlsplit(url).hostname or "?", 0, f"more than {MAX_REDIRECTS} redirects")


def _shut(conn: http.client.HTTPConnection) -> None:
    """The watchdog's end of a download past its deadline: shut the socket, ending a blocked read."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _unfetched(where: str, host: str, port: int, why: str) -> ImageError:
    """A remote image that could not be fetched. The client learns only that: whether the host does not
    resolve, refuses the connection, times out or answers 404 would map the LAN's hosts and ports for
    whoever may send image URLs. The reason goes to the log, for the administrator."""
    logger.info("a remote image from %r port %d could not be fetched: %s", host[:253], port, why[:300])
    return ImageError(f"{where}the image could not be fetched from {host[:253]!r} ({RULE_FETCH}; the server's log "
                      "says why)", RULE_FETCH)


def _read_capped(
    response: http.client.HTTPResponse, limits: ImageLimits, deadline: float, where: str
) -> bytes:
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > limits.max_bytes:
        raise ImageError(f"{where}{int(length)} bytes exceeds {RULE_BYTES}={limits.max_bytes}", RULE_BYTES)
    chunks: list[bytes] = []
    total = 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("past the download deadline")  # _fetch_remote reports it
        chunk = response.read1(_READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > limits.max_bytes:
            raise ImageError(f"{where}more than {limits.max_bytes} bytes exceeds {RULE_BYTES}", RULE_BYTES)
        chunks.append(chunk)


# --- decoding -----------------------------------------------------------------------------------


def decode_image(data: bytes, limits: ImageLimits, *, where: str = "image: ") -> PILImage.Image:
    """Decode encoded bytes into an upright RGB picture, checking the header before any pixel."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}{len(data)} bytes exceeds {RULE_BYTES}={limits.max_bytes}", RULE_BYTES)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as exc:
        raise _bomb_error(exc, where, limits) from None
    except UnidentifiedImageError:
        raise ImageError(
            f"{where}not an image in a supported format ({', '.join(ALLOWED_FORMATS)}) ({RULE_FORMAT})",
            RULE_FORMAT,
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"{where}unreadable image header: {exc} ({RULE_DECODE})", RULE_DECODE) from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"{where}the image has no pixels ({width}x{height}) ({RULE_DECODE})", RULE_DECODE)
    if width * height > limits.max_pixels:
        raise ImageError(
            f"{where}{width}x{height} = {width * height} pixels exceeds {RULE_PIXELS}={limits.max_pixels}",
            RULE_PIXELS,
        )
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        ratio = max(width, height) / min(width, height)
        raise ImageError(
            f"{where}aspect ratio {ratio:.1f} ({width}x{height}) exceeds {MAX_ASPECT_RATIO} ({RULE_ASPECT})",
            RULE_ASPECT,
        )
    try:
        image.load()  # the first frame only (GIF, animated WebP/PNG)
        return to_rgb(_upright(image))
    except Image.DecompressionBombError as exc:
        raise _bomb_error(exc, where, limits) from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise ImageError(
            f"{where}the image data is truncated or corrupt: {exc} ({RULE_DECODE})", RULE_DECODE
        ) from None


def _bomb_error(exc: Exception, where: str, limits: ImageLimits) -> ImageError:
    """Pillow's own guard fired (at twice its MAX_IMAGE_PIXELS, before our header check could run):
    say it in our limit's words, not Pillow's (whose limit is not the one the user can set)."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    size = f"{int(found.group(1))} pixels" if found else "the image's size"
    return ImageError(f"{where}{size} exceeds {RULE_PIXELS}={limits.max_pixels}", RULE_PIXELS)


def _upright(image: PILImage.Image) -> PILImage.Image:
    """Apply the EXIF orientation tag (a copy is made only when the tag asks for a turn or flip)."""
    from PIL import ImageOps

    orientation = image.getexif().get(0x0112, 1)
    if orientation in (2, 3, 4, 5, 6, 7, 8):
        return ImageOps.exif_transpose(image)
    return image


def to_rgb(image: PILImage.Image) -> PILImage.Image:
    """RGB with any transparency composited onto white (transformers' `convert_to_rgb` rule)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


__all__ = [
    "ALLOWED_FORMATS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_MAX_PIXELS",
    "ImageError",
    "ImageLimits",
    "check_image_count",
    "decode_base64",
    "decode_image",
    "load_image",
    "load_images",
    "read_image_bytes",
    "resolve_remote_host",
    "to_rgb",
]
