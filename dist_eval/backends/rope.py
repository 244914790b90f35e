"""The ``llama3`` rotary frequencies (transformers >= 4.43) on the pinned base attention: one
place for :mod:`dist_eval.backends.blocks` (the families built on another) and
:mod:`dist_eval.backends.layers` (dist_eval's own layers), which both rescale an attention's
rotary tables.
"""
from __future__ import annotations

import math

# the cos/sin cache a rescaled rotary table starts with (it grows on a longer row, as the base one does)
_ROPE_CACHE_POSITIONS = 4096


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


def rescale_rope(attention, config) -> None:
    """The ``llama3`` rotary frequencies for an attention module of ``config``, when it asks for them."""
    rope = getattr(config, "rope_llama3", None)
    if rope and not hasattr(attention, "rotary_emb"):
        # transformers >= 5.0: the table is the model's, computed from rope_parameters, which keep llama3
        if (getattr(config, "rope_parameters", None) or {}).get("rope_type") != "llama3":
            raise RuntimeError(f"{type(attention).__name__} has no rotary table of its own and {type(config).__name__}"
                               f"'s rope_parameters {config.rope_parameters} are not llama3's: the llama3 "
                               "frequencies would be lost")
    elif rope:
        rotary = attention.rotary_emb
        rotary.inv_freq = llama3_inv_freq(rotary.inv_freq, rope)
        rotary._set_cos_sin_cache(min(_ROPE_CACHE_POSITIONS, rotary.max_seq_len_cached), rotary.inv_freq.device,
                                  rotary.cos_cached.dtype)
