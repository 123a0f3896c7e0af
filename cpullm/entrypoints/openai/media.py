"""Images of chat requests: ``image_url`` content parts as data URLs, local files under
``--allowed-local-media-path``, or http(s) URLs where ``--allow-remote-media`` allows
(fetched with a size and a time limit). Every failure is a ValueError naming the part."""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

MAX_IMAGE_BYTES = 20 << 20  # an image's encoded bytes, from any source
MAX_IMAGE_PIXELS = 40_000_000  # decoded (PIL refuses larger as decompression bombs)
REMOTE_TIMEOUT = 10.0  # seconds for a remote image, connection to last byte


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how many a prompt may have."""

    allowed_local_path: str | None = None
    allow_remote: bool = False
    max_images: int = 8  # --limit-mm-per-prompt '{"image": N}'


def parse_limit(value: str | None) -> int:
    """--limit-mm-per-prompt as vLLM spells it: '{"image": N}'."""
    import json

    if value is None:
        return MediaPolicy.max_images
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--limit-mm-per-prompt {value!r}: not JSON: {e}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"} or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limits.values()):
        raise ValueError(f"--limit-mm-per-prompt {value!r}: expected {{\"image\": N}}, N >= 0")
    return limits.get("image", MediaPolicy.max_images)


def _decode(data: bytes, where: str) -> Any:
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Image.DecompressionBombError:
        raise ValueError(f"{where}: the image has more than {MAX_IMAGE_PIXELS} pixels") from None
    except Exception:  # PIL's UnidentifiedImageError, truncated files, ...
        raise ValueError(f"{where}: not an image PIL can read") from None
    return image.convert("RGB")


def _remote(url: str, where: str) -> bytes:
    import httpx

    data = bytearray()
    try:
        with httpx.stream("GET", url, timeout=REMOTE_TIMEOUT, follow_redirects=True) as reply:
            if reply.status_code != 200:
                raise ValueError(f"{where}: fetching {url} answered {reply.status_code}")
            for chunk in reply.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise ValueError(f"{where}: the image is larger than "
                                     f"{MAX_IMAGE_BYTES >> 20} MiB")
    except httpx.HTTPError as e:
        raise ValueError(f"{where}: fetching {url} failed: {type(e).__name__}") from None
    return bytes(data)


def load_image(url: str, policy: MediaPolicy, where: str) -> Any:
    """The PIL image (RGB) an ``image_url`` names."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
            raise ValueError(f"{where}: a data URL must be data:image/...;base64,...")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the data URL is not valid base64") from None
        return _decode(data, where)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        if not policy.allow_remote:
            raise ValueError(f"{where}: remote images are not fetched unless the server runs "
                             "with --allow-remote-media")
        return _decode(_remote(url, where), where)
    if parsed.scheme in ("file", ""):
        if policy.allowed_local_path is None:
            raise ValueError(f"{where}: local files are read only under "
                             "--allowed-local-media-path")
        root = os.path.realpath(policy.allowed_local_path)
        path = os.path.realpath(unquote(parsed.path))
        if os.path.commonpath([root, path]) != root:
            raise ValueError(f"{where}: {parsed.path} is not under --allowed-local-media-path")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise ValueError(f"{where}: cannot read {parsed.path}: {e.strerror}") from None
        return _decode(data, where)
    raise ValueError(f"{where}: URLs of scheme {parsed.scheme!r} are not supported")
