"""Model folders: discovery under the models dirs, and validation before a load (main process, no torch).

Validation reads only config.json, the safetensors headers and the names of the tokenizer files, so
a bad folder is refused with a message that says what is wrong before any worker starts. Every path
a client of the admin API names (a model, an override's tokenizer_path) must resolve, symlinks
followed, inside `model.models_dir`; the listing never reads a folder that resolves outside it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mllmd.daemon.model_config import (
    ConfigCheckError,
    check_config,
    check_links,
    config_weight_bytes,
    context_length,
    inside,
    read_config,
)
from mllmd.models import SUPPORTED_ARCHITECTURES
from mllmd.models.weight_files import INDEX_NAME, WeightFilesError, weight_files

MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX: one path component
# A usable tokenizer: the fast tokenizer's file, or a BPE vocabulary with its merges, or SentencePiece.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))

# The safetensors header's dtype names as torch names, for a config.json that gives no dtype.
_TORCH_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
MAX_HEADER_BYTES = 100 * 1024 * 1024
MIN_KV_TOKENS = 2048


class ModelError(ValueError):
    """A model folder cannot be loaded; the message says which check failed."""


@dataclass
class ModelFacts:
    name: str
    path: str
    architecture: str | None
    parameters: int | None
    dtype: str | None
    quantization: str | None
    size_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int | None
    takes_images: bool = False  # the config has a vision tower (Qwen3-VL, Qwen3.5)
    config_bytes: int = 0  # what config.json's sizes imply the parameters take (a lower bound)
    context_length: int | None = None  # max_position_embeddings
    state_bytes_per_slot: int = 0  # hybrids (Qwen3.5): one request's recurrent + conv state, all DeltaNet layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (names, dtypes, shapes), each entry checked: a known dtype,
    a shape of non-negative integers, data offsets that hold exactly its bytes inside the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelError(f"weights file {path.name} is truncated")
            (n,) = struct.unpack("<Q", raw)
            if n <= 0 or n > MAX_HEADER_BYTES:
                raise ModelError(f"weights file {path.name} is corrupt (header length {n})")
            text = f.read(n)
        size = path.stat().st_size
    except OSError as e:
        raise ModelError(f"cannot read weights file {path.name}: {e.strerror or e}") from None
    try:
        header = json.loads(text)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ModelError(f"weights file {path.name} is corrupt (its header is not a JSON object)")
    for name, meta in header.items():
        if name != "__metadata__":
            _check_entry(path.name, name, meta, size - 8 - n)
    return header


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_entry(file: str, name: str, meta: Any, data_bytes: int) -> None:
    what = f"weights file {file}, tensor {name[:200]!r}"
    if not isinstance(meta, dict):
        raise ModelError(f"{what}: its entry is not an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise ModelError(f"{what}: unsupported dtype {dtype!r:.40} (supported: {', '.join(_DTYPE_BYTES)})")
    if not isinstance(shape, list) or len(shape) > 8 or not all(map(_is_count, shape)):
        raise ModelError(f"{what}: its shape must be a list of at most 8 non-negative integers (got {shape!r:.60})")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):  # fmt: skip
        raise ModelError(f"{what}: its data_offsets must be [begin, end] with 0 <= begin <= end (got {offsets!r:.60})")
    if offsets[1] > data_bytes:
        raise ModelError(f"weights file {file} is truncated or corrupt (tensor {name[:200]!r} lies past its end)")
    if offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise ModelError(f"{what}: shape {shape} of {dtype} does not match its {offsets[1] - offsets[0]} bytes")


def quantization_of(config: dict[str, Any]) -> str | None:
    """"w8a8" / "w4a16" for compressed-tensors checkpoints, the method name for others, None if none."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    if q.get("quant_method") != "compressed-tensors":
        return str(q.get("quant_method") or "unknown")
    fmt = q.get("format")
    if fmt == "pack-quantized":
        return "w4a16"
    if fmt == "int-quantized":
        return "w8a8"
    return f"compressed-tensors:{fmt}"


def _weight_files(root: Path) -> list[Path]:
    try:
        return weight_files(root)
    except WeightFilesError as e:
        raise ModelError(str(e)) from None


