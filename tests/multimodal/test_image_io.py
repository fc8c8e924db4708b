"""Image sources: data URLs, media-dir paths, remote URLs, limits and decoding, each refusal naming its rule."""

from __future__ import annotations

import base64
import http.server
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mllmd.multimodal import image_io as io_mod
from mllmd.multimodal.image_io import ImageError, ImageLimits, check_image_count, load_image, load_images
from tests.multimodal.conftest import encode, random_rgb


def data_url(payload: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(payload).decode()


def refused(url: str, limits: ImageLimits | None = None, *, rule: str) -> ImageError:
    """Load `url`, expect an ImageError for `rule` whose message names the rule."""
    with pytest.raises(ImageError) as info:
        load_image(url, limits or ImageLimits(), index=3)
    err = info.value
    assert err.rule == rule, str(err)
    assert rule in str(err) and str(err).startswith("image 3: ")
    return err


def png_with_size(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims `width` x `height` (what a decompression bomb looks like to open)."""
    data = bytearray(encode(Image.new("RGB", (1, 1)), "PNG"))
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13]))
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


# --- data URLs and formats ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "WEBP"])
def test_lossless_formats_round_trip(fmt: str) -> None:
    image = random_rgb(37, 23)
    args = {"lossless": True} if fmt == "WEBP" else {}
    out = load_image(data_url(encode(image, fmt, **args), f"image/{fmt.lower()}"), ImageLimits())
    assert out.mode == "RGB" and out.size == (37, 23)
    assert np.array_equal(np.asarray(out), np.asarray(image))


def test_jpeg_decodes() -> None:
    out = load_image(data_url(encode(random_rgb(64, 48), "JPEG"), "image/jpeg"), ImageLimits())
    assert out.mode == "RGB" and out.size == (64, 48)


def test_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (16, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(__import__("io").BytesIO(gif)).n_frames == 2
    out = load_image(data_url(gif, "image/gif"), ImageLimits())
    assert out.mode == "RGB" and out.getpixel((3, 3)) == (255, 0, 0)


def test_base64_tolerates_missing_padding_and_whitespace() -> None:
    image = random_rgb(5, 7)
    png = encode(image, "PNG")
    png += b"\0" * ((1 - len(png)) % 3 or 3)  # ignored after IEND; len % 3 == 1 makes base64 end "=="
    raw = base64.b64encode(png).decode()
    assert raw.endswith("==")
    spaced = "\n".join(raw.rstrip("=")[i : i + 60] for i in range(0, len(raw), 60)) + " \r\n"
    out = load_image("data:image/png;base64," + spaced, ImageLimits())
    assert np.array_equal(np.asarray(out), np.asarray(image))
    assert load_image("DATA:image/png;charset=x;BASE64," + raw, ImageLimits()).size == image.size


@pytest.mark.parametrize(
    "payload",
    ["iVBORw0K*GgoAAAA", "iVBO=Rw0KGgo", "iVBORw0KGgo===", "iVBORw0KG", "iVBORw0K-_goAAAA"],
    ids=["bad-char", "inner-padding", "over-padded", "truncated", "urlsafe-alphabet"],
)
def test_broken_base64_is_refused(payload: str) -> None:
    refused("data:image/png;base64," + payload, rule="image.base64")


def test_malformed_data_urls() -> None:
    refused("data:image/png,iVBORw0KGgo", rule="image.base64")  # not base64-encoded
    refused("data:image/png;base64", rule="image.url")  # no comma
    refused("iVBORw0KGgoAAAA", rule="image.url")  # bare base64 is not a URL
    refused("ftp://example.com/x.png", rule="image.url")
    refused("", rule="image.url")


@pytest.mark.parametrize(
    "payload",
    [b"hello, this is not an image", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", b""],
    ids=["text", "eps", "empty"],
)
def test_non_images_are_refused(payload: bytes) -> None:
    refused(data_url(payload), rule="image.format")


def test_formats_outside_the_list_are_refused() -> None:
    refused(data_url(encode(random_rgb(8, 8), "TIFF"), "image/tiff"), rule="image.format")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_files_are_refused(fmt: str) -> None:
    data = encode(random_rgb(64, 64), fmt)
    refused(data_url(data[: len(data) // 2]), rule="image.decode")


# --- limits ---------------------------------------------------------------------------------------


def test_decompression_bomb_is_refused_from_the_header() -> None:
    # The headers claim 64 MP (above our 50 MP default) and 10^10 px (above Pillow's own 2x guard); the
    # data holds one pixel, so refusing for pixels (not for truncation) shows no pixel was decoded.
    err = refused(data_url(png_with_size(8000, 8000)), rule="server.max_image_decode_pixels")
    assert "64000000 pixels exceeds server.max_image_decode_pixels=50000000" in str(err)
    err = refused(data_url(png_with_size(100_000, 100_000)), rule="server.max_image_decode_pixels")
    # Pillow's guard fired first: the message still gives our limit, not Pillow's own.
    assert str(err) == "image 3: 10000000000 pixels exceeds server.max_image_decode_pixels=50000000", str(err)
    refused(
        data_url(encode(random_rgb(20, 20), "PNG")),
        ImageLimits(max_pixels=399),
        rule="server.max_image_decode_pixels",
    )
    assert load_image(data_url(encode(random_rgb(20, 20), "PNG")), ImageLimits(max_pixels=400)).size == (
        20,
        20,
    )


def test_aspect_ratio_over_200_is_refused_before_decoding() -> None:
    refused(data_url(png_with_size(201, 1)), rule="image.aspect_ratio")
    refused(data_url(png_with_size(1, 4000)), rule="image.aspect_ratio")
    assert load_image(data_url(encode(random_rgb(200, 1), "PNG")), ImageLimits()).size == (200, 1)


def test_byte_limit() -> None:
    data = encode(random_rgb(64, 64), "PNG")
    limits = ImageLimits(max_bytes=len(data) - 1)
    refused(data_url(data), limits, rule="server.max_image_bytes")
    assert load_image(data_url(data), ImageLimits(max_bytes=len(data))).size == (64, 64)


def test_image_count_limit() -> None:
    limits = ImageLimits(max_images=2)
    check_image_count(2, limits)
    with pytest.raises(ImageError) as info:
        check_image_count(3, limits)
    assert info.value.rule == "server.max_images_per_request" and "=2" in str(info.value)
    url = data_url(encode(random_rgb(4, 4), "PNG"))
    with pytest.raises(ImageError) as info:
        load_images([url, url, url], limits)
    assert info.value.rule == "server.max_images_per_request"
    with pytest.raises(ImageError) as info:
        load_images([url, "data:image/png;base64,!!"], limits)
    assert str(info.value).startswith("image 2: ")


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        ImageLimits(max_bytes=0)
    assert ImageLimits(media_dirs=["/a"]).media_dirs == ("/a",)  # type: ignore[arg-type]


# --- decoding rules -------------------------------------------------------------------------------


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (200, 10, 10))
    image.paste((10, 200, 10), (0, 0, 10, 20))  # a green left edge
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display turns it 90 degrees clockwise
    out = load_image(data_url(encode(image, "JPEG", exif=exif.tobytes(), quality=95)), ImageLimits())
    assert out.size == (20, 40)
    top = np.asarray(out)[:5].reshape(-1, 3).mean(0)
    assert top[1] > 150 and top[0] < 80  # the green edge is now on top


def test_transparency_is_composited_onto_white() -> None:
    from transformers.image_transforms import convert_to_rgb

    rgba = Image.new("RGBA", (8, 4), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 128), (0, 0, 4, 4))
    la = rgba.convert("LA")
    palette = Image.new("P", (8, 4), 0)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.paste(1, (0, 0, 4, 4))
    for image, fmt in ((rgba, "PNG"), (la, "PNG"), (palette, "PNG"), (palette, "GIF")):
        data = encode(image, fmt, **({"transparency": 0} if image.mode == "P" else {}))
        out = load_image(data_url(data), ImageLimits())
        expected = convert_to_rgb(Image.open(__import__("io").BytesIO(data)), return_numpy=True)
        assert np.array_equal(np.asarray(out), expected), (image.mode, fmt)
        assert out.getpixel((7, 0)) == (255, 255, 255)  # fully transparent: white, not black


def test_grey_image_becomes_rgb() -> None:
    out = load_image(data_url(encode(Image.new("L", (6, 6), 77), "PNG")), ImageLimits())
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (77, 77, 77)


# --- local files ----------------------------------------------------------------------------------


@pytest.fixture()
def media(tmp_path: Path) -> tuple[Path, Path, bytes]:
    inside = tmp_path / "media"
    outside = tmp_path / "private"
    inside.mkdir()
    outside.mkdir()
    data = encode(random_rgb(12, 10), "PNG")
    (inside / "a b.png").write_bytes(data)
    (outside / "secret.png").write_bytes(data)
    return inside, outside, data


def test_paths_inside_media_dirs_load(media: tuple[Path, Path, bytes]) -> None:
    inside, _, _ = media
    limits = ImageLimits(media_dirs=(str(inside),))
    assert load_image(str(inside / "a b.png"), limits).size == (12, 10)
    assert load_image((inside / "a b.png").as_uri(), limits).size == (12, 10)  # file:///.../a%20b.png
    assert load_image("file://localhost" + str(inside / "a b.png"), limits).size == (12, 10)
    (inside / "sub").mkdir()
    os.symlink(inside / "a b.png", inside / "sub" / "link.png")  # a symlink that stays inside
    assert load_image(str(inside / "sub" / "link.png"), limits).size == (12, 10)


def test_paths_outside_media_dirs_are_refused(media: tuple[Path, Path, bytes]) -> None:
    inside, outside, _ = media
    limits = ImageLimits(media_dirs=(str(inside),))
    outside_err = refused(str(outside / "secret.png"), limits, rule="server.media_dirs")
    missing_err = refused(str(inside / "nope.png"), limits, rule="server.media_dirs")
    assert "not a readable file inside server.media_dirs" in str(outside_err) and "not a readable" in str(
        missing_err
    )
    refused(str(inside / ".." / "private" / "secret.png"), limits, rule="server.media_dirs")
    os.symlink(outside / "secret.png", inside / "escape.png")
    refused(
        str(inside / "escape.png"), limits, rule="server.media_dirs"
    )  # symlinks resolved before the check
    os.symlink(outside, inside / "escape_dir")
    refused(str(inside / "escape_dir" / "secret.png"), limits, rule="server.media_dirs")
    refused("file://otherhost" + str(inside / "a b.png"), limits, rule="image.url")
    refused("media/a b.png", limits, rule="image.url")
    refused(str(inside / "a b.png"), ImageLimits(), rule="server.media_dirs")  # no media dirs: paths off


def test_special_files_and_size(media: tuple[Path, Path, bytes]) -> None:
    inside, _, data = media
    os.mkfifo(inside / "pipe.png")  # opening it for reading must not block
    limits = ImageLimits(media_dirs=(str(inside),))
    refused(str(inside / "pipe.png"), limits, rule="server.media_dirs")
    refused(str(inside), limits, rule="server.media_dirs")
    small = ImageLimits(media_dirs=(str(inside),), max_bytes=len(data) - 1)
    refused(str(inside / "a b.png"), small, rule="server.max_image_bytes")


# --- remote URLs ----------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, headers, body = self.routes.get(self.path, (404, {}, b"no"))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[tuple[str, dict[str, tuple[int, dict[str, str], bytes]]]]:
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
    handler = type("Handler", (_Handler,), {"routes": routes})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}", routes
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_remote_urls_are_off_by_default() -> None:
    refused("https://example.com/cat.png", rule="server.allow_remote_images")
    refused("http://example.com/cat.png", rule="server.allow_remote_images")


def test_local_server_is_refused_as_loopback(server: tuple[str, dict]) -> None:
    host, routes = server
    routes["/cat.png"] = (200, {"Content-Type": "image/png"}, encode(random_rgb(8, 8), "PNG"))
    allow = ImageLimits(allow_remote=True)
    err = refused(f"http://{host}/cat.png", allow, rule="image.remote_address")
    assert "loopback" in str(err)
    port = host.split(":")[1]
    refused(f"http://localhost:{port}/cat.png", allow, rule="image.remote_address")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.9.9.9/x.png", "loopback"),
        ("http://[::1]/x.png", "loopback"),
        ("http://[::ffff:127.0.0.1]/x.png", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://[fe80::1]/x.png", "link-local"),
        ("http://0.0.0.0/x.png", "unspecified"),
        ("http://[::]/x.png", "unspecified"),
        ("http://224.0.0.1/x.png", "multicast"),
        ("http://0.1.2.3/x.png", "unspecified"),  # Linux connects 0.0.0.0/8 to this host
        ("http://[64:ff9b::7f00:1]/x.png", "loopback"),  # NAT64 of 127.0.0.1
        ("http://[64:ff9b::a9fe:a9fe]/x.png", "link-local"),  # NAT64 of 169.254.169.254
        ("http://[2002:7f00:1::]/x.png", "loopback"),  # 6to4 of 127.0.0.1
        ("http://100.100.100.200/latest/meta-data", "cloud metadata"),  # Alibaba's
        ("http://[fd00:ec2::254]/latest/meta-data", "cloud metadata"),  # AWS's IPv6
    ],
)
def test_forbidden_addresses(url: str, why: str) -> None:
    err = refused(url, ImageLimits(allow_remote=True), rule="image.remote_address")
    assert why in str(err)


def test_remote_urls_with_credentials_are_refused() -> None:
    refused("http://user:pw@192.0.2.1/x.png", ImageLimits(allow_remote=True), rule="image.url")


@pytest.fixture()
def allow_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the fetch code reach the test server on 127.0.0.1 (127.0.0.2 stays refused)."""
    real = io_mod._address_refusal

    def policy(address):  # type: ignore[no-untyped-def]
        if str(address) == "127.0.0.1":
            return None
        return real(address)

    monkeypatch.setattr(io_mod, "_address_refusal", policy)


@pytest.mark.usefixtures("allow_loopback")
def test_remote_fetch_with_limits(server: tuple[str, dict]) -> None:
    host, routes = server
    image = random_rgb(9, 7)
    data = encode(image, "PNG")
    routes["/cat.png"] = (200, {"Content-Type": "image/png"}, data)
    routes["/moved"] = (302, {"Location": "/cat.png"}, b"")
    routes["/away"] = (302, {"Location": f"http://127.0.0.2:{host.split(':')[1]}/cat.png"}, b"")
    routes["/loop"] = (302, {"Location": "/loop"}, b"")
    allow = ImageLimits(allow_remote=True, remote_timeout=5)
    assert np.array_equal(np.asarray(load_image(f"http://{host}/cat.png", allow)), np.asarray(image))
    assert load_image(f"http://{host}/moved", allow).size == (9, 7)
    refused(f"http://{host}/away", allow, rule="image.remote_address")  # every hop is checked
    loop = refused(f"http://{host}/loop", allow, rule="image.fetch")
    missing = refused(f"http://{host}/missing.png", allow, rule="image.fetch")
    # a closed port, a name that does not resolve, a 404: one answer (no map of the LAN's hosts and ports)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    refusedconn = refused(f"http://127.0.0.1:{port}/x.png", allow, rule="image.fetch")
    unknown = refused("http://no-such-host.invalid/x.png", allow, rule="image.fetch")
    texts = {str(e).replace(h, "H") for e, h in ((loop, "127.0.0.1"), (missing, "127.0.0.1"),
                                                 (refusedconn, "127.0.0.1"), (unknown, "no-such-host.invalid"))}
    assert len(texts) == 1 and "could not be fetched" in texts.pop()
    small = ImageLimits(allow_remote=True, max_bytes=len(data) - 1)
    refused(f"http://{host}/cat.png", small, rule="server.max_image_bytes")


@pytest.mark.usefixtures("allow_loopback")
@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_server_dribbling_its_answer_is_cut_at_the_deadline(where: str) -> None:
    """Before: the timeout bounded one socket read, so a server sending a byte every second (headers or
    body) held the fetch, and every image request queued behind it, for ever. Now the whole download
    ends at `remote_timeout`."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n"
            if where == "body":
                conn.sendall(head)
            for byte in (b"X-Slow: " if where == "headers" else b"") + b"x" * 100:
                if stop.wait(0.3):
                    return
                try:
                    conn.sendall(bytes([byte]) if isinstance(byte, int) else byte)
                except OSError:
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        err = refused(f"http://127.0.0.1:{listener.getsockname()[1]}/x.png",
                      ImageLimits(allow_remote=True, remote_timeout=2), rule="image.fetch")
    finally:
        stop.set()
        thread.join(5)
        listener.close()
    assert "could not be fetched" in str(err)
    assert time.monotonic() - start < 5
