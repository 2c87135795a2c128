"""What the reward server accepts: the request checks, run before a request reaches the scoring worker.

Each check answers with a :class:`RequestError` (an HTTP status and a message naming the key, the value and what
is accepted) instead of a traceback or an empty reply:

- the bearer token (401), compared in constant time;
- the body size (413), read no further than the limit;
- the JSON (400): not JSON, or nested deeper than the limit (also where Python's own parser would recurse too
  deep: a ``RecursionError`` is one more "too deep");
- the shape of a score request (400): ``images`` a list of base64 strings, ``prompts`` one string per image,
  ``meta`` an object, at most ``max_images`` images;
- the images (400): each a PNG, JPEG or WebP whose header (read without decoding the pixels) says at most
  ``max_image_pixels`` pixels, all of one size.

Kept free of the server library: the scoring worker uses :func:`probe_request` too, and tests call these
functions directly. PIL is imported inside functions.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hmac
import io
import json
import warnings
from typing import Any

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
"""The image formats a request may carry (the ``remote`` reward sends PNG; formats with interpreters such as EPS
are never opened)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds of one request.

    max_body: bytes of a request body (413 above it).
    max_depth: nesting of the JSON body: the body object is depth 1, ``meta`` 2, a list inside ``meta`` 3, …
    max_images: images per request (also the most the server decodes for one scoring call).
    max_image_pixels: width × height of one image, read from its header before any pixel is decoded.
    """

    max_body: int = 256 << 20
    max_depth: int = 32
    max_images: int = 32
    max_image_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        for key in ("max_body", "max_depth", "max_images", "max_image_pixels"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits: {key}={value!r} must be a positive integer")


class RequestError(Exception):
    """A request the server refuses: ``status`` (4xx) and ``message`` (what was wrong and what is accepted)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclasses.dataclass
class ScoreRequest:
    """A checked score request whose images are still encoded.

    images: the encoded image files (base64-decoded bytes), one per prompt.
    size: (height, width) shared by every image; None for a request without images.
    prompts: one string per image. meta: the request's ``meta`` object.
    """

    images: list[bytes]
    size: tuple[int, int] | None
    prompts: list[str]
    meta: dict[str, Any]

    def __len__(self) -> int:
        return len(self.prompts)


# ---- the bearer token ---------------------------------------------------------------------------------------
def check_token_value(token: str, source: str) -> str:
    """``token`` if it can be a bearer token; ValueError naming ``source`` (never printing the token) otherwise."""
    if not token:
        raise ValueError(f"{source} is empty; set it to the bearer token clients must send")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(
            f"{source} holds whitespace or control characters (a trailing newline?); a bearer token "
            f"is one word of printable characters"
        )
    return token


def check_authorization(header: bytes | None, token: bytes) -> None:
    """RequestError 401 unless ``header`` is ``Bearer <token>`` (the scheme in any case)."""
    scheme, _, given = (header or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), token):
        raise RequestError(
            401, "unauthorized: this server needs the header 'Authorization: Bearer <token>' with its token"
        )


# ---- the body ------------------------------------------------------------------------------------------------
def check_content_length(header: bytes | None, limits: Limits) -> int | None:
    """The declared body length (None when absent); RequestError 400 if unreadable, 413 if over the limit."""
    if header is None:
        return None
    try:
        length = int(header)
    except ValueError:
        raise RequestError(400, f"bad request: Content-Length {header[:40]!r} is not a number") from None
    if length < 0:
        raise RequestError(400, f"bad request: Content-Length {length} is negative")
    if length > limits.max_body:
        raise RequestError(413, too_large(length, limits))
    return length


def too_large(length: int | str, limits: Limits) -> str:
    return (
        f"request body of {length} bytes exceeds the limit of {limits.max_body} bytes (the server's "
        f"--max-body-mb); send fewer or smaller images per request (the remote reward's batch_size)"
    )


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` deep (the outermost container is depth 1).
    Iterative, so any depth is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def parse_json(body: bytes, limits: Limits) -> Any:
    """The JSON value of ``body``; RequestError 400 if it is not JSON or nests deeper than ``limits.max_depth``."""
    too_deep = RequestError(
        400,
        f"bad request: the JSON body nests deeper than {limits.max_depth} levels (the "
        f"server's --max-json-depth); 'meta' values may hold nested lists and objects "
        f"up to that depth",
    )
    try:
        value = json.loads(body)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise RequestError(400, f"bad request: the body is not JSON ({e})") from None
    if json_depth_exceeds(value, limits.max_depth):
        raise too_deep
    return value


# ---- a score request ---------------------------------------------------------------------------------------
def probe_image(item: Any, index: int, limits: Limits) -> tuple[bytes, tuple[int, int]]:
    """``images[index]`` as encoded bytes and its (height, width), read from the header only; RequestError 400."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(item, str):
        raise RequestError(400, f"bad request: images[{index}] is {type(item).__name__}, expected a base64 PNG string")
    try:
        data = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(400, f"bad request: images[{index}] is not base64 ({e})") from None
    try:
        with warnings.catch_warnings():  # PIL warns of a "decompression bomb": the pixel limit below decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                width, height = img.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise RequestError(
            400,
            f"bad request: images[{index}] is not a base64-encoded image in one of "
            f"{IMAGE_FORMATS} ({type(e).__name__}: {e})",
        ) from None
    if width * height > limits.max_image_pixels:
        raise RequestError(
            400,
            f"bad request: images[{index}] is {width} x {height} = {width * height} pixels; "
            f"this server decodes at most {limits.max_image_pixels} pixels per image (its "
            f"--max-image-pixels)",
        )
    return data, (height, width)


def probe_request(request: Any, limits: Limits) -> ScoreRequest:
    """A parsed score request body checked and its image headers read (no pixel decoded); RequestError 400."""
    if not isinstance(request, dict):
        raise RequestError(400, "bad request: body must be a JSON object with 'images', 'prompts' and optional 'meta'")
    images, prompts = request.get("images"), request.get("prompts")
    meta = request.get("meta") or {}
    if not isinstance(images, list) or not isinstance(prompts, list):
        raise RequestError(
            400, "bad request: 'images' (list of base64 PNG strings) and 'prompts' (list of strings) are required"
        )
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise RequestError(
                400,
                f"bad request: prompts[{i}] is {type(prompt).__name__} ({json.dumps(prompt)[:80]}), expected a "
                "string: 'prompts' is a list of strings, one per image",
            )
    if len(images) != len(prompts):
        raise RequestError(
            400, f"bad request: need one prompt string per image, got {len(images)} images, {len(prompts)} prompts"
        )
    if not isinstance(meta, dict):
        raise RequestError(400, f"bad request: 'meta' must be an object, got {type(meta).__name__}")
    if len(images) > limits.max_images:
        raise RequestError(
            400,
            f"bad request: {len(images)} images in one request; this server scores at most "
            f"{limits.max_images} per request (its --batch-size): send smaller batches (the "
            f"remote reward's batch_size)",
        )
    decoded, sizes = [], set()
    for i, item in enumerate(images):
        data, size = probe_image(item, i, limits)
        decoded.append(data)
        sizes.add(size)
    if len(sizes) > 1:
        raise RequestError(
            400, f"bad request: all images of a request must have one size, got (height, width) {sorted(sizes)}"
        )
    return ScoreRequest(decoded, sizes.pop() if sizes else None, list(prompts), meta)


def check_score_body(body: bytes, limits: Limits) -> None:
    """Every check of a ``POST /score`` body (JSON, depth, shape, image headers); RequestError 400 if one fails."""
    probe_request(parse_json(body, limits), limits)