def inspect_model(path: str | os.PathLike[str], roots: list[str] | tuple[str, ...] = ()) -> ModelFacts:
    """Read config.json and the weight headers; ModelError says what is missing or wrong. Every file of
    the folder must resolve inside it or inside one of `roots` (the models dirs)."""
    root = Path(path)
    if not root.is_dir():
        raise ModelError(f"{root} is not a folder")
    try:
        check_links(root, [Path(r) for r in roots])
        config = read_config(root)
        check_config(config)
    except FileNotFoundError:
        raise ModelError(f"{root} has no config.json") from None
    except ConfigCheckError as e:
        raise ModelError(str(e)) from None
    except OSError as e:
        raise ModelError(f"config.json is unreadable: {e.strerror or e}") from None
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    files = _weight_files(root)
    params = weight_bytes = 0
    dtypes: dict[str, int] = {}
    index = root / INDEX_NAME
    expected = set(json.loads(index.read_text())["weight_map"]) if index.is_file() else None  # checked by _weight_files
    seen: set[str] = set()
    for f in files:
        for name, meta in _read_header(f).items():
            if name == "__metadata__":
                continue
            count = math.prod(meta["shape"])
            params += count
            nbytes = count * _DTYPE_BYTES[meta["dtype"]]
            weight_bytes += nbytes
            dtypes[meta["dtype"]] = dtypes.get(meta["dtype"], 0) + nbytes
            seen.add(name)
    if expected is not None and expected - seen:
        missing = sorted(expected - seen)
        raise ModelError(f"weights are inconsistent: the index lists tensors no file holds: {', '.join(missing[:5])}")
    text = config.get("text_config") or config
    kv_per_token = None
    try:
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        kinds = text.get("layer_types")  # hybrids (Qwen3.5): only full-attention layers keep KV
        kv_layers = sum(k == "full_attention" for k in kinds) if isinstance(kinds, list) else text["num_hidden_layers"]
        kv_per_token = 2 * kv_layers * text["num_key_value_heads"] * head_dim * 2
    except (KeyError, TypeError, ZeroDivisionError):
        pass
    dtype = (config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
             or (_TORCH_DTYPE_NAMES.get(max(dtypes, key=dtypes.__getitem__)) if dtypes else None))
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return ModelFacts(root.name, str(root), arch, params, dtype, quantization_of(config), size, weight_bytes, kv_per_token,
                      isinstance(config.get("vision_config"), dict), config_weight_bytes(config), context_length(config),
                      state_bytes_per_slot(text, dtype))


def state_bytes_per_slot(text: dict[str, Any], dtype: str | None) -> int:
    """Bytes of one request's state in a hybrid model's Gated DeltaNet layers (0 for other models): the
    conv state [2 Hk Dk + Hv Dv, K - 1] in the model dtype and the float32 recurrent state [Hv, Dk, Dv] a
    layer, as mllmd.engine.state_pool lays them out (18 MiB for Qwen3.5-0.8B/2B, 48 MiB for 4B/9B)."""
    kinds = text.get("layer_types")
    layers = sum(k == "linear_attention" for k in kinds) if isinstance(kinds, list) else 0
    try:
        hk, hv = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
        dk, dv = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
        width = int(text["linear_conv_kernel_dim"])
    except (KeyError, TypeError, ValueError):
        return 0
    elem = 4 if dtype in ("float32", "torch.float32") else 2
    return layers * ((2 * hk * dk + hv * dv) * (width - 1) * elem + hv * dk * dv * 4)


