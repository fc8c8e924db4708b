"""The checkpoint's `quantization_config` (compressed-tensors): which layers are quantized, and how.

Supported, as llmcompressor writes them:
  * `int-quantized` W8A8: int8 weights, symmetric, one static scale per output channel
    (`weight_scale` [N, 1]); activations quantized to int8 per token, symmetric, dynamically.
  * `pack-quantized` W4A16: int4 weights packed eight to an int32 (`weight_packed` [N, K/8]),
    one scale per group of 32/64/128/... input columns or per output channel (`weight_scale`
    [N, G]), symmetric or asymmetric (`weight_zero_point`, int4 packed along the output dim);
    activations stay in the compute dtype.
Everything else (FP8, NVFP4/MXFP4, static activation scales, sparsity, KV-cache schemes,
transforms, mixed schemes, g_idx activation ordering) is refused with a message that names it.

Which layers: a config group's `targets` and the top-level `ignore` list match checkpoint module
names the way compressed-tensors does: "re:<regex>" is `re.match`ed against the name, any other
string is an exact name or a module class name ("Linear": every projection and the lm_head).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

W8A8 = "w8a8"
W4A16 = "w4a16"
SUPPORTED = (
    "compressed-tensors int-quantized W8A8 (int8 per-channel symmetric weights, dynamic per-token "
    "symmetric int8 activations) and pack-quantized W4A16 (int4 group-wise or channel-wise weights)"
)


class UnsupportedQuantization(ValueError):
    """The checkpoint's quantization scheme cannot be loaded; the message names it."""


@dataclass(frozen=True)
class LinearScheme:
    """How one linear layer's weights (and, for W8A8, its input activations) are quantized."""

    method: str  # W8A8 | W4A16
    num_bits: int  # 8 | 4
    strategy: str  # "channel" | "group"
    group_size: int | None  # None for "channel"
    symmetric: bool

    def num_groups(self, in_features: int) -> int:
        """Scale columns per output row: 1 per channel, else in_features / group_size."""
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of the group size {self.group_size}")
        return in_features // self.group_size

    def group_width(self, in_features: int) -> int:
        """Input columns that share one scale (in_features for channel-wise)."""
        return self.group_size or in_features

    def describe(self) -> str:
        kind = f"group {self.group_size}" if self.group_size else "channel-wise"
        return f"{self.method} ({kind}, {'symmetric' if self.symmetric else 'asymmetric'})"


@dataclass(frozen=True)
class ConfigGroup:
    name: str
    targets: tuple[str, ...]
    scheme: LinearScheme


@dataclass(frozen=True)
class QuantConfig:
    """A parsed compressed-tensors config: its schemes, their targets and the ignore list."""

    method: str  # W8A8 | W4A16: the model-wide label (ModelInfo.quantization)
    groups: tuple[ConfigGroup, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, names: Sequence[str], module_class: str = "Linear") -> LinearScheme | None:
        """Scheme of one linear layer made of the checkpoint modules `names` (several when fused).

        None keeps it in full precision. The shards of a fused layer must agree.
        """
        schemes = {name: self._match(name, module_class) for name in names}
        distinct = set(schemes.values())
        if len(distinct) > 1:
            detail = ", ".join(f"{n}: {s.describe() if s else 'full precision'}" for n, s in schemes.items())
            raise UnsupportedQuantization(f"fused layer mixes quantization schemes ({detail})")
        return distinct.pop() if distinct else None

    def _match(self, name: str, module_class: str) -> LinearScheme | None:
        if any(_match(name, module_class, ign) for ign in self.ignore):
            return None
        # Most specific target first, as compressed-tensors orders them: exact name, regex, class.
        best: tuple[int, LinearScheme] | None = None
        for group in self.groups:
            for target in group.targets:
                rank = _match(name, module_class, target)
                if rank and (best is None or rank < best[0]):
                    best = (rank, group.scheme)
        return best[1] if best else None


def _match(name: str, module_class: str, target: str) -> int:
    """0 if `target` does not match; else 1 (exact name), 2 (regex) or 3 (class name)."""
    if target.startswith("re:"):
        return 2 if re.match(target[3:], name) else 0
    if target == name:
        return 1
    return 3 if target == module_class else 0


def quantization_config_dict(hf_config: Any) -> dict[str, Any] | None:
    """The raw `quantization_config` of a transformers config (or a config.json dict), if any."""
    raw = hf_config.get("quantization_config") if isinstance(hf_config, Mapping) else getattr(
        hf_config, "quantization_config", None
    )
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        if hasattr(raw, "to_dict"):
            raw = raw.to_dict()
        elif hasattr(raw, "__dict__"):
            raw = vars(raw)
        else:
            raise UnsupportedQuantization(f"quantization_config must be a JSON object, not {type(raw).__name__}")
    return dict(raw)


