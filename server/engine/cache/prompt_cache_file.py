"""One block of prompt KV as a file: the safetensors layout (8-byte header length, JSON
header, raw tensors), written and read here with NumPy only, so the disk tier's writer thread
never runs an MLX op.

The header's metadata carries the entry's key and a sha256 of the tensor bytes. `decode`
checks the key, the checksum, and that the tensors are exactly `layers` pairs of keys and
values of shape (1, heads, block, head_dim) in one dtype; anything else is `DamagedEntry`
(the caller drops the file and computes the prefix again).
"""
from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

# safetensors dtype names <-> NumPy; bfloat16 travels as its raw 16 bits (NumPy has no bfloat16)
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
FORMAT = "lockstep-prompt-kv-1"


class DamagedEntry(ValueError):
    """A file that is not an intact entry for the key asked (torn, altered, another key)."""


def encode(key: str, dtype_name: str, layers: list[tuple[np.ndarray, np.ndarray]]) -> bytes:
    """The file's bytes for one block: `layers` (keys, values) per layer, C-contiguous arrays."""
    header: dict = {}
    chunks: list[bytes] = []
    offset = 0
    for i, (keys, values) in enumerate(layers):
        for name, arr in ((f"{i}.keys", keys), (f"{i}.values", values)):
            data = np.ascontiguousarray(arr).tobytes()
            header[name] = {"dtype": dtype_name, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
            chunks.append(data)
            offset += len(data)
    payload = b"".join(chunks)
    header["__metadata__"] = {"format": FORMAT, "key": key, "sha256": hashlib.sha256(payload).hexdigest()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(blob)) + blob + payload


def decode(data: bytes, key: str, layers: int, block: int) -> tuple[str, list[tuple[np.ndarray, np.ndarray]]]:
    """(dtype name, [(keys, values)] per layer) of an intact entry for `key`; else DamagedEntry."""
    try:
        (size,) = struct.unpack_from("<Q", data, 0)
        if size > len(data) - 8:
            raise DamagedEntry("header longer than the file")
        header = json.loads(data[8:8 + size])
        meta = header.pop("__metadata__")
        payload = memoryview(data)[8 + size:]
        if meta.get("format") != FORMAT or meta.get("key") != key:
            raise DamagedEntry("another entry's key")
        if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
            raise DamagedEntry("checksum mismatch")
        if set(header) != {f"{i}.{n}" for i in range(layers) for n in ("keys", "values")}:
            raise DamagedEntry("not this model's layers")
        names = {spec["dtype"] for spec in header.values()}
        shapes = {tuple(spec["shape"]) for spec in header.values()}
        if len(names) != 1 or len(shapes) != 1:
            raise DamagedEntry("layers of mixed dtypes or shapes")
        (dtype_name,), (shape,) = names, shapes
        if dtype_name not in _DTYPES or len(shape) != 4 or shape[0] != 1 or shape[2] != block:
            raise DamagedEntry(f"unexpected dtype {dtype_name} or shape {shape}")
        dtype = np.dtype(_DTYPES[dtype_name])
        nbytes = int(np.prod(shape)) * dtype.itemsize
        out = []
        for i in range(layers):
            pair = []
            for n in ("keys", "values"):
                start, end = header[f"{i}.{n}"]["data_offsets"]
                if end - start != nbytes or not 0 <= start <= end <= len(payload):
                    raise DamagedEntry("tensor extents do not match their shapes")
                pair.append(np.frombuffer(payload[start:end], dtype).reshape(shape))
            out.append((pair[0], pair[1]))
        return dtype_name, out
    except DamagedEntry:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:  # JSON, header fields
        raise DamagedEntry(f"unreadable: {exc}") from None
