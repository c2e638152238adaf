"""The loading core: stream `(name, array)` pairs through a rule table into a module built abstractly.

Readers (safetensors, GGUF) yield one tensor at a time and a family's table says where each goes, so the
core knows no model: a new family adds a table, never a branch here. The module is built with
`nnx.eval_shape` (no memory for random weights) and each parameter is placed on device as soon as it is
complete, so a checkpoint is never held twice; only a stacked parameter (MoE experts, [E, ...]) waits on
the host until its last slice arrives.

Packed weights (`jaxspec.models.quant`): a parameter the module holds packed (its parts `<path>.codes`,
`.scale` [, `.offset`]) takes either a `PackedTensor` from the reader (GGUF Q4_0/Q4_1/Q8_0, compressed-tensors
INT4: already in the packed [out, in] layout, so a Linear's transpose is skipped) or a float tensor, which
the caller's `pack(path, array)` quantises on the way in. A `PackedTensor` for a float parameter is
dequantised. So a checkpoint is never dequantised into a packed model, nor held as float beside it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.checkpoint.packed import PackedTensor


class WeightsError(ValueError):
    """A checkpoint that cannot be read into the model; the message names the file or tensor."""


def linear_kernel(w: np.ndarray) -> np.ndarray:
    """HF Linear weight [out, in] -> jaxspec kernel [in, out] (a view: the cast to the parameter copies)."""
    return w.T


@dataclass(frozen=True)
class Rule:
    """Where the checkpoint tensors whose name fullmatches `pattern` go.

    target: dotted parameter path, formatted with the regex groups (`"layers.{0}.mlp.up_proj.kernel"`);
      None ignores the tensor (vision towers, rotary buffers, a drafter's copy of the target's head). A tuple
      of paths: the tensor is those parameters concatenated along its first axis (a fused HF projection's
      output rows, a conv's channels), cut by their sizes before the transform, each piece then going its
      own way (kept apart so each can be sharded by its own heads: sharding.py).
    transform: array -> array applied before the shape check (e.g. `linear_kernel`).
    stack: index of the group (as in `{0}`) holding the slice of the parameter's leading axis that the
      tensor fills: expert e of `layers.{0}.mlp.experts.gate_proj.kernel` [E, in, out].
    optional: the module may lack the target (a tied model has no lm_head); the tensor is then ignored.
      Without it a target the module lacks is an unexpected tensor, so a wrong config is caught.
    """

    pattern: str
    target: str | tuple[str, ...] | None
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    stack: int | None = None
    optional: bool = False


def rule_targets(name: str, rules: Iterable[Rule]) -> tuple[str, ...]:
    """The parameter paths tensor `name` fills through the first matching rule (a stacked parameter's whole
    path; several for a split tensor), none when no rule maps it or its rule ignores it."""
    for r in rules:
        if (m := re.fullmatch(r.pattern, name)) is not None:
            return _paths(r, m)
    return ()


def _paths(rule: Rule, m: re.Match) -> tuple[str, ...]:
    targets = () if rule.target is None else (rule.target,) if isinstance(rule.target, str) else rule.target
    return tuple(t.format(*m.groups()) for t in targets)


def load_params(module_ctor: Callable[[], nnx.Module], tensors: Iterable[tuple[str, np.ndarray]],
                rules: Iterable[Rule], *, what: str = "checkpoint",
                pack: Callable[[str, np.ndarray], PackedTensor] | None = None,
                place: Callable[[np.ndarray, nnx.Variable, str], Any] | None = None) -> nnx.Module:
    """Build `module_ctor()` abstractly and fill every parameter from `tensors` through the first matching rule.

    Each tensor is cast once, straight to its parameter's dtype; a non-floating parameter (packed INT4/INT8)
    takes a tensor of exactly its dtype, untouched. Raises WeightsError on a name no rule maps, a shape or
    dtype that does not fit, a parameter filled twice, and on any parameter (or stacked slice) left empty.
    `what` names the source in the messages ("drafter checkpoint"); `pack(path, array)` packs a float tensor
    (after its rule's transform) for a packed parameter. `place(host_array, variable, path)` takes
    each complete parameter (already cast) and returns what the module keeps: a device array (default: on
    device 0), straight into its shards on a mesh, or, for a converter that writes it out, its abstract shape.
    """
    place = place or (lambda arr, var, path: jnp.asarray(arr))
    graphdef, state = nnx.split(nnx.eval_shape(module_ctor))
    flat = dict(nnx.to_flat_state(state))
    by_path = {".".join(str(p) for p in k): k for k in flat}
    table = [(re.compile(r.pattern), r) for r in rules]
    filled: dict[str, str] = {}  # parameter path (or "path[e]" for a slice) -> the tensor that filled it
    stacks: dict[str, list] = {}  # stacked parameter path -> [host buffer [E, ...], slices in] until complete

    for name, arr in tensors:
        m, rule = next(((m, r) for p, r in table if (m := p.fullmatch(name))), (None, None))
        if rule is None:
            raise _unexpected(name, what)
        paths = _paths(rule, m)
        pieces = _split(name, arr, paths, flat, by_path, what) if len(paths) > 1 else [(p, arr) for p in paths]
        del arr  # before the reader allocates the next tensor: one checkpoint tensor alive at a time
        while pieces:
            path, piece = pieces.pop(0)
            _fill(name, path, piece, rule, m, flat, by_path, filled, stacks, what, pack, place)
            del piece

    missing = []
    for path, key in by_path.items():
        if path in stacks:  # a partly filled stack: name its empty slices
            missing += [f"{path}[{i}]" for i in range(flat[key].shape[0]) if f"{path}[{i}]" not in filled]
        elif path not in filled:
            missing.append(path)
    if missing:
        n = len(missing)
        raise WeightsError(f"{what} is missing {n} tensor{'s' * (n > 1)}, e.g. {sorted(missing)[0]!r}; "
                           "the file may be truncated")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _split(name: str, arr, paths: tuple[str, ...], flat: dict, by_path: dict, what: str) -> list[tuple[str, Any]]:
    """A fused tensor (float, or packed [out, in]) -> one piece of its first axis per parameter path, each as many
    rows as its parameter takes: the parameter's size over the tensor's other dimensions (a packed parameter:
    its codes' output rows)."""
    def rows(path):
        if path in by_path:
            return math.prod(flat[by_path[path]].shape) // math.prod(arr.shape[1:])
        if f"{path}.codes" in by_path:
            return flat[by_path[f"{path}.codes"]].shape[-2]
        raise _unexpected(name, what)

    n = [rows(p) for p in paths]
    if sum(n) != arr.shape[0]:
        raise WeightsError(f"tensor {name!r} has shape {tuple(arr.shape)}, but the parameters it fills take "
                           f"{' + '.join(map(str, n))} rows; is config.json from the same model?")
    cuts = np.cumsum([0, *n])
    cut = lambda a, i: a[cuts[i]:cuts[i + 1]]  # noqa: E731
    if isinstance(arr, PackedTensor):
        return [(p, arr.map(lambda a, i=i: cut(a, i))) for i, p in enumerate(paths)]
    return [(p, cut(arr, i)) for i, p in enumerate(paths)]


def _fill(name: str, path: str, arr, rule: Rule, m: re.Match, flat: dict, by_path: dict, filled: dict, stacks: dict,
          what: str, pack, place) -> None:
    """Tensor `name` (or its piece) into parameter `path`: dequantised, transformed or packed as the parameter
    needs, then placed."""
    packed = f"{path}.codes" in by_path
    if path not in by_path and not packed:
        if rule.optional:
            return
        raise _unexpected(name, what)
    if isinstance(arr, PackedTensor) and not packed:
        arr = arr.dequantize()  # a packed tensor for a float parameter (a type the model keeps float)
    if isinstance(arr, PackedTensor):
        if rule.transform not in (None, linear_kernel):
            raise WeightsError(f"tensor {name!r} is packed but its rule transforms it ({rule.transform.__name__}); "
                               "load it with quantize=None")
    elif rule.transform is not None:
        arr = rule.transform(arr)
    if packed:
        if not isinstance(arr, PackedTensor):
            if pack is None:
                raise WeightsError(f"parameter {path} is packed but {name!r} is a float tensor "
                                   "and no packing was asked for")
            arr = pack(path, arr)
        want = {k.rsplit(".", 1)[1] for k in by_path if k.rsplit(".", 1)[0] == path}
        if set(arr.parts()) != want:
            raise WeightsError(f"tensor {name!r} is packed as {sorted(arr.parts())}, but parameter {path} "
                               f"holds {sorted(want)}; the checkpoint's quantisation differs from the model's")
        parts = [(f"{path}.{k}", a) for k, a in arr.parts().items()]
    else:
        parts = [(path, arr)]
    del arr
    while parts:
        part, a = parts.pop(0)
        _put(name, part, a, flat[by_path[part]], rule.stack, m, filled, stacks, place)
        del a


def _put(name: str, path: str, arr: np.ndarray, var, stack: int | None, m: re.Match, filled: dict, stacks: dict,
         place) -> None:
    """Place one array into parameter `path` (a whole parameter, or slice e of a stacked one)."""
    _check_dtype(name, path, arr.dtype, var.dtype)
    if stack is None:
        _check_shape(name, arr.shape, var.shape)
        _fill_once(filled, path, name)
        var.set_value(place(np.asarray(arr, dtype=var.dtype), var, path))
        return
    e, E = int(m.group(stack + 1)), var.shape[0]
    _check_shape(name, arr.shape, var.shape[1:])
    if not 0 <= e < E:
        raise WeightsError(f"tensor {name!r} is slice {e} of {path}, which has {E} slices; "
                           "is config.json from the same model?")
    _fill_once(filled, f"{path}[{e}]", name)
    if path not in stacks:  # the first slice allocates the stack, [E, ...], on the host
        stacks[path] = [np.empty(var.shape, var.dtype), 0]
    buf = stacks[path]
    buf[0][e] = arr  # the one cast, straight into the parameter's dtype
    buf[1] += 1
    if buf[1] == E:
        var.set_value(place(stacks.pop(path)[0], var, path))
        filled[path] = name


def _check_dtype(name: str, path: str, got, want) -> None:
    """Floating parameters take floating tensors (cast once, on placement); any other dtype must match exactly."""
    floating = jnp.issubdtype(want, jnp.floating)
    if floating and jnp.issubdtype(got, jnp.floating) or got == want:
        return
    why = ("a floating parameter needs a floating tensor" if floating
           else "a packed parameter takes its tensor untouched")
    raise WeightsError(f"tensor {name!r} has dtype {np.dtype(got)}, but parameter {path} is {np.dtype(want)}; {why}")


def _unexpected(name: str, what: str) -> WeightsError:
    return WeightsError(f"unexpected tensor {name!r} in the {what}; is config.json from the same model?")


def _check_shape(name: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise WeightsError(f"tensor {name!r} has shape {tuple(got)}, the config implies {tuple(want)}")


def _fill_once(filled: dict[str, str], key: str, name: str) -> None:
    if key in filled:
        raise WeightsError(f"tensors {filled[key]!r} and {name!r} both fill {key}; the checkpoint repeats a tensor")
    filled[key] = name
