"""What the Hugging Face conversion of every family shares: `config.json`'s objects and RoPE keys,
and reading a model directory's files (`config.json`, the shard index, safetensors headers) with
every input checked before any tensor is read, and `config.json`'s positive numbers. Each family's
`hf.py` and `maxtrain.convert` import it (no family imports another's helpers).
"""

from __future__ import annotations

import json
import math
import os

from maxtrain.config import ConfigError


def section(hf: dict, key: str) -> dict:
    """config.json's object `key` (empty when absent or null); anything but an object is refused."""
    v = hf.get(key)
    if v is not None and not isinstance(v, dict):
        raise ConfigError(f"config.json {key}={v!r} is not valid; give an object or null")
    return dict(v or {})


def rope_fields(theta: float, scaling: dict | None, rope_format: str) -> dict:
    """config.json's RoPE keys: "legacy" (`rope_theta` + `rope_scaling`) or "parameters" (`rope_parameters`)."""
    if rope_format == "parameters":
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta}}
    if rope_format == "legacy":
        return {"rope_theta": theta, "rope_scaling": scaling}
    raise ConfigError(f"--rope-format={rope_format!r} is not valid; choose legacy or parameters")


def more(names: list[str]) -> str:
    """The " (and N more)" an error message puts after the first of several names."""
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


# ---------------------------------------------------------------- files

INV_FREQ = ".rotary_emb.inv_freq"  # RoPE's buffer, which older transformers saved: nothing to convert
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # the float dtypes a Llama checkpoint converts from


def read_json(path: str, what: str):
    """The JSON in `path`, or a ConfigError saying what is wrong with the file and `what` to give."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} not found; {what}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is not a file; {what}") from None
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; {what}") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _index_files(hf_dir: str, index: str) -> list[str]:
    """The shard files `model.safetensors.index.json` names: plain names inside `hf_dir` that exist."""
    weight_map = read_json(index, "give the index of a sharded safetensors checkpoint")
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index} has no weight_map object of tensor name -> file name")
    files = []
    for name in sorted(set(weight_map.values())):
        # lexical, not realpath: the HF hub cache links shards to blobs elsewhere, which is fine
        if os.path.isabs(name) or ".." in name.split("/"):
            raise ConfigError(f"{index} names {name}, outside the model directory; shards must lie in {hf_dir}")
        if not os.path.isfile(os.path.join(hf_dir, name)):
            raise ConfigError(f"{index} names {name}, which is missing from {hf_dir}; download every shard")
        files.append(os.path.join(hf_dir, name))
    return files


def _tensor_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        return _index_files(hf_dir, index)
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ConfigError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json")


def _header_bytes(path: str) -> tuple[bytes, int]:
    """(the JSON header, the size of the data after it), with the length field checked against the file."""
    try:
        size = os.path.getsize(path)
        if size < 8:
            raise ConfigError(f"{path} has {size} bytes, too few for safetensors; the file is truncated")
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise ConfigError(f"{path}: header length {n} bytes does not fit the file ({size} bytes); "
                                  "the file is truncated or not safetensors")
            return f.read(n), size - 8 - n
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e.strerror}") from None


def _entry(path: str, name: str, entry, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, checked so that reading it stays inside the file."""
    def bad(why):
        return ConfigError(f"{path}: tensor {name} {why}; the file is damaged or not a Llama checkpoint")

    if not isinstance(entry, dict):
        raise bad("has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ConfigError(f"{path}: tensor {name} has dtype {dtype}; only {'/'.join(DTYPE_BYTES)} convert")
    if not (_naturals(shape) and _naturals(offsets) and len(offsets) == 2):
        raise bad(f"has shape={shape!r} data_offsets={offsets!r}")
    begin, end = offsets
    if end > data_size:
        raise ConfigError(f"{path}: tensor {name} ends at byte {end} of {data_size}; the file is truncated or "
                          "damaged")
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise bad(f"of shape {tuple(shape)} and dtype {dtype} does not fit data_offsets {offsets}")
    return dtype, tuple(shape), begin, end


def _naturals(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) of a safetensors file, after checking its header against the file.

    Checked here, not left to the safetensors library: its errors are tracebacks, and a damaged
    header must not make anything read or allocate more than the file holds."""
    raw, data_size = _header_bytes(path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        raise ConfigError(f"{path}: the header is not UTF-8 JSON; the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: the header is not a JSON object; the file is damaged or not safetensors")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ConfigError(f"{path}: __metadata__ is not an object of strings; the file is damaged or not safetensors")
    entries = {k: _entry(path, k, v, data_size) for k, v in header.items()}
    covered = 0  # as the library requires: the tensors tile the data exactly, in offset order
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
        if begin != covered:
            raise ConfigError(f"{path}: tensor {name} starts at byte {begin}, not {covered}; the file is damaged")
        covered = end
    if covered != data_size:
        raise ConfigError(f"{path}: tensors cover {covered} of {data_size} data bytes; the file is damaged")
    return {k: (dtype, shape) for k, (dtype, shape, _, _) in entries.items()}


def hf_tensors(hf_dir: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (file, shape) over an HF directory's safetensors files (one or sharded)."""
    found = {}
    for path in _tensor_files(hf_dir):
        for name, (_, shape) in safetensors_header(path).items():
            if name in found:
                raise ConfigError(f"{hf_dir}: tensor {name} is in both {found[name][0]} and {path}")
            found[name] = (path, shape)
    return found


REQUIRED = object()


def _absent(key: str, default, where: str):
    if default is REQUIRED:
        raise ConfigError(f"config.json has no {where}{key}; the model's config.json gives it")
    return default


def positive_int(hf: dict, key: str, default=REQUIRED, where: str = "") -> int | None:
    v = hf.get(key)
    if v is None:  # HF writes absent optional keys as null
        return _absent(key, default, where)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"config.json {where}{key}={v!r} is not valid; give a positive integer")
    return v


def positive_float(hf: dict, key: str, default=REQUIRED, where: str = "") -> float | None:
    v = hf.get(key)
    if v is None:
        return _absent(key, default, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ConfigError(f"config.json {where}{key}={v!r} is not valid; give a positive number")
    return float(v)
