"""Checkpoint tensors into a model's (fused) parameters, for every model family.

Linear layers take their tensors by name (weight, bias and, quantized, weight_scale, weight_packed,
...) and the shards of a fused layer (q/k/v, gate/up) fill its row ranges; other parameters are
copied by name. Every parameter must be filled and every checkpoint tensor must land somewhere
(besides those the model says to skip); then each quantized layer prepares its kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from mllmd.models.layers.linear import Linear, MergedLinear, check_tensor_dtype

# checkpoint sub-module name -> (fused module name, shard)
StackedParams = Mapping[str, tuple[str, str]]


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams,
    rename: Callable[[str], str | None] = lambda name: name,
    loaded_elsewhere: str | None = None,
) -> None:
    """Copy `weights` into `model`. `rename` maps a checkpoint name to the model's (None: skip it);
    parameters under `loaded_elsewhere` (a name prefix: a submodule with its own loader) are left out.
    ValueError names a tensor that fits nothing, has the wrong shape, or a parameter left unfilled."""
    params = {n: p for n, p in model.named_parameters() if not (loaded_elsewhere and n.startswith(loaded_elsewhere))}
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, Linear) and not (loaded_elsewhere and n.startswith(loaded_elsewhere))}
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        module_name, _, attr = name.rpartition(".")
        shard = None
        for sub, (target, s) in stacked.items():
            if module_name.endswith(f".{sub}"):
                module_name, shard = module_name[: -len(sub)] + target, s
                break
        linear = linears.get(module_name)
        if linear is not None:
            try:
                filled = linear.load_weight(attr, tensor, shard)
            except ValueError as e:
                raise ValueError(f"weight {ckpt_name!r}: {e}") from None
            if filled:
                loaded.add(f"{module_name}.{attr}" + (f":{shard}" if shard else ""))
            continue
        if name not in params:
            raise ValueError(f"unexpected weight {ckpt_name!r} in checkpoint")
        if params[name].shape != tensor.shape:
            raise ValueError(f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        try:
            check_tensor_dtype("its tensor", tensor, params[name].dtype)
        except ValueError as e:
            raise ValueError(f"weight {ckpt_name!r}: {e}") from None
        params[name].data.copy_(tensor)
        loaded.add(name)
    _check_complete(model, params, loaded)
    for linear in linears.values():
        linear.process_weights_after_loading()


def _check_complete(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    missing = []
    for pname in params:
        module = model.get_submodule(pname.rsplit(".", 1)[0])
        if isinstance(module, MergedLinear):
            missing += [f"{pname}:{s}" for s in module.shard_offsets if f"{pname}:{s}" not in loaded]
        elif pname not in loaded:
            missing.append(pname)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
