"""Rotary frequencies and tables: the ``llama3`` rescale (transformers >= 4.43) of the pinned base attention's
table, for :mod:`dist_eval.backends.blocks` (the families built on another), the ``yarn`` frequencies
(:func:`yarn_frequencies`), and the pinned table itself on any transformers (:class:`RotaryTable`, with
:func:`default_inv_freq`) for :mod:`dist_eval.backends.layers` (dist_eval's own layers).
"""
from __future__ import annotations

import json
import math
import weakref

# the cos/sin cache a rescaled rotary table starts with (it grows on a longer row, as the base one does)
_ROPE_CACHE_POSITIONS = 4096


class _Tables:
    """The cos and sin tables of one setting on one device, shared by every layer of that setting."""

    __slots__ = ("tables", "__weakref__")

    def __init__(self, tables: tuple):
        self.tables = tables


# (a table's settings, its device) -> its tables, while a layer holds them: one table per model, not per layer (the
# pinned length is the config's max_position_embeddings: 1,024,000 positions in some releases, a GiB of float32)
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def llama3_inv_freq(inv_freq, rope: dict):
    """``inv_freq`` rescaled by the ``llama3`` rule (transformers >= 4.43, in its order of
    operations): long wavelengths divided by ``factor``, short ones kept, between them a
    smooth interpolation.
    """
    import torch

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def on_cpu(function):
    """``function`` (one computing rotary frequencies at a module's ``__init__``) run with the CPU as torch's default
    device: transformers >= 5.0 builds a model's modules under the meta device, where a table made there would hold
    no numbers (the forward moves it to the input's device).
    """
    import functools

    @functools.wraps(function)
    def on_cpu_device(*args, **kwargs):
        import torch

        with torch.device("cpu"):
            return function(*args, **kwargs)

    return on_cpu_device


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(yarn: dict, max_positions: int) -> float:
    """The ``factor`` of ``yarn`` RoPE; where config.json gives none, ``max_position_embeddings`` over the original
    length (transformers 5.x's rule).
    """
    factor = yarn.get("factor")
    return factor if factor is not None else max_positions / (yarn.get("original_max_position_embeddings")
                                                              or max_positions)


@on_cpu
def yarn_frequencies(dim: int, base: float, yarn: dict, max_positions: int) -> tuple:
    """(inverse frequencies [dim / 2], float32, the factor on cos and sin) of ``yarn`` RoPE (config.json's
    ``rope_scaling``) over ``dim`` values at ``base``: transformers' rule in its order of operations, the
    original length ``original_max_position_embeddings``, else ``max_positions``.
    """
    import torch

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    factor = yarn_factor(yarn, max_positions)
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        attention_factor = (float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1
    context = yarn.get("original_max_position_embeddings") or max_positions

    def correction_dim(rotations):
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def rescale_rope(attention, config, computed_by_transformers: bool = False) -> None:
    """The ``llama3`` rotary frequencies for an attention module of ``config``, when it asks for them: on the pinned
    transformers (4.33), its rotary table rescaled; one that computes them itself (``computed_by_transformers``:
    4.43 on) from the config's scaling, which must have kept them, nothing.
    """
    rope = getattr(config, "rope_llama3", None)
    if rope and computed_by_transformers:
        # the table is the model's (>= 4.45) or the attention's (4.43, 4.44), from rope_parameters (5.x) or rope_scaling
        kept = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if kept.get("rope_type", kept.get("type")) != "llama3":
            raise RuntimeError(f"{type(config).__name__}'s rope scaling {kept} is not llama3's, which transformers "
                               "computes here from it: the llama3 frequencies would be lost")
    elif rope:
        rotary = attention.rotary_emb
        rotary.inv_freq = llama3_inv_freq(rotary.inv_freq, rope)
        rotary._set_cos_sin_cache(min(_ROPE_CACHE_POSITIONS, rotary.max_seq_len_cached), rotary.inv_freq.device,
                                  rotary.cos_cached.dtype)


@on_cpu
def default_inv_freq(base: float, dim: int, device="cpu"):
    """RoPE's inverse frequencies over ``dim`` values at ``base`` (float32), as transformers computes them: the
    exponents made on the CPU, the rest on ``device``.
    """
    import torch

    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim))


