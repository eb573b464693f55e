"""The grammar of `resources.gpus`: NAME:COUNT, MEMORY:COUNT, NAME:MEMORY:COUNT and memory ranges, read as
dstack reads its GPU spec, and a GPU's memory written as the catalogs write it.

Its own module because the providers speak it as much as the task's models do: spec.py checks the field
with it, and each provider turns its parts into its own words (dstack's GPU spec, SkyPilot's accelerators,
RunPod's GPU types).
"""

from __future__ import annotations

import re
from fractions import Fraction

from .models import _exact_decimal, size_bytes

_GPU_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*$")
_GPU_FORMS = ("use NAME:COUNT such as H100:8, MEMORY:COUNT such as 80GB:8, NAME:MEMORY:COUNT such as A100:80GB:8, "
              "a memory range such as 24GB..:1 or 24GB..48GB:1, or a count >= 1")


def gpu_parts(spec: str) -> tuple[str | None, tuple[int | None, int | None] | None, int]:
    """`resources.gpus` read as dstack reads its GPU spec (core/models/resources.py, GPUSpec.parse: tokens
    split at `:`, a token starting with a letter is the name, one with a letter elsewhere the memory, else
    the count), so `80GB:8`, `A100:80GB:8` and `24GB..:1` mean what they mean there: (name, memory in
    bytes as (min, max), GPUs per node: 1 where not given). Unlike dstack's, the memory is a size of the
    task file (its unit needed: `80GB`; issue 48) and the count exact (the recipe places that many)."""
    name = memory = count = None
    for token in spec.replace(" ", "").split(":"):
        if not token:
            raise ValueError(f"{spec!r} is not a GPU spec: an empty part ({_GPU_FORMS})")
        if token[0].isalpha():
            if name is not None or not _GPU_NAME.match(token):
                raise ValueError(f"{spec!r} is not a GPU spec: " + (
                    "two names" if name is not None else f"{token!r} is not a GPU name") + f" ({_GPU_FORMS})")
            name = token
        elif any(c.isalpha() for c in token):
            if memory is not None:
                raise ValueError(f"{spec!r} is not a GPU spec: the memory given twice ({_GPU_FORMS})")
            memory = _gpu_memory(spec, token)
        else:
            if count is not None:
                raise ValueError(f"{spec!r} is not a GPU spec: two counts; a GPU's memory needs its unit, as "
                                 f"80GB:8 ({_GPU_FORMS})")
            if not token.isdigit() or int(token) < 1:
                words = "a range of counts: Ray and the recipe need the GPUs per node exactly" \
                    if ".." in token else f"{token!r} is not a count >= 1"
                raise ValueError(f"{spec!r} is not a GPU spec: {words} ({_GPU_FORMS})")
            count = int(token)
    return name, memory, 1 if count is None else count


def gpu_gb(nbytes: int) -> str:
    """A GPU's memory as the catalogs write it, in GB (10^9 bytes) exactly: `80GB`, `25.769803776GB`."""
    return f"{_exact_decimal(Fraction(nbytes, 10**9))}GB"


def gpu_memory_words(memory: tuple[int | None, int | None]) -> str:
    """A GPU spec's memory as dstack writes it, in GB: `80GB`, `24GB..`, `..48GB`, `24GB..48GB`."""
    low, high = memory
    return gpu_gb(low) if low == high else f"{gpu_gb(low) if low else ''}..{gpu_gb(high) if high else ''}"


def _gpu_memory(spec: str, token: str) -> tuple[int | None, int | None]:
    """A GPU spec's memory: `80GB` (exactly), `24GB..` (at least), `..48GB`, `24GB..48GB`, in bytes."""
    low, dots, high = token.partition("..")
    try:
        bounds = tuple(size_bytes(part) if part else None for part in (low, high if dots else low))
    except ValueError as exc:
        raise ValueError(f"{spec!r}: the GPU memory {exc}") from None
    if bounds == (None, None) or (None not in bounds and bounds[0] > bounds[1]):
        raise ValueError(f"{spec!r}: the GPU memory {token!r} is no range (write 24GB.., ..48GB or 24GB..48GB)")
    return bounds
