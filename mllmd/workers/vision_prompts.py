"""The tokenizer worker's half of a vision-language request: images loaded, checked and resized, the
prompt built around them (mllmd.multimodal.chat), and each image's pixels handed to the tensor
transport for the scheduler.

Only a chat with image parts takes this path; text prompts of a vision-language model tokenize as any
other. What the scheduler receives per image is an `ImageInput`: where its pad tokens are, its patch
grid, its content hash (the prefix cache's and the encoder cache's key) and a `TensorHandle` to its
uint8 pixels, one handle per choice (each GenerateRequest is received, and its segments released, on
its own).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mllmd.messages import ChatPrompt, ImageInput, TransportAck
from mllmd.multimodal.chat import (
    VisionPrompt,
    build_vision_prompt,
    image_parts,
    load_part,
    part_max_pixels,
    prompt_with_images,
)
from mllmd.multimodal.image_io import ImageLimits, check_image_count
from mllmd.multimodal.image_processing import (
    DEFAULT_RESIZE_MAX_PIXELS,
    ProcessedImage,
    VisionPreprocessConfig,
    process_image,
)
from mllmd.multimodal.prompt import VisionTokenIds
from mllmd.multimodal.transport import TensorSender
from mllmd.multimodal.transport_probe import probe_cuda_ipc, resolve_mode

logger = logging.getLogger("tokenizer")

MAX_QUEUED_IMAGE_REQUESTS = 16  # requests whose images wait for or are on the image thread; more: 503


def takes_images(model_path: str) -> bool:
    """Whether the model folder's config has a vision tower (Qwen3-VL, Qwen3.5)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def image_limits(server: dict[str, Any]) -> ImageLimits:
    """ImageLimits from the daemon's `server` section (as a dict: what the worker settings carry)."""
    return ImageLimits(
        max_bytes=int(server["max_image_bytes"]),
        max_pixels=int(server["max_image_decode_pixels"]),
        max_images=int(server["max_images_per_request"]),
        allow_remote=bool(server["allow_remote_images"]),
        media_dirs=tuple(server["media_dirs"]),
        remote_timeout=float(server["remote_image_timeout"]),
    )


class ImageLoad(concurrent.futures.Future):
    """One request's images, loading on the image thread: `cancel` also stops a load under way, before
    its next image."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()

    def cancel(self) -> bool:
        self.stop.set()
        return super().cancel()


class ImageLoadStopped(Exception):
    """A request's image load was cancelled between two images (its client left)."""


@dataclass
class VisionPrompts:
    """What a vision-language model's tokenizer worker keeps: the preprocessing numbers, the special
    token ids, the limits, and the sender of the pixels."""

    preprocess: VisionPreprocessConfig
    tokens: VisionTokenIds
    limits: ImageLimits
    sender: TensorSender
    resize_max_pixels: int = DEFAULT_RESIZE_MAX_PIXELS  # server.max_image_pixels
    _images: concurrent.futures.ThreadPoolExecutor | None = field(default=None, repr=False)
    _loading: list[concurrent.futures.Future[Any]] = field(default_factory=list, repr=False)
    max_queued: int = MAX_QUEUED_IMAGE_REQUESTS

    @classmethod
    def start(cls, model_path: str, server: dict[str, Any], ipc: dict[str, Any], device: str) -> VisionPrompts:
        """Read the model's preprocessor config, resolve the transport mode (probing CUDA IPC first when
        a CUDA mode is configured) and start the sender."""
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
        requested = str(ipc.get("tensor_transport_mode", "default"))
        cuda_device = device if device.startswith("cuda") else "cuda:0"  # runtime.device "auto" on a GPU
        probe = None
        if requested != "default":
            probe = "the model runs on the CPU (runtime.device: cpu)" if device == "cpu" else probe_cuda_ipc(cuda_device)
        mode, line = resolve_mode(requested, probe)
        if line:
            logger.warning("%s", line)
        sender = TensorSender(mode, cuda_device if mode != "default" else None,
                              pool_size_mb=int(ipc.get("cuda_ipc_pool_size_mb", 256)))
        if mode != requested and sender.fallback_reason is None:
            sender.fallback_reason = probe
        return cls(VisionPreprocessConfig.from_model_dir(model_path), VisionTokenIds.from_config(config),
                   image_limits(server), sender, int(server["max_image_pixels"]))

    @property
    def mode(self) -> str:
        return self.sender.mode

    def wants(self, prompt: Any) -> bool:
        return isinstance(prompt, ChatPrompt) and bool(image_parts(prompt.messages))

    def build(self, tokenizer: Any, prompt: ChatPrompt, template_kwargs: dict[str, Any]) -> VisionPrompt:
        """The prompt with its images (ImageError naming the rule when one is refused)."""
        return build_vision_prompt(tokenizer, prompt.messages, template_kwargs, self.preprocess, self.tokens,
                                   self.limits, self.resize_max_pixels)

    def load_later(self, prompt: ChatPrompt) -> concurrent.futures.Future[list[ProcessedImage]] | None:
        """The prompt's images loaded and resized on the image thread (ImageError from the future): a
        few seconds an image at worst (a 7000x7000 RGBA PNG on a 2-core machine), time in which the
        worker's loop serves other requests. No tokenizer is touched there. One image at a time, the
        requests taking turns (after each image a request goes to the back of the thread's queue), so
        that a request of 8 large images delays another's one image by at most one image each; a
        cancelled load stops before its next image. None when `max_queued` requests' images are
        waiting or loading already (each holds its request's decoded pictures)."""
        self._loading = [f for f in self._loading if not f.done()]
        if len(self._loading) >= self.max_queued:
            return None
        if self._images is None:
            self._images = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="images")
        executor, parts, load = self._images, image_parts(prompt.messages), ImageLoad()
        done: list[ProcessedImage] = []

        def step(i: int) -> None:
            if i == 0 and not load.set_running_or_notify_cancel():
                return
            try:
                if load.stop.is_set():
                    raise ImageLoadStopped("the request was given up")
                if i == 0:
                    check_image_count(len(parts), self.limits)
                if i < len(parts):
                    done.append(process_image(load_part(parts[i], self.limits, i + 1), self.preprocess,
                                              part_max_pixels(parts[i], self.resize_max_pixels)))
                if i + 1 < len(parts):
                    executor.submit(step, i + 1)  # to the back of the queue: the next request's turn
                    return
            except BaseException as e:  # an ImageError for the client, or the executor shut down
                load.set_exception(e)
                return
            load.set_result(done)

        executor.submit(step, 0)
        self._loading.append(load)
        return load

    def prompt(self, tokenizer: Any, prompt: ChatPrompt, template_kwargs: dict[str, Any],
               images: list[ProcessedImage], encode: Callable[[str], list[int]] | None = None) -> VisionPrompt:
        """The prompt built around images from `load_later` (`encode`: the text's ids, if not the
        tokenizer's plain encode)."""
        return prompt_with_images(tokenizer, prompt.messages, template_kwargs, images, self.tokens, encode)

    def send(self, built: VisionPrompt) -> list[ImageInput]:
        """One choice's ImageInputs (each image's pixels sent anew: the receiver consumes a handle once)."""
        return [ImageInput(s, e - s, im.grid_thw, im.content_hash, self.sender.send(im.pixels))
                for im, (s, e) in zip(built.images, built.image_spans, strict=True)]

    def on_ack(self, ack: TransportAck) -> None:
        self.sender.on_ack(ack)

    def close(self) -> None:
        if self._images is not None:
            self._images.shutdown(wait=False, cancel_futures=True)
        self.sender.close()
