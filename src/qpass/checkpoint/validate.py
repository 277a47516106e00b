"""The checks every consumer of qpass NVFP4 checkpoint tensors runs: one validation path.

The SGLang and vLLM plugins (:mod:`qpass.backends.sglang`, :mod:`qpass.backends.vllm`), the served
layer's :func:`qpass.checkpoint.linear.finish_loading` and the file readers
(:func:`qpass.checkpoint.params.check_site_tensors`) all call these functions, so an engine cannot
accept what another refuses.

**What a load must bring** (:func:`checked_loader`, :func:`check_all_loaded`): every engine weight
loader of a ``qpass_nvfp4`` parameter is wrapped; the wrapper refuses a checkpoint tensor of the wrong
dtype or shape (naming layer, parameter and shard) and records ``(parameter, shard)`` in
``layer.qpass_loaded``. After a (re)load, every one of ``weight``, ``weight_scale`` and
``weight_scale_2`` must have been loaded for every fused shard *in this load*: a partial weight update
that brings new codes without their scales is refused (with stale scales the layer would serve new
codes at old magnitudes). A call with nothing loaded since the last check is an idempotent repeat
(``idle_ok``: SGLang calls ``process_weights_after_loading`` on every module at the end of a weight
update session; the NaN sentinel of :func:`qpass.checkpoint.linear.begin_loading` then refuses a layer
the session re-opened but did not fill); vLLM re-allocates parameters on reload, so it never allows it.

**What a scale byte can be** (SPEC §3: ``s_b = e4m3_rne_satfinite(min(vmax · S_enc/6, 448))``):

* block scales (:func:`check_block_scales`): E4M3 bytes ``0x00..0x7E`` only: a byte with the sign bit
  (``0x80..0xFE``, including ``-0``) or NaN (``0x7F``/``0xFF``, also the "never loaded" sentinel) is
  produced by no quantizer (``|x| / ...`` is non-negative; E4M3 has no inf);
* codes against their block scales (:func:`check_codes_fit_scales`): a quantizer maps a block's largest
  magnitude to about 6 (``y = x / (s_b · S_dec)``, ``s_b`` rounded to E4M3 with relative error <= 2^-4
  for normal bytes), so in a block with a non-zero code and a scale >= 2^-5 (byte >= ``0x10``) the
  largest code magnitude is 6 (E2M1 ``0b111``): true for TransformerEngine / FlashInfer (qpass's
  reference), ModelOpt, torchao, vLLM/SGLang and compressed-tensors arithmetic
  (:mod:`qpass.quant.emulation`; their floors on tiny blocks, 2^-9 and 2^-6, lie below 2^-5). Codes
  quantized against another scale than the stored one, or a flipped bit of a block's largest code,
  break it;
* block scales against the global scale, for a whole fused group (:func:`check_group_max_scale`: an
  engine layer at TP = 1, an MoE expert's W13 / W2): the block holding the group's amax gets the
  scale ``fl(amax · S_enc/6) ~ 448``, so the largest byte is ``0x7E`` under every arithmetic above
  (unless every byte is 0, or ``S_dec < 2^-100``: amax so small that ``S_enc`` saturates). Block
  scales computed for another global scale (stale, another amax) or an edited largest scale break it;
* global scales (:func:`check_global_scales`): float32, not NaN (never loaded), finite, > 0 (``-0``
  refused), at most ``FLT_MAX / 2688`` (above it the largest code, ``6 · 448 · S_dec``, decodes to
  inf; no finite amax gives it), and bit-identical over the shards of a fused group (SPEC §3 rule 1).

Every function raises :class:`qpass.errors.QuantizationError` naming ``where`` (file or layer), the
tensor and what is wrong.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from qpass.errors import QuantizationError

__all__ = ["ACT_ONLY_CHECKED", "CHECKED", "GLOBAL_SCALE_MAX", "check_all_loaded", "check_block_scales", "check_codes_fit_scales",
           "check_global_scales", "check_group_max_scale", "check_nvfp4_tensors", "checked_loader", "init_load_record",
           "layer_holds_whole_group"]

BLOCK = 16
#: Parameters that must be loaded for every shard in every (re)load of an NVFP4 layer.
CHECKED = ("weight", "weight_scale", "weight_scale_2")
#: The same for an activation-only layer (``qpass_weight: "none"``).
ACT_ONLY_CHECKED = ("weight",)
#: The largest decode global scale whose largest code (6 · 448 · S_dec) is finite in float32.
GLOBAL_SCALE_MAX = float(torch.tensor(torch.finfo(torch.float32).max / 2688.0, dtype=torch.float32))
_CONSISTENT_FROM = 0x10  # E4M3 byte of 2^-5: blocks with this scale or larger map their max to code 6
_TINY_GLOBAL = 2.0 ** -100  # below: amax so small that S_enc saturates at FLT_MAX (the largest scale is then < 448)
_QKV = {"q": 0, "k": 1, "v": 2}


# ----------------------------------------------------------------------------- scale bytes


def check_block_scales(scales: torch.Tensor, where: str) -> None:
    """``scales`` (float8_e4m3fn ``[N, K/16]``) holds only bytes a quantizer produces (module docstring).

    Raises:
        QuantizationError: NaN bytes (never loaded, or corrupt) or bytes with the sign bit, counted,
            with the first ``(row, block)``.
    """
    b = scales.detach().reshape(scales.shape[0] if scales.dim() else 1, -1).view(torch.uint8)
    nan = (b & 0x7F) == 0x7F
    if bool(nan.any()):
        raise QuantizationError(f"{where}: {int(nan.sum())}/{b.numel()} weight_scale bytes are NaN (first at {_first(nan)}): "
                                "never loaded (the checkpoint or weight update carried codes without their block scales), or corrupt")
    neg = (b & 0x80) != 0
    if bool(neg.any()):
        raise QuantizationError(f"{where}: {int(neg.sum())}/{b.numel()} weight_scale bytes have the sign bit set (first byte "
                                f"0x{int(b[neg][0]):02X} at {_first(neg)}); block scales are non-negative (no quantizer writes them)")


def check_codes_fit_scales(codes: torch.Tensor, scales: torch.Tensor, where: str) -> None:
    """Every block with a non-zero code and a scale byte >= ``0x10`` (2^-5) has a code of magnitude 6
    (module docstring): what a quantizer gives its largest element.

    Args:
        codes: uint8 ``[N, K/2]`` (two E2M1 codes per byte, low nibble = even k).
        scales: float8_e4m3fn ``[N, K/16]`` (already through :func:`check_block_scales`).
    Raises:
        QuantizationError: names the first offending ``(row, block)``, its scale byte and largest code.
    """
    c = codes.detach()
    n, half_k = c.shape
    mag = torch.maximum(c & 0x7, (c >> 4) & 0x7).reshape(n, half_k * 2 // BLOCK, BLOCK // 2).amax(-1)
    s = scales.detach().view(torch.uint8)
    bad = (s >= _CONSISTENT_FROM) & (mag > 0) & (mag != 7)
    if bool(bad.any()):
        r, blk = (int(i) for i in bad.nonzero()[0])
        value = float(scales[r, blk].float())
        raise QuantizationError(
            f"{where}: {int(bad.sum())} block(s) have no code of magnitude 6 (first at row {r}, block {blk}: scale byte "
            f"0x{int(s[r, blk]):02X} = {value:g}, largest code magnitude {_E2M1[int(mag[r, blk])]:g}); a quantizer maps a block's "
            "largest element to 6, so these codes were not quantized with these scales (stale or corrupt)")


_E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6)


def check_group_max_scale(scales: torch.Tensor, s_dec: torch.Tensor, where: str) -> None:
    """The largest block scale of a whole fused group is 448 (byte ``0x7E``) (module docstring).

    Args:
        scales: float8_e4m3fn block scales of every member of one group (non-negative bytes).
        s_dec: the group's decode global scale (float32, any shape; the first element is read).
    Raises:
        QuantizationError: names the largest byte and the global scale.
    """
    b = scales.detach().view(torch.uint8)
    g = float(s_dec.detach().float().reshape(-1)[0])
    if b.numel() == 0 or not bool((b != 0).any()) or not g >= _TINY_GLOBAL:
        return
    mx = int(b.max())
    if mx != 0x7E:
        value = float(torch.tensor([mx], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
        raise QuantizationError(f"{where}: the largest block scale is 0x{mx:02X} = {value:g}, not 448 (0x7E): a quantizer gives the "
                                f"block holding the group's amax the scale 448, so these block scales do not belong to the global "
                                f"scale weight_scale_2 = {g:g} (stale, from another amax, or edited)")


def check_global_scales(gs: torch.Tensor, where: str, *, fused: bool = True) -> None:
    """``gs`` (float32, one element per fused shard, or one) is a valid decode global scale ``S_dec``.

    Raises:
        QuantizationError: NaN (never loaded: the shards are named), not float32, inf, <= 0 or ``-0``,
            above :data:`GLOBAL_SCALE_MAX`, or (``fused``) different bits per shard.
    """
    if gs.dtype != torch.float32 or gs.numel() < 1:
        raise QuantizationError(f"{where}.weight_scale_2: expected float32 with one element per shard, got {gs.dtype} {tuple(gs.shape)}")
    g = gs.detach().float().reshape(-1)
    nan = torch.isnan(g)
    if bool(nan.any()):
        raise QuantizationError(f"{where}: weight_scale_2 of shard(s) {nan.nonzero().flatten().tolist()} was never loaded, or is NaN "
                                "(the checkpoint or weight update did not carry it)")
    bits = g.view(torch.int32)
    if fused and not bool((bits == bits[0]).all()):
        raise QuantizationError(f"{where} has different weight_scale_2 per fused shard {g.tolist()}; qpass checkpoints share one "
                                "global scale per fused group (SPEC §3 rule 1)")
    bad = ~torch.isfinite(g) | (g <= 0) | (bits < 0) | (g > GLOBAL_SCALE_MAX)
    if bool(bad.any()):
        v = float(g[bad][0])
        why = ("not finite" if v != v or abs(v) == float("inf") else "negative or -0" if v < 0 or (v == 0 and str(v).startswith("-"))
               else "0" if v == 0 else f"above {GLOBAL_SCALE_MAX:g} = FLT_MAX/2688, where the largest code decodes to inf")
        raise QuantizationError(f"{where} has an invalid weight_scale_2 {g.tolist()} ({why}); a decode global scale is "
                                f"finite and in (0, FLT_MAX/2688]")


def check_nvfp4_tensors(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, where: str, *,
                        fused: bool = True, whole_group: bool = False) -> None:
    """All checks of one NVFP4 site or layer: dtypes and shapes, block scale bytes, codes against scales,
    global scales (module docstring); with ``whole_group`` (the tensors are a whole fused group, e.g. an
    unsharded engine layer) also :func:`check_group_max_scale`.

    Raises:
        QuantizationError: names ``where`` and the tensor.
    """
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise QuantizationError(f"{where}.weight: expected uint8 [N, K/2] codes, got {weight.dtype} {tuple(weight.shape)}")
    n, half_k = weight.shape
    want = (n, half_k * 2 // BLOCK)
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != want:
        raise QuantizationError(f"{where}.weight_scale: expected float8_e4m3fn {want} for weight {tuple(weight.shape)}, "
                                f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    check_global_scales(weight_scale_2, where, fused=fused)
    check_block_scales(weight_scale, where)
    check_codes_fit_scales(weight, weight_scale, where)
    if whole_group:
        check_group_max_scale(weight_scale, weight_scale_2, where)


def layer_holds_whole_group(layer: torch.nn.Module) -> bool:
    """An engine layer that holds its fused group whole (TP = 1: neither rows nor K split)."""
    return not getattr(layer, "qpass_k_sharded", False) and int(getattr(layer, "tp_size", 1) or 1) == 1


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


# ----------------------------------------------------------------------------- what a load brought


def init_load_record(layer: torch.nn.Module, prefix: str, output_partition_sizes: list[int], *, k_sharded: bool) -> None:
    """The attributes the checked loaders and :func:`check_all_loaded` use (set in ``create_weights``):
    ``qpass_site``, ``qpass_k_sharded`` (row-parallel: K split over TP ranks), ``qpass_loaded`` (the
    record) and ``logical_widths`` (rows per fused shard)."""
    layer.qpass_site = prefix
    layer.qpass_k_sharded = k_sharded
    layer.qpass_loaded = set()
    layer.logical_widths = list(output_partition_sizes)


def _tp(layer: torch.nn.Module) -> int:
    """How many ranks split the checkpoint tensor the loader receives (1 when the engine hands each rank
    its shard already: SGLang's ``use_presharded_weights``)."""
    if getattr(layer, "use_presharded_weights", False):
        return 1
    return int(getattr(layer, "tp_size", 1) or 1)


def _shard_index(shard_id: Any) -> int | None:
    if shard_id is None or isinstance(shard_id, tuple):
        return None
    return _QKV[shard_id] if isinstance(shard_id, str) else int(shard_id)


def _expected_rows(layer: torch.nn.Module, idx: int | None) -> int | None:
    """Checkpoint rows of shard ``idx`` (None: the whole layer) before the engine's TP narrowing."""
    widths = list(getattr(layer, "logical_widths", []))
    if not widths:
        return None
    tp = _tp(layer)
    if getattr(layer, "qpass_k_sharded", False):
        tp = 1  # row-parallel: the output dim is not split
    replicas = int(getattr(layer, "num_kv_head_replicas", 1) or 1)
    if idx is None:
        return sum(widths) * tp if replicas == 1 else None
    rows = widths[idx] * tp
    if idx in (1, 2) and len(widths) == 3 and replicas > 1:
        rows //= replicas
    return rows


def checked_loader(layer: torch.nn.Module, name: str, loader: Any, method: str = "qpass_nvfp4") -> Any:
    """Wrap an engine weight loader ``loader(param, loaded_weight, [shard_id], ...)``: refuse a tensor of
    the wrong dtype or shape (naming the layer, parameter and shard), and record ``(name, shard)`` in
    ``layer.qpass_loaded`` (:func:`init_load_record`) once the engine's loader returned. ``None`` (no
    loader: the engine copies parameters itself) is returned as is; such a layer records nothing."""
    if loader is None:
        return None

    @functools.wraps(loader)
    def qpass_checked_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
        idx = _shard_index(shard)
        where = f"{method}: layer {layer.qpass_site}: checkpoint tensor {name}" + (f" (shard {shard})" if shard is not None else "")
        if loaded_weight.dtype != param.dtype:
            raise QuantizationError(f"{where} has dtype {loaded_weight.dtype}, expected {param.dtype}")
        if name in ("weight", "weight_scale"):
            if loaded_weight.dim() != 2:
                cols = "K" if getattr(layer, "qpass_act_only", False) else ("K/2" if name == "weight" else "K/16")
                raise QuantizationError(f"{where} has shape {tuple(loaded_weight.shape)}, expected a 2-D [N, {cols}] tensor")
            k_full = param.shape[1] * (_tp(layer) if layer.qpass_k_sharded else 1)
            rows = _expected_rows(layer, idx)
            want = (rows if rows is not None else loaded_weight.shape[0], k_full)
            if tuple(loaded_weight.shape) != want:
                raise QuantizationError(f"{where} has shape {tuple(loaded_weight.shape)}, expected {want}")
        elif loaded_weight.numel() != 1:
            raise QuantizationError(f"{where} has shape {tuple(loaded_weight.shape)}, expected a scalar (one per shard)")
        out = loader(param, loaded_weight, *args, **kwargs)
        layer.qpass_loaded.add((name, idx))
        return out

    return qpass_checked_loader


def check_all_loaded(layer: torch.nn.Module, prefix: str, names: tuple[str, ...] = CHECKED, *, idle_ok: bool = False,
                     method: str = "qpass_nvfp4") -> None:
    """Every parameter of ``names`` was loaded for every shard since the last check; resets the record.

    Args:
        idle_ok: a check with nothing at all loaded since the last one passes (an idempotent repeat of
            ``process_weights_after_loading``; SGLang). vLLM passes False: its reload re-allocates
            the parameters, so a layer its reload did not fill holds garbage.
    Raises:
        QuantizationError: names the layer and the missing ``parameter[shard]``: a partial load or
            update (e.g. new codes without their scales).
    """
    got = set(layer.qpass_loaded)
    layer.qpass_loaded.clear()
    if idle_ok and not got:
        return
    n = len(layer.logical_widths)
    missing = [f"{name}[{i}]" for name in names for i in range(n) if (name, i) not in got and (name, None) not in got]
    if missing:
        loaded = sorted(f"{nm}[{i if i is not None else 'all'}]" for nm, i in got)
        raise QuantizationError(f"{method}: layer {prefix}: {', '.join(missing)} not loaded (missing from the checkpoint or weight "
                                f"update, which brought {', '.join(loaded) or 'nothing'}); refusing to serve new codes with "
                                "stale scales")