def parse_quant_config(hf_config: Any) -> QuantConfig | None:
    """QuantConfig of a checkpoint's config (None if unquantized); UnsupportedQuantization names
    whatever cannot be loaded."""
    qc = quantization_config_dict(hf_config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise UnsupportedQuantization(f"quantization method {method!r} is not supported; mllmd loads {SUPPORTED}")
    status = qc.get("quantization_status") or "compressed"
    if status != "compressed":
        raise UnsupportedQuantization(
            f"compressed-tensors quantization_status {status!r} is not supported (the weights must be saved compressed)"
        )
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise UnsupportedQuantization(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
    if qc.get("kv_cache_scheme"):
        raise UnsupportedQuantization("a quantized KV cache (kv_cache_scheme) is not supported")
    if qc.get("transform_config"):
        raise UnsupportedQuantization("compressed-tensors transforms (transform_config) are not supported")
    raw_groups = qc.get("config_groups") or {}
    if not raw_groups:
        raise UnsupportedQuantization("compressed-tensors config has no config_groups")
    if not isinstance(raw_groups, Mapping) or not all(isinstance(g, Mapping) for g in raw_groups.values()):
        raise UnsupportedQuantization("compressed-tensors config_groups must map group names to objects")
    groups = []
    for name, group in raw_groups.items():
        fmt = group.get("format") or qc.get("format")
        scheme = _parse_scheme(f"config group {name!r}", fmt, group)
        raw_targets = group.get("targets") or ()
        targets = (raw_targets,) if isinstance(raw_targets, str) else tuple(raw_targets)  # one name or a list
        if not targets:
            raise UnsupportedQuantization(f"config group {name!r} has no targets")
        groups.append(ConfigGroup(name, targets, scheme))
    methods = sorted({g.scheme.method for g in groups})
    if len(methods) > 1:
        raise UnsupportedQuantization(f"mixed-precision checkpoints ({' + '.join(methods)}) are not supported")
    return QuantConfig(method=methods[0], groups=tuple(groups), ignore=tuple(qc.get("ignore") or ()))


def _parse_scheme(where: str, fmt: str | None, group: Mapping[str, Any]) -> LinearScheme:
    weights = group.get("weights")
    acts = group.get("input_activations")
    if group.get("output_activations"):
        raise UnsupportedQuantization(f"{where}: output activation quantization is not supported")
    if not weights:
        raise UnsupportedQuantization(f"{where}: activation-only quantization is not supported")
    what = _describe(weights, acts)
    if fmt == "int-quantized":
        ok_w = _is(weights, type="int", num_bits=8, strategy="channel", symmetric=True) and not weights.get("dynamic")
        ok_a = bool(acts) and _is(acts, type="int", num_bits=8, strategy="token", symmetric=True, dynamic=True)
        if not (ok_w and ok_a):
            raise UnsupportedQuantization(f"{where}: {fmt} with {what} is not supported; mllmd loads {SUPPORTED}")
        return LinearScheme(W8A8, 8, "channel", None, True)
    if fmt == "pack-quantized":
        strategy = weights.get("strategy")
        ok_w = _is(weights, type="int", num_bits=4) and strategy in ("group", "channel") and not weights.get("dynamic")
        group_size = weights.get("group_size") if strategy == "group" else None
        if not ok_w or acts or (strategy == "group" and not (isinstance(group_size, int) and group_size > 0)):
            raise UnsupportedQuantization(f"{where}: {fmt} with {what} is not supported; mllmd loads {SUPPORTED}")
        if weights.get("actorder") in ("group", "dynamic"):
            raise UnsupportedQuantization(f"{where}: activation ordering 'group' (weight_g_idx) is not supported")
        return LinearScheme(W4A16, 4, strategy, group_size, bool(weights.get("symmetric", True)))
    raise UnsupportedQuantization(f"{where}: compressed-tensors format {fmt!r} ({what}) is not supported; mllmd loads {SUPPORTED}")


def _is(args: Mapping[str, Any], **want: Any) -> bool:
    defaults = {"type": "int", "symmetric": True, "dynamic": False}
    return all(args.get(k, defaults.get(k)) == v for k, v in want.items())


def _describe(weights: Mapping[str, Any], acts: Mapping[str, Any] | None) -> str:
    """E.g. "int8 (channel, symmetric) weights, int8 (token, symmetric, dynamic) activations"."""

    def one(args: Mapping[str, Any]) -> str:
        strategy = args.get("strategy")
        if strategy == "group":
            strategy = f"group {args.get('group_size')}"
        sym = "symmetric" if args.get("symmetric", True) else "asymmetric"
        dyn = ", dynamic" if args.get("dynamic") else ""
        return f"{args.get('type', 'int')}{args.get('num_bits')} ({strategy}, {sym}{dyn})"

    act = f"{one(acts)} activations" if acts else "unquantized activations"
    return f"{one(weights)} weights, {act}"