def find_models(models_dirs: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """Every model folder (one holding config.json) directly under the models dirs. An entry that
    resolves outside them (a symlink to elsewhere) is listed with an error and never read."""
    out = []
    for d in models_dirs:
        base = Path(d)
        try:
            if not base.is_dir():
                continue
            allowed = [base.resolve()]
            entries = sorted(base.iterdir())
        except (OSError, ValueError):
            continue
        for sub in entries:
            try:
                if not inside(sub.resolve(), allowed):
                    if sub.is_dir():
                        out.append({"name": sub.name, "path": str(sub), "error": "a link to a folder outside "
                                    "model.models_dir: not read, and not loadable"})
                    continue
                if not (sub / "config.json").is_file():
                    continue
                facts = inspect_model(sub, [str(base)])
                error = None
                try:
                    if facts.architecture not in SUPPORTED_ARCHITECTURES:
                        raise ModelError(f"unsupported architecture {facts.architecture!r} (supported: "
                                         f"{', '.join(SUPPORTED_ARCHITECTURES)})")
                    check_tokenizer(sub, [str(base)])
                except ModelError as e:  # what could be read is still shown, with why it cannot load
                    error = str(e)
                out.append(facts.to_dict() | {"error": error})
            except ModelError as e:
                out.append({"name": sub.name, "path": str(sub), "error": str(e)})
            except (OSError, ValueError, RuntimeError) as e:  # unreadable, a link loop
                out.append({"name": sub.name, "path": str(sub), "error": f"cannot read it: {e}"})
    return out


def check_path_text(ref: Any, what: str = "model") -> str:
    """A path given by a client: a non-empty string without NUL, at most PATH_MAX characters, no
    component longer than NAME_MAX bytes (ModelError otherwise: never an OSError later)."""
    if not isinstance(ref, str) or not ref:
        raise ModelError(f"{what} must be a non-empty string (a folder path or a folder name under model.models_dir)")
    if "\0" in ref:
        raise ModelError(f"{what} must not contain a NUL character")
    if len(ref) > MAX_PATH_CHARS:
        raise ModelError(f"{what} is {len(ref)} characters long; paths are at most {MAX_PATH_CHARS}")
    try:
        too_long = any(len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES for part in ref.split("/"))
    except UnicodeError:
        raise ModelError(f"{what} is not a valid path") from None
    if too_long:
        raise ModelError(f"{what} has a path component longer than {MAX_NAME_BYTES} bytes")
    return ref


def resolve_in_models_dirs(ref: str, models_dirs: list[str] | tuple[str, ...], what: str = "model") -> Path:
    """A path or a bare folder name, which must resolve (symlinks followed) inside a models dir
    (`model.models_dir`); ModelError names the rule."""
    check_path_text(ref, what)
    dirs = ", ".join(map(str, models_dirs)) or "none configured"
    try:
        candidates = [Path(ref)] if os.sep in ref or ref.startswith(".") else [Path(d) / ref for d in models_dirs]
        allowed = [Path(d).resolve() for d in models_dirs]
        for c in candidates:
            real = c.resolve()
            if not inside(real, allowed):
                raise ModelError(f"{ref} is outside the allowed models dirs (model.models_dir: {dirs}); "
                                 "only folders inside them can be loaded over the admin API")
            if real.is_dir():
                return real
    except (OSError, ValueError, RuntimeError) as e:  # ENAMETOOLONG, ELOOP, a bad character
        raise ModelError(f"{what} {ref[:200]!r} cannot be resolved: {getattr(e, 'strerror', None) or e}") from None
    raise ModelError(f"no model folder {ref!r} under {dirs} (model.models_dir)")


def check_tokenizer(folder: str | os.PathLike[str], roots: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse a folder without tokenizer files (transformers would build an empty tokenizer from it,
    and every request would then fail), or with a file that resolves outside it and `roots`."""
    root = Path(folder)
    try:
        check_links(root, [Path(r) for r in roots])
    except ConfigCheckError as e:
        raise ModelError(str(e)) from None
    except OSError as e:
        raise ModelError(f"{root} cannot be read: {e.strerror or e}") from None
    for names in TOKENIZER_FILES:
        if all((root / n).is_file() and (root / n).stat().st_size > 0 for n in names):
            return
    wanted = " or ".join(" + ".join(names) for names in TOKENIZER_FILES)
    raise ModelError(f"{root} has no usable tokenizer ({wanted}); copy the model's tokenizer files into it, "
                     "or set model.tokenizer_path")


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_ml_stack() -> None:
    """Refuse any load when the ML stack cannot be imported (checked first: it is about the machine)."""
    for module in ("torch", "transformers", "safetensors"):
        if importlib.util.find_spec(module) is None:
            raise ModelError(f"the ML stack is not installed: Python module {module!r} is missing "
                             "(install PyTorch for this device; see the README)")


def check_loadable(facts: ModelFacts, budget_bytes: int | None = None, max_running_requests: int = 0,
                   context: int | None = None, state_slots: int | None = None) -> None:
    """Refuse a model we cannot run: unsupported architecture, too big for memory. What it needs is
    counted before any worker allocates: the weights (or what config.json's sizes make them, if more),
    MIN_KV_TOKENS of KV, the request table (`max_running_requests` rows of `context` positions) and,
    hybrid models, the recurrent-state slots (`cache.state_slots`; left unset, the one slot the memory
    plan never goes below)."""
    if facts.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {facts.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    budget = budget_bytes if budget_bytes is not None else _mem_available()
    if budget is not None:
        table = max_running_requests * (context or facts.context_length or 0) * 8  # int64 KV indices
        weights = max(facts.weight_bytes, facts.config_bytes)
        slots = (state_slots or 1) if facts.state_bytes_per_slot else 0
        states = slots * facts.state_bytes_per_slot
        need = weights + (facts.kv_bytes_per_token or 0) * MIN_KV_TOKENS + table + states
        if need > budget:
            why = " as config.json sizes them" if facts.config_bytes > facts.weight_bytes else ""
            held = f", {slots} recurrent-state slot{'s' if slots > 1 else ''} of {facts.state_bytes_per_slot / 2**20:.0f} MiB" if slots else ""
            raise ModelError(f"the model needs about {need / 2**30:.1f} GiB (weights{why}, {MIN_KV_TOKENS} tokens of "
                             f"KV, a request table of {table / 2**30:.1f} GiB{held}) but only {budget / 2**30:.1f} GiB "
                             "is available")