class RotaryTable:
    """The cos/sin table of the pinned transformers' base attention (4.33's rotary embedding, its ``linear`` and
    ``dynamic`` kinds, and the ``llama3`` frequencies of :func:`llama3_inv_freq`; ``yarn`` as transformers 5.x
    computes it, :func:`yarn_frequencies`), the same bits, on any
    transformers: an attention of dist_eval's own layers calls it as it called the pinned ``rotary_emb``
    (``table(value, seq_len)``: cos and sin [1, 1, seq_len, dim] in the value's dtype).

    Not a module and no buffers (transformers >= 5.0 builds modules on the meta device): built at the first
    forward, on the CPU in torch's default dtype (float32) at the pinned length (the config's
    ``max_position_embeddings``, 4,096 at most after a llama3 rescale), grown to a longer row where the row is, as
    the pinned table is: the pinned computation step for step, so that no vectorized kernel's handling of a table's
    size can move a last bit. A ``dynamic`` table keeps the pinned one's state: the longest row seen sets its base.
    config.json's scaling is read in either generation's form (``type``, 5.x's ``rope_type``).
    """

    def __init__(self, config, dim: int):
        scaling = getattr(config, "rope_scaling", None) or {}
        self.llama3, self.yarn = getattr(config, "rope_llama3", None), getattr(config, "rope_yarn", None)
        # either generation's key (5.x's configs keep rope_type), "default", llama3 (rope_llama3) and yarn
        # (rope_yarn) no scaling of the positions here
        self.kind, self.factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor", 1.0)
        if self.kind == "default" or (self.kind == "llama3" and self.llama3) or (self.kind == "yarn" and self.yarn):
            self.kind = None
        if self.kind not in (None, "linear", "dynamic"):
            raise ValueError(f"rope_scaling of type {self.kind!r}: the rotary table computes linear and dynamic "
                             "(and llama3 through rope_llama3, yarn through rope_yarn)")
        self.dim, self.base, self.max_positions = dim, config.rope_theta, config.max_position_embeddings
        self.length = min(_ROPE_CACHE_POSITIONS, self.max_positions) if self.llama3 else self.max_positions
        self._tables, self._shared = None, None
        settings = [dim, self.base, self.kind, self.factor, self.llama3, self.max_positions, self.length]
        self._settings = json.dumps(settings + ([self.yarn] if self.yarn else []), sort_keys=True, default=str)

    def _build(self, length: int, device, dtype) -> None:
        import torch

        scale = 1.0
        if self.kind == "dynamic" and length > self.max_positions:  # a new base, on the row's device as pinned
            base = self.base * ((self.factor * length / self.max_positions) - (self.factor - 1)) ** (
                self.dim / (self.dim - 2))
            inv_freq = default_inv_freq(base, self.dim, device)
        elif self.yarn:  # transformers' yarn: its frequencies, cos and sin times its factor (float32), then the dtype
            inv_freq, scale = yarn_frequencies(self.dim, self.base, self.yarn, self.max_positions)
            inv_freq = inv_freq.to(device)
        else:  # the pinned module's buffer: made on the CPU at its build (llama3's rescale too), then moved
            inv_freq = default_inv_freq(self.base, self.dim)
            if self.llama3:
                inv_freq = llama3_inv_freq(inv_freq, self.llama3)
            inv_freq = inv_freq.to(device)
        positions = torch.arange(length, device=device, dtype=inv_freq.dtype)
        if self.kind == "linear":
            positions = positions / self.factor
        freqs = torch.einsum("i,j->ij", positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos(), emb.sin()) if scale == 1.0 else (emb.cos() * scale, emb.sin() * scale)
        self.length, self._tables = length, (cos[None, None].to(dtype), sin[None, None].to(dtype))

    def __call__(self, value, seq_len: int) -> tuple:
        import torch

        if seq_len > self.length:  # the pinned table grows on a longer row, built where the row is
            self._build(seq_len, value.device, value.dtype)
            self._shared = None  # this layer's own from now on
        elif self._tables is None:  # the pinned table: made at the module's build, on the CPU
            self._share(torch.device("cpu"), lambda: self._build(self.length, torch.device("cpu"),
                                                                 torch.get_default_dtype()))
        if self._tables[0].device != value.device:  # moved once, as the module's buffers were
            tables = self._tables
            if self._shared is None:
                self._tables = tuple(table.to(value.device) for table in tables)
            else:
                self._share(value.device, lambda: setattr(self, "_tables", tuple(t.to(value.device) for t in tables)))
        return tuple(table[:, :, :seq_len].to(dtype=value.dtype) for table in self._tables)

    def _share(self, device, make) -> None:
        """This layer's pinned tables on ``device``: those another layer of the same settings made there, else
        made by ``make`` (which sets ``_tables``) and kept for the others. The same values either way.
        """
        key = (self._settings, str(device))
        shared = _SHARED.get(key)
        if shared is None:
            make()
            shared = _SHARED[key] = _Tables(self._tables)
        self._shared, self._tables = shared, shared.tables
