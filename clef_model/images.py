"""Images in SystemOne requests: turn each `images` entry into a PIL image before the release's encoder sees it.

Why: the release's `encode_record` hands `images` to the processor, which accepts PIL images, local paths,
base64 and http(s) URLs, and fetches URLs itself. That path ends in a traceback for a bad entry (a missing
file, a broken PNG, a number), and it would reach the network even on an offline machine. blaze resolves
every entry here first and raises `RequestError` naming the entry:

- a PIL image: used as is (converted to RGB);
- `data:image/…;base64,…`: decoded in memory;
- `http://` or `https://`: refused while `HF_HUB_OFFLINE=1` (blaze never fetches offline); otherwise passed
  on as the address, for the processor to fetch;
- anything else: a local file path (relative to the working directory; the decision-eval loader makes paths
  relative to its JSONL file absolute first).

`videos` are passed through unchanged.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import Any

from clef_model.errors import RequestError

_URL_PREFIXES = ("http://", "https://")


def offline() -> bool:
    """Whether Hugging Face offline mode is on (`HF_HUB_OFFLINE` set to 1/true/yes/on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _open(data: bytes, where: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise RequestError(f"{where}: not a readable image ({error}); use a PNG or JPEG file") from None
    return image.convert("RGB")


def resolve_image(entry: Any, where: str) -> Any:
    """One `images` entry as a PIL image (or an http(s) address when online); RequestError if unusable."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency of transformers' image processors
        raise RequestError(f"{where}: images need the package pillow; install it with `pip install pillow`") from None
    if isinstance(entry, Image.Image):
        return entry.convert("RGB")
    if not isinstance(entry, str) or not entry:
        raise RequestError(f"{where}: must be a file path, a data: URI or an http(s) address "
                           f"(got {type(entry).__name__})")
    if entry.startswith(_URL_PREFIXES):
        if offline():
            raise RequestError(f"{where}: {entry[:80]} is a web address and HF_HUB_OFFLINE=1 is set; blaze does "
                               "not fetch images offline. Download the image and pass its file path instead.")
        return entry
    if entry.startswith("data:"):
        header, _, payload = entry.partition(",")
        if not header.startswith("data:image/") or not header.endswith(";base64") or not payload:
            raise RequestError(f"{where}: a data: URI must look like data:image/png;base64,<data>")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}: the data: URI's base64 payload is not valid base64") from None
        return _open(data, where)
    path = Path(entry).expanduser()
    if not path.is_file():
        raise RequestError(f"{where}: image file {entry} not found; pass an existing file, a data: URI or an "
                           "http(s) address")
    return _open(path.read_bytes(), where)


def resolve_request_images(request: dict[str, Any]) -> dict[str, Any]:
    """The request with every `images` entry resolved (a shallow copy); the request itself is not changed."""
    images = request.get("images")
    if images is None:
        return request
    if not isinstance(images, list):
        raise RequestError(f"images: must be a list of images (got {type(images).__name__})")
    resolved = [resolve_image(entry, f"images[{index}]") for index, entry in enumerate(images)]
    return dict(request, images=resolved)
