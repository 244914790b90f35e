"""The block parts dist_eval computes itself, in plain torch, for the families whose block the
pinned transformers (4.33) has no class for: those with the block option ``own_layers`` in the
family table (:mod:`dist_eval.backends.families`; Mistral and Qwen2 (any head_dim), Qwen3, Qwen3-MoE, GLM-4.5, Mixtral,
DeepSeek-V3, Llama 4, Qwen3.5, Qwen3.5-MoE, Qwen3-Next, MiniMax-M2, gpt-oss, GLM-5, DeepSeek-V3.2 and DeepSeek-V4).

- DeepSeek-V4 (the block option ``hyper_connections``): :class:`HyperConnectedLayer` under the release's names,
  ``hc_mult`` streams between blocks ([batch, positions, hc_mult x hidden], flat), made from the embeddings on the
  backbone's entry and collapsed by :class:`HyperHead` in its final norm (:func:`build_hyper_connected`);
  :class:`V4Attention` (sliding, compressed sparse with :class:`V4Indexer`, heavily compressed: :class:`V4Compressor`),
  :class:`V4MoeMLP` (hash-routed blocks read the rows' token ids from :data:`ROW_TOKEN_IDS`). The servers dist_eval
  starts build :class:`HyperConnectedServerBlock` (the streams travel flat between them; the token ids come with
  each request, :mod:`dist_eval.swarm.merged_forward`); petals' client gets hc_head, the final norm and the streams
  made before its first server from :func:`build_hyper_connected_client`.

- Qwen3.5's hybrid (the block option ``gated_delta_net``): by ``layer_types`` (:func:`layer_type`) a
  :class:`GatedDeltaNet` block (linear attention: :func:`gated_delta_rule` over the whole row) or a
  :class:`GatedAttention` one (an output gate from a q projection twice as wide), norms of
  :class:`OffsetRMSNorm` (1 + weight), the backbone's final one too (:func:`own_final_norm`); Qwen3.5-MoE's
  mixture in every block, :class:`GatedSharedMoeMLP` (the block option ``mixture_of_experts`` "shared_gate").
  Qwen3-Next: the same blocks, its linear attention's projections laid out per key head
  (:class:`InterleavedGatedDeltaNet`), its mixtures where Qwen3-MoE's rule puts them (``moe_by_step``).

- :class:`QkNormAttention`: Llama's attention with an RMSNorm over each head's q and k
  (``q_norm``, ``k_norm``, a weight of ``head_dim`` values) before RoPE when ``use_qk_norm``
  (the family's option, or config.json's), ``head_dim`` set apart from hidden/heads (config.json's
  ``head_dim``), biases on q, k and v when ``attention_bias`` is true (and on o too unless the
  family's ``attention_output_bias`` is false; on q, k and v alone with the family's ``qkv_bias``), and RoPE on
  the first ``partial_rotary_factor`` of each head (GLM-4.5: half; the rest passes unrotated). RoPE, its scaling
  types and the mask are the pinned Llama's; yarn is transformers 5.x's.
- :class:`LatentAttention` (the block option ``latent_attention``, DeepSeek-V3 and Kimi K2):
  multi-head latent attention, RoPE on each head's rope part in DeepSeek's interleaved layout,
  ``yarn`` frequencies whose ``mscale_all_dim`` also scales the softmax (:func:`latent_rope`).
  :class:`SparseLatentAttention` (the block option ``sparse_attention``, GLM-5, DeepSeek-V3.2): the same, each query
  attending to the ``index_topk`` keys its block's :class:`LightningIndexer` (DeepSeek Sparse Attention's)
  keeps, every key in a row of at most ``index_topk`` positions.
- :class:`ChunkedAttention` and :class:`InputScaledMoeMLP` (Llama 4: the block options
  ``llama4_attention`` and ``mixture_of_experts`` "llama4"): RoPE in interleaved pairs but on the
  blocks without it (:func:`uses_rope`), a weightless L2 norm of q and k after it; a router whose
  sigmoid scores scale the chosen experts' input, fused expert tensors (:class:`FusedExperts`), a
  shared expert; under Llama 4's names (``feed_forward.*``), in the blocks of ``moe_layers``.
- FP8 weights (config.json's ``quantization_config``, quant_method ``fp8``): a layer's e4m3
  weights are dequantized as they are loaded (:func:`dequantize_fp8`, each value times its
  tile's ``weight_scale_inv``), here by a load hook, on a server as it reads the block's tensors.
  INT4 weights (quant_method ``compressed-tensors``, ``pack-quantized``: Kimi K2.5's experts) the same
  way (:func:`dequantize_int4`, eight 4-bit values an int32, a scale per group of a row).
- :class:`SinkAttention` and :class:`TopKSoftmaxMoeMLP` (gpt-oss: the block options ``sink_attention`` and
  ``mixture_of_experts`` "gpt_oss"): biases on q, k, v and o, yarn RoPE (:func:`rope_of`), a learned sink
  logit per head joining the softmax, a sliding window on the blocks :func:`sliding_window_of` names
  (computed, whatever the row's length); a router with a bias, the softmax over the chosen logits, fused
  experts with biases and a clamped SwiGLU (:class:`ClampedSwiGLUExperts`). MXFP4 experts (quant_method
  ``mxfp4``) are dequantized as they are loaded (:func:`dequantize_mxfp4`), as FP8 ones are.
- :class:`SparseMoeMLP`: a mixture of ``num_experts`` experts (each a gated MLP of
  ``moe_intermediate_size``): a softmax router (``gate``) over the experts, the
  ``num_experts_per_tok`` most probable chosen per token, their probabilities renormalised
  to sum to 1 when ``norm_topk_prob``, the experts' outputs summed with those weights (in
  the order of the experts' indices). A token's experts and weights depend on that token's
  hidden state alone, and the router and each expert compute at least :data:`MIN_ROWS` rows
  at once (:func:`_rows`), so a row's result is the same whatever else is in its batch
  (padding included): the exactness for any N holds.
- :class:`SigmoidMoeMLP` (GLM-4.5): ``n_routed_experts`` experts and a shared expert
  (``shared_experts``, of ``moe_intermediate_size * n_shared_experts``) every token goes
  through; a sigmoid router (``gate``, computed in float32) whose scores plus
  ``gate.e_score_correction_bias`` choose the experts (within the ``topk_group`` best of
  ``n_group`` groups, a group scored by its two best), the chosen experts weighted by their
  sigmoid scores alone, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
  The router and the routed experts compute at least :data:`MIN_ROWS` rows, as above; the
  shared expert computes the batch's tokens as a dense block's MLP does.
- which block has the mixture (in a family with the block option ``mixture_of_experts``):
  transformers' rule (:func:`is_sparse`), by the block's index: for the softmax router
  (Qwen3-MoE) not in ``mlp_only_layers``, and ``(index + 1) % decoder_sparse_step == 0``; for
  the sigmoid router (GLM-4.5) from ``first_k_dense_replace`` on; Mixtral's every block; the
  others have the dense MLP of ``intermediate_size``.

The same parts make the decoder layers of ``--backend local`` (:class:`OwnDecoderLayer`, by
index) and the blocks of the servers dist_eval starts (:func:`petals_block_class`): petals'
server builds a block as ``config.block_class(config)``, without its index, so those servers
tell it the index of the block they load (:data:`SERVER_BLOCK_INDEX`,
:func:`dist_eval.swarm.blocks.server_block_replacements`). Tensor names are transformers':
``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``mlp.gate``,
``mlp.experts.<e>.{gate,up,down}_proj``, ``mlp.gate.e_score_correction_bias``,
``mlp.shared_experts.{gate,up,down}_proj``; Mixtral's ``block_sparse_moe.gate``,
``block_sparse_moe.experts.<e>.w{1,2,3}``.
"""
from __future__ import annotations

import contextvars
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    repeat_kv,
    rotate_half,
)

from dist_eval.backends.families import indexer_types, v4_compress_rate, v4_layer_types, v4_mlp_types, v4_rope_dim
from dist_eval.backends.rope import (
    RotaryTable,
    default_inv_freq,
    llama3_inv_freq,
    on_cpu,
    yarn_factor,
    yarn_frequencies,
    yarn_mscale,
)

# the block option ``mixture_of_experts`` of a family whose router is GLM-4.5's, and of Mixtral (its
# softmax router is Qwen3-MoE's, "softmax"; its tensors have names of their own, every block has it)
SIGMOID, MIXTRAL, LLAMA4 = "sigmoid", "mixtral", "llama4"
MINIMAX = "minimax"  # MiniMax-M2's: a sigmoid router with a correction bias over Mixtral-named experts
GPT_OSS = "gpt_oss"  # gpt-oss's: a softmax over the top router logits (with a bias), fused experts with biases
SHARED_GATE = "shared_gate"  # Qwen3.5-MoE's: Qwen3-MoE's router and experts, a shared expert behind a sigmoid gate
# the index of the block this process's petals server is loading (None: not loading one)
SERVER_BLOCK_INDEX: contextvars.ContextVar = contextvars.ContextVar("dist_eval_server_block_index", default=None)


@functools.cache
def layers_return_tensors() -> bool:
    """Whether transformers' decoder layers are called with the model's cache as ``past_key_values`` and its
    ``position_embeddings``, and return the hidden states alone (4.5x and 5.x; the pinned 4.33's take
    ``past_key_value`` and return a tuple): how dist_eval's own layers are called there, and its head classes build
    their backbone through ``AutoModel``.
    """
    import inspect

    return "past_key_values" in inspect.signature(LlamaDecoderLayer.forward).parameters


def head_dim_of(config) -> int:
    """The size of one attention head: config.json's ``head_dim``, else hidden/heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def grouped_query_projections(module: nn.Module, config, bias: bool, output_bias: Optional[bool] = None) -> tuple:
    """Set ``module``'s grouped-query attention sizes (hidden_size, num_heads, head_dim, num_key_value_heads,
    num_key_value_groups) and its q/k/v/o projections, each with a bias where ``bias`` says (o's where
    ``output_bias`` says, else ``bias``): the attentions here whose pinned ``__init__`` is not called. Returns the
    widths (all query heads, all key/value heads).
    """
    module.hidden_size, module.num_heads = config.hidden_size, config.num_attention_heads
    module.head_dim = head_dim_of(config)
    module.num_key_value_heads = config.num_key_value_heads
    module.num_key_value_groups = module.num_heads // module.num_key_value_heads
    inner, kv_inner = module.num_heads * module.head_dim, module.num_key_value_heads * module.head_dim
    module.q_proj = nn.Linear(module.hidden_size, inner, bias=bias)
    module.k_proj = nn.Linear(module.hidden_size, kv_inner, bias=bias)
    module.v_proj = nn.Linear(module.hidden_size, kv_inner, bias=bias)
    module.o_proj = nn.Linear(inner, module.hidden_size, bias=bias if output_bias is None else output_bias)
    return inner, kv_inner


def is_sparse(config, index: int) -> bool:
    """Whether block ``index`` of ``config`` has the mixture of experts (else the dense MLP); never
    in a family without the block option ``mixture_of_experts`` (a dense Qwen3 ignores ``num_experts``).
    """
    router = getattr(config, "mixture_of_experts", False)
    if not router:
        return False
    if router == LLAMA4:  # config.json's moe_layers, else every interleave_moe_layer_step-th block
        step = getattr(config, "interleave_moe_layer_step", 1)
        moe_layers = getattr(config, "moe_layers", None)
        return index in (moe_layers if moe_layers is not None else range(step - 1, config.num_hidden_layers, step))
    if router == SIGMOID:  # transformers 5.x's mlp_layer_types where config.json gives it (GLM-5's, DeepSeek-V3.2's)
        types = getattr(config, "mlp_layer_types", None)
        sparse = types[index] == "sparse" if types else index >= config.first_k_dense_replace
        return (getattr(config, "n_routed_experts", 0) or 0) > 0 and sparse
    if router in (MIXTRAL, MINIMAX, GPT_OSS):
        return (getattr(config, "num_local_experts", 0) or 0) > 0
    if router == SHARED_GATE and not getattr(config, "moe_by_step", False):  # Qwen3.5-MoE: every block (its
        return (getattr(config, "num_experts", 0) or 0) > 0  # config has no dense blocks); Qwen3-Next: Qwen3-MoE's rule
    experts = getattr(config, "num_experts", 0) or 0
    dense = getattr(config, "mlp_only_layers", None) or ()
    return experts > 0 and index not in dense and (index + 1) % getattr(config, "decoder_sparse_step", 1) == 0


def largest_block_index(config) -> int:
    """The index of a block of the largest kind: the first with the mixture, else 0 (what a
    block built without its index is, e.g. for petals' size estimate); DeepSeek-V4's, the first compressed sparse
    block (a compressor twice as wide and an indexer), else the first heavily compressed one.
    """
    if getattr(config, "hyper_connections", False):
        kinds = v4_layer_types(config)
        return next((kinds.index(kind) for kind in ("compressed_sparse_attention", "heavily_compressed_attention")
                     if kind in kinds), 0)
    return next((i for i in range(config.num_hidden_layers) if is_sparse(config, i)), 0)


class WholeWidthRMSNorm(LlamaRMSNorm):
    """An RMSNorm over the last two dimensions at once ([..., heads, head_dim]: every head's values of a
    position), its weight one value per head and position in the head: MiniMax-M2's q/k norms (the block
    option ``qk_norm_whole``), which transformers applies to the whole q (k) projection before the heads
    are split.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states.flatten(-2)).view(hidden_states.shape)


class QkNormAttention(LlamaAttention):
    """Llama's attention with per-head q/k RMSNorms before RoPE and a ``head_dim`` of its own.

    A subclass of the pinned ``LlamaAttention`` because petals' server counts the heads of the block's
    ``config.attn_class`` modules; its ``__init__`` (which derives the head size from hidden/heads) is not called.
    Its rotary table is the pinned one's (:class:`~dist_eval.backends.rope.RotaryTable`) on any transformers.
    """

    def __init__(self, config):
        nn.Module.__init__(self)
        self.config = config
        bias = bool(getattr(config, "attention_bias", False))
        output_bias = bias and getattr(config, "attention_output_bias", True)
        if getattr(config, "qkv_bias", False):  # Qwen2's: q, k and v, never o (config.json's attention_bias unread)
            bias, output_bias = True, False
        inner, kv_inner = grouped_query_projections(self, config, bias, output_bias)
        if getattr(config, "qk_norm_whole", False):  # MiniMax-M2: over all heads' q (k) at once
            self.q_norm = WholeWidthRMSNorm(inner, eps=config.rms_norm_eps)
            self.k_norm = WholeWidthRMSNorm(kv_inner, eps=config.rms_norm_eps)
        elif getattr(config, "use_qk_norm", True):
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        # RoPE on the first rotary_dim values of each head (transformers: int(head_dim * partial_rotary_factor))
        self.rotary_dim = int(self.head_dim * getattr(config, "partial_rotary_factor", 1.0))
        self.rotary = RotaryTable(config, self.rotary_dim)

    def _queries(self, hidden_states: torch.Tensor) -> tuple:
        """(each head's query [batch, positions, heads, head_dim], the output gate or None)."""
        bsz, q_len, _ = hidden_states.size()
        return self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim), None

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[tuple] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs) -> tuple:
        bsz, q_len, _ = hidden_states.size()
        heads = (bsz, q_len, -1, self.head_dim)
        query, gate = self._queries(hidden_states)
        query = self.q_norm(query).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states).view(heads)).transpose(1, 2)
        value = self.v_proj(hidden_states).view(heads).transpose(1, 2)

        past = past_key_value[0].shape[-2] if past_key_value is not None else 0
        cos, sin = self.rotary(value, seq_len=past + q_len)  # [1, 1, positions, rotary_dim]
        position_ids = _positions(position_ids, past_key_value, q_len, hidden_states.device)
        cos, sin = cos[0, 0][position_ids].unsqueeze(1), sin[0, 0][position_ids].unsqueeze(1)
        query, key = _rotate(query, cos, sin, self.rotary_dim), _rotate(key, cos, sin, self.rotary_dim)

        key, value, past_key_value = _cached(key, value, past_key_value, use_cache)
        key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)

        weights = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        output = torch.matmul(weights, value).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        if gate is not None:
            output = output * torch.sigmoid(gate)
        return self.o_proj(output), (weights if output_attentions else None), past_key_value


def _positions(position_ids: Optional[torch.Tensor], past_key_value: Optional[tuple], q_len: int, device):
    """``position_ids``, else (petals' server) the ``q_len`` positions after the cached ones."""
    if position_ids is None:
        past = past_key_value[0].shape[-2] if past_key_value is not None else 0
        position_ids = torch.arange(past, past + q_len, device=device)[None]
    return position_ids


def _cached(key: torch.Tensor, value: torch.Tensor, past_key_value: Optional[tuple], use_cache: bool) -> tuple:
    """(key, value) after the cached ones, and the cache the forward returns (None without ``use_cache``)."""
    if past_key_value is not None:
        key = torch.cat([past_key_value[0], key], dim=2)
        value = torch.cat([past_key_value[1], value], dim=2)
    return key, value, ((key, value) if use_cache else None)


# transformers' attention with the arithmetic of petals' llama server block and of the pinned transformers' (4.33)
# LlamaAttention, as QkNormAttention's above: q k^T divided by sqrt(head_dim) (the family table's local_attention
# names it); transformers >= 4.48's "eager" multiplies by head_dim ** -0.5, which rounds apart wherever sqrt(head_dim)
# is no power of two (head_dim 8, 128)
DIVIDED_ATTENTION = "divided_by_sqrt_head_dim"


def divided_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_kwargs):
    """:data:`DIVIDED_ATTENTION`, as transformers' attention interface calls it ([batch, heads, rows, head_dim] in;
    [batch, rows, heads, head_dim] and the weights out): the server block's attention step for step.
    """
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(query.shape[-1])
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class OffsetRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: computed in float32, times ``1 + weight`` (the weight starts at zero), then
    the input's dtype (transformers 5.x's order of operations).
    """

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        states = hidden_states.float()
        states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (states * (1.0 + self.weight.float())).type_as(hidden_states)


class GatedAttention(QkNormAttention):
    """Qwen3.5's full attention (the block option ``gated_delta_net``, its blocks of ``full_attention``):
    :class:`QkNormAttention` whose q projection is twice as wide, each head's query followed by its gate
    (a sigmoid of it multiplies the head's attention output before ``o_proj``), q/k norms of
    :class:`OffsetRMSNorm`; RoPE on ``partial_rotary_factor`` of each head (MRoPE on text rows: each of
    its sections rotates by the one position, which is plain RoPE).
    """

    def __init__(self, config):
        super().__init__(config)
        self.q_proj = nn.Linear(self.hidden_size, 2 * self.num_heads * self.head_dim,
                                bias=bool(getattr(config, "attention_bias", False)))
        self.q_norm = OffsetRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _queries(self, hidden_states: torch.Tensor) -> tuple:
        bsz, q_len, _ = hidden_states.size()
        query, gate = torch.chunk(self.q_proj(hidden_states).view(bsz, q_len, -1, 2 * self.head_dim), 2, dim=-1)
        return query, gate.reshape(bsz, q_len, -1)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet's per-head norm: an RMSNorm (weight times the normed values) times SiLU of the gate."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        states = hidden_states.float()
        states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * states.to(dtype) * F.silu(gate.float())).to(dtype)


# the positions the gated delta rule takes at once (transformers' chunked form: its chunk)
DELTA_CHUNK = 64


def _l2norm(states: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return states * torch.rsqrt((states * states).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor, chunk: int = DELTA_CHUNK) -> torch.Tensor:
    """The gated delta rule over whole rows from a zero state, in float32: per value head a state
    [key dim, value dim] decayed by ``exp(decay)`` each position, corrected toward the position's value
    by ``beta`` (the delta rule), read by the query; q and k L2-normed, q scaled by key_dim ** -0.5.
    query, key [batch, positions, key heads, key dim], value [batch, positions, value heads, value dim]
    (each key head serves value heads / key heads consecutive value heads), decay and beta [batch,
    positions, value heads]; the output is value's shape, in query's dtype.

    Computed in ``chunk`` positions at once (transformers' chunked form, the same operations in its
    order: within a chunk a triangular solve, from chunk to chunk the state), so the numbers are
    transformers' own up to float rounding. Every step is causal: a position's output depends on the
    positions up to it alone, so the right padding after a row (its padded positions finite) leaves
    the row's positions as they are alone, to float rounding (the chunks' sums take the padded
    positions' exact zeros).
    """
    dtype = query.dtype
    batch, positions, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    if key_heads != value_heads:
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    query, key, value, beta, decay = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                      for x in (query, key, value, beta, decay))
    query, key = _l2norm(query), _l2norm(key)
    query = query * key_dim ** -0.5
    pad = -positions % chunk
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, chunk, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta))
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk).cumsum(dim=3)  # log of the decay so far
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (decay.unsqueeze(4) - decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    within = (query @ key.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False,
                                              unitriangular=True)
    state = new_values.new_zeros(batch, value_heads, key_dim, value_dim)
    output = torch.zeros_like(new_values)
    query = query * decay.exp().unsqueeze(-1)
    key = key * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    for i in range(output.shape[2]):
        v_new = new_values[:, :, i] - k_decayed[:, :, i] @ state
        output[:, :, i] = query[:, :, i] @ state + within[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    output = output.reshape(batch, value_heads, -1, value_dim)[:, :, :positions]
    return output.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


class GatedDeltaNet(LlamaAttention):
    """Qwen3.5's linear attention (the block option ``gated_delta_net``, its blocks of ``linear_attention``),
    under transformers' names (``linear_attn.*``): q, k and v from ``in_proj_qkv``, a causal depthwise
    convolution over the positions (``conv1d``, ``linear_conv_kernel_dim`` wide) and SiLU; per value head
    ``beta = sigmoid(in_proj_b(x))`` and the decay ``-exp(A_log) * softplus(in_proj_a(x) + dt_bias)``;
    :func:`gated_delta_rule` over the whole row; a per-head RMSNorm gated by SiLU of ``in_proj_z(x)``
    (:class:`GatedRMSNorm`); ``out_proj``. No cache: a forward is one pass over whole rows (petals' server
    forward). A subclass of the pinned ``LlamaAttention`` with ``num_heads`` of the config's attention
    because petals' server counts the heads of each block's ``config.attn_class`` modules; its
    ``__init__`` is not called.
    """

    reads_child_weights = True  # its forward reads a child's weight without calling the child (backends.streamed)

    def __init__(self, config):
        nn.Module.__init__(self)
        self.config = config
        self.hidden_size, self.num_heads = config.hidden_size, config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        self.conv_dim = 2 * keys + values
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=self.kernel, groups=self.conv_dim,
                                bias=False, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(values, self.hidden_size, bias=False)
        self._build_projections()
        self.act_fn = ACT2FN[config.hidden_act]

    def _build_projections(self) -> None:
        values = self.value_heads * self.value_dim
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, values, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.value_heads, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[tuple] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs) -> tuple:
        if past_key_value is not None:  # nothing is cached (a use_cache forward gets None to keep)
            raise NotImplementedError("the Gated DeltaNet block computes whole rows in one pass (no cache)")
        bsz, positions, _ = hidden_states.shape
        mixed, gate, b, a = self._projections(hidden_states)
        mixed = F.conv1d(mixed.to(self.conv1d.weight.dtype), self.conv1d.weight, None, padding=self.kernel - 1,
                         groups=self.conv_dim)[:, :, :positions]
        mixed = self.act_fn(mixed).to(hidden_states.dtype).transpose(1, 2)
        keys = self.key_heads * self.key_dim
        query, key, value = torch.split(mixed, [keys, keys, self.value_heads * self.value_dim], dim=-1)
        query = query.reshape(bsz, positions, -1, self.key_dim)
        key = key.reshape(bsz, positions, -1, self.key_dim)
        value = value.reshape(bsz, positions, -1, self.value_dim)
        beta = b.sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        output = gated_delta_rule(query, key, value, decay, beta)
        output = self.norm(output.reshape(-1, self.value_dim), gate.reshape(-1, self.value_dim))
        return self.out_proj(output.reshape(bsz, positions, -1)), None, None

    def _projections(self, hidden_states: torch.Tensor) -> tuple:
        """(q, k and v for the convolution [batch, channels, positions], the norm's gate [batch, positions,
        value heads, value_head_dim], b and a [batch, positions, value heads]) of ``hidden_states``.
        """
        bsz, positions, _ = hidden_states.shape
        mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)
        gate = self.in_proj_z(hidden_states).reshape(bsz, positions, -1, self.value_dim)
        return mixed, gate, self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)


class InterleavedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's linear attention (the block option ``interleaved_projections``): :class:`GatedDeltaNet`'s
    computation from two projections laid out per key head, as transformers 5.x's ``Qwen3NextGatedDeltaNet``
    reads them: ``in_proj_qkvz`` gives, for each key head in turn, its q, its k, then the v and z of the
    value heads it serves; ``in_proj_ba`` gives, for each key head, the b then the a of those value heads.
    """

    def _build_projections(self) -> None:
        values = self.value_heads * self.value_dim
        self.in_proj_qkvz = nn.Linear(self.hidden_size, 2 * self.key_heads * self.key_dim + 2 * values, bias=False)
        self.in_proj_ba = nn.Linear(self.hidden_size, 2 * self.value_heads, bias=False)

    def _projections(self, hidden_states: torch.Tensor) -> tuple:
        bsz, positions, _ = hidden_states.shape
        group = self.value_heads // self.key_heads  # the value heads of a key head
        qkvz = self.in_proj_qkvz(hidden_states).view(bsz, positions, self.key_heads, -1)
        ba = self.in_proj_ba(hidden_states).view(bsz, positions, self.key_heads, -1)
        query, key, value, gate = torch.split(
            qkvz, [self.key_dim, self.key_dim, group * self.value_dim, group * self.value_dim], dim=3)
        b, a = torch.split(ba, [group, group], dim=3)
        mixed = torch.cat([x.reshape(bsz, positions, -1) for x in (query, key, value)], dim=-1).transpose(1, 2)
        gate = gate.reshape(bsz, positions, -1, self.value_dim)
        return mixed, gate, b.reshape(bsz, positions, self.value_heads), a.reshape(bsz, positions, self.value_heads)


def layer_type(config, index: int) -> str:
    """The attention of block ``index`` of a hybrid: config.json's ``layer_types``, else transformers'
    default (every ``full_attention_interval``-th block ``full_attention``, the others ``linear_attention``).
    """
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "full_attention" if (index + 1) % getattr(config, "full_attention_interval", 4) == 0 else "linear_attention"


def own_final_norm(config) -> Optional[nn.Module]:
    """The backbone's final norm where the family's is not the pinned Llama's (Qwen3.5's), else None."""
    if getattr(config, "gated_delta_net", False):
        return OffsetRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return None


# the epsilon of DeepSeek-V3's latent norms (q_a_layernorm, kv_a_layernorm): RMSNorm's default, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


@on_cpu
def latent_rope(config) -> tuple:
    """(inverse frequencies [qk_rope_head_dim / 2], the factor on cos and sin, the softmax scale) of
    DeepSeek-V3's latent attention: no scaling, or ``yarn`` (config's ``rope_yarn``:
    :func:`~dist_eval.backends.rope.yarn_frequencies`), whose ``mscale_all_dim`` also scales the softmax.
    """
    dim, base = config.qk_rope_head_dim, config.rope_theta
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    yarn = getattr(config, "rope_yarn", None)
    if not yarn:
        return default_inv_freq(base, dim), 1.0, scale
    inv_freq, attention_factor = yarn_frequencies(dim, base, yarn, config.max_position_embeddings)
    if yarn.get("mscale_all_dim"):
        scale = scale * yarn_mscale(yarn_factor(yarn, config.max_position_embeddings), yarn["mscale_all_dim"]) ** 2
    return inv_freq, attention_factor, scale


class LatentAttention(LlamaAttention):
    """DeepSeek-V3's multi-head latent attention (the block option ``latent_attention``).

    q = ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (``q_proj(x)`` when ``q_lora_rank`` is null), each
    head ``qk_nope_head_dim`` values without RoPE and ``qk_rope_head_dim`` with; the keys' latent
    ``kv_a_proj_with_mqa(x)``: ``kv_lora_rank`` values, normed (``kv_a_layernorm``) and expanded by
    ``kv_b_proj`` into each head's unrotated key and its ``v_head_dim`` value, and a rope part shared
    by every head. RoPE in DeepSeek's interleaved layout (``rope_interleave``), the frequencies and
    softmax scale of :func:`latent_rope`. A subclass of the pinned ``LlamaAttention`` because petals'
    server counts the heads of ``config.attn_class`` modules; its ``__init__`` is not called.
    """

    def __init__(self, config):
        nn.Module.__init__(self)
        self.config = config
        self.hidden_size, self.num_heads = config.hidden_size, config.num_attention_heads
        self.num_key_value_heads, self.num_key_value_groups = self.num_heads, 1  # every head its own key
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                                         config.v_head_dim)
        self.head_dim = self.nope_dim + self.rope_dim  # of a query and a key
        self.interleave = bool(getattr(config, "rope_interleave", True))
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = LlamaRMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = LlamaRMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=bias)
        # float32, kept out of the module's buffers: a server's .to(bfloat16) leaves the frequencies as they are
        self.rope_inv_freq, self.rope_factor, self.scaling = latent_rope(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[tuple] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs) -> tuple:
        bsz, q_len, _ = hidden_states.size()
        q_latent = None if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(hidden_states))
        query = self.q_proj(hidden_states) if q_latent is None else self.q_b_proj(q_latent)
        query = query.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(query, [self.nope_dim, self.rope_dim], dim=-1)
        k_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)).view(bsz, q_len, -1, self.nope_dim + self.v_head_dim)
        k_pass, value = torch.split(k_pass.transpose(1, 2), [self.nope_dim, self.v_head_dim], dim=-1)
        k_rot = k_rot.view(bsz, 1, q_len, self.rope_dim)

        position_ids = _positions(position_ids, past_key_value, q_len, hidden_states.device)
        # as transformers: float32 angles, cos and sin times the yarn factor, then the states' dtype
        freqs = position_ids[..., None].float() * self.rope_inv_freq.to(hidden_states.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.rope_factor).to(query.dtype).unsqueeze(1)
        sin = (angles.sin() * self.rope_factor).to(query.dtype).unsqueeze(1)
        if self.interleave:  # DeepSeek's pairs (x0, x1), (x2, x3)... as halves (x0, x2, ...), (x1, x3, ...)
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = q_rot * cos + rotate_half(q_rot) * sin, k_rot * cos + rotate_half(k_rot) * sin
        query = torch.cat((q_pass, q_rot), dim=-1)
        key = torch.cat((k_pass, k_rot.expand(*k_pass.shape[:-1], -1)), dim=-1)

        key, value, past_key_value = _cached(key, value, past_key_value, use_cache)
        weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = self._sparse(weights, hidden_states, q_latent, (cos, sin), attention_mask)
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        output = torch.matmul(weights, value).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.v_head_dim)
        return self.o_proj(output), (weights if output_attentions else None), past_key_value

    def _sparse(self, weights: torch.Tensor, hidden_states: torch.Tensor, q_latent: Optional[torch.Tensor],
                rope: tuple, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The attention logits ``weights`` [batch, heads, queries, keys] as the softmax takes them (dense: as they
        are; :class:`SparseLatentAttention` masks the keys its indexer leaves out).
        """
        return weights


# the epsilon of the indexer's key LayerNorm (transformers' and DeepSeek's: not rms_norm_eps)
INDEXER_NORM_EPS = 1e-6


class Float32Linear(nn.Module):
    """A linear map without bias computed in float32, its weight a float32 buffer (a server's load converts its
    block's parameters to the serving dtype, not its buffers): transformers' ``_keep_in_fp32_modules`` (the
    indexer's ``weights_proj``), which it computes on the input cast to float32.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


def kept_keys(scores: torch.Tensor, count: int) -> torch.Tensor:
    """[..., keys] bool: the ``count`` highest of ``scores`` [..., keys] (what transformers' ``topk`` keeps); of
    scores equal to the ``count``-th highest, the earlier keys, as many as there is room for. torch's topk keeps
    some of such ties by its kernel's order, which moves with the row's padded length; this rule does not.
    """
    bound = scores.topk(count, dim=-1).values[..., -1:]
    above, tied = scores > bound, scores == bound
    return above | (tied & (tied.cumsum(-1) <= count - above.sum(-1, keepdim=True)))


class LightningIndexer(nn.Module):
    """DeepSeek Sparse Attention's indexer (transformers 5.x's ``GlmMoeDsaIndexer`` / ``DeepseekV32Indexer``), under
    its names (``self_attn.indexer.*``): per query ``index_n_heads`` heads of ``index_head_dim`` from the query
    latent (``wq_b``), one key per position (``wk``, then the LayerNorm ``k_norm``), RoPE on the first
    ``qk_rope_head_dim`` values of each (the attention's cos and sin; interleaved pairs when
    ``indexer_rope_interleave``, GLM-5's, else halves, DeepSeek-V3.2's); a key's score for a query: the sum over
    heads of ``weights_proj``'s weight (float32, times ``index_n_heads ** -0.5``) times ReLU of the heads' dot
    products (float32, times ``index_head_dim ** -0.5``), the attention mask added. The call gives, per query, the
    ``index_topk`` keys kept (:func:`kept_keys`).
    """

    def __init__(self, config):
        super().__init__()
        self.n_heads, self.head_dim, self.index_topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.rope_dim = config.qk_rope_head_dim
        self.interleave = bool(getattr(config, "indexer_rope_interleave", False))
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = Float32Linear(config.hidden_size, self.n_heads)

    def _rotate(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first rope_dim values of each head of ``states`` [batch, positions, heads, head_dim] (the
        rotated part laid out in halves, as transformers gives it whichever the layout).
        """
        rotated, passed = torch.split(states, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        if self.interleave:
            rotated = _deinterleave(rotated)
        return torch.cat([rotated * cos + rotate_half(rotated) * sin, passed], dim=-1)

    def scores(self, hidden_states: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Each query's score of every key [batch, queries, keys], float32, before the mask (transformers' order
        of operations); cos and sin [batch, 1, positions, rope_dim], the attention's.
        """
        bsz, positions, _ = hidden_states.shape
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # [batch, positions, 1, rope_dim]
        query = self._rotate(self.wq_b(q_latent).view(bsz, positions, self.n_heads, self.head_dim), cos, sin)
        key = self._rotate(self.k_norm(self.wk(hidden_states)).unsqueeze(2), cos, sin).squeeze(2)
        dots = F.relu(torch.matmul(query.float(), key.transpose(-1, -2).float().unsqueeze(1)) * self.head_dim ** -0.5)
        weights = self.weights_proj(hidden_states) * self.n_heads ** -0.5
        return torch.matmul(weights.unsqueeze(-2), dots).squeeze(-2)

    def forward(self, hidden_states: torch.Tensor, q_latent: torch.Tensor, rope: tuple,
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """[batch, queries, keys] bool: the keys each query keeps (its ``index_topk`` best scores, the masked
        ones scoring the mask's large negative values).
        """
        scores = self.scores(hidden_states, q_latent, *rope)
        if attention_mask is not None:
            scores = scores + attention_mask[:, 0].float()
        return kept_keys(scores, self.index_topk)


class SparseLatentAttention(LatentAttention):
    """GLM-5's and DeepSeek-V3.2's attention (the block option ``sparse_attention``): :class:`LatentAttention`
    (q from the query latent, which transformers requires: ``q_lora_rank`` set) where each query attends only to
    the ``index_topk`` keys its block's :class:`LightningIndexer` keeps; a row of at most ``index_topk`` positions
    keeps every key (dense attention, the indexer not computed). GLM-5's blocks that ``indexer_types`` marks
    ``shared`` have no indexer (they reuse an earlier block's choice): their rows past ``index_topk`` are
    refused before any forward (:meth:`dist_eval.backends.families.Family.attention_window`), and an error here.
    """

    def __init__(self, config, index: int):
        super().__init__(config)
        self.index, self.index_topk = index, config.index_topk
        shared = getattr(config, "shared_indexers", False)
        self.indexer = LightningIndexer(config) if indexer_types(config, shared)[index] == "full" else None

    def _sparse(self, weights: torch.Tensor, hidden_states: torch.Tensor, q_latent: Optional[torch.Tensor],
                rope: tuple, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        keys = weights.shape[-1]
        if keys <= self.index_topk:  # every key kept
            return weights
        if self.indexer is None or keys != hidden_states.shape[1]:
            why = ("reuses an earlier block's choice of keys (indexer_types 'shared'), not passed between blocks"
                   if self.indexer is None else "has no cache of its indexer's keys")
            raise NotImplementedError(f"block {self.index} attends to {keys} positions, past index_topk "
                                      f"{self.index_topk}, and {why}")
        kept = self.indexer(hidden_states, q_latent, rope, attention_mask)
        return weights.masked_fill(~kept.unsqueeze(1), torch.finfo(weights.dtype).min)


def uses_rope(config, index: int) -> bool:
    """Whether block ``index`` of a Llama 4 config has RoPE (config.json's ``no_rope_layers``: 1 where
    it has; else transformers' default, every ``no_rope_layer_interval``-th block without).
    """
    flags = getattr(config, "no_rope_layers", None)
    if flags:
        return bool(flags[index])
    return (index + 1) % getattr(config, "no_rope_layer_interval", 4) != 0


@on_cpu
def llama4_inv_freq(config, dim: int) -> torch.Tensor:
    """Llama 4's RoPE frequencies over ``dim`` values: at ``rope_theta``, llama3's rescale where config.json says."""
    inv_freq, llama3 = default_inv_freq(config.rope_theta, dim), getattr(config, "rope_llama3", None)
    return llama3_inv_freq(inv_freq, llama3) if llama3 else inv_freq


class ChunkedAttention(LlamaAttention):
    """Llama 4's attention (the block option ``llama4_attention``): Llama's projections with a
    ``head_dim`` of its own; RoPE (DeepSeek's interleaved pairs, the ``llama3`` frequencies when
    config.json says so) only on the blocks :func:`uses_rope` names, and there a weightless L2 norm
    of each head's q and k after it when ``use_qk_norm``. Its chunked attention and attention-temperature
    tuning change nothing within ``attention_chunk_size`` positions and below ``floor_scale - 1``: longer
    rows are refused (:meth:`dist_eval.backends.families.Family.attention_window`).
    """

    def __init__(self, config, index: int):
        nn.Module.__init__(self)
        self.config = config
        grouped_query_projections(self, config, bool(getattr(config, "attention_bias", False)))
        self.use_rope = uses_rope(config, index)
        self.l2_norm = self.use_rope and bool(getattr(config, "use_qk_norm", True))
        self.eps = config.rms_norm_eps
        self.rope_inv_freq = llama4_inv_freq(config, self.head_dim)  # float32, not a buffer

    def _l2(self, states: torch.Tensor) -> torch.Tensor:
        x = states.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(states)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[tuple] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs) -> tuple:
        bsz, q_len, _ = hidden_states.size()
        heads = (bsz, q_len, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(heads).transpose(1, 2)
        key = self.k_proj(hidden_states).view(heads).transpose(1, 2)
        value = self.v_proj(hidden_states).view(heads).transpose(1, 2)
        if self.use_rope:
            position_ids = _positions(position_ids, past_key_value, q_len, hidden_states.device)
            freqs = position_ids[..., None].float() * self.rope_inv_freq.to(hidden_states.device)
            angles = torch.cat((freqs, freqs), dim=-1)
            cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
            # as transformers: in float32 (its complex product), the pairs (x0, x1), (x2, x3)... rotated;
            # the halves' layout here only permutes each head's values alike in q and k
            query, key = (_deinterleave(s.float()) for s in (query, key))
            query = (query * cos + rotate_half(query) * sin).type_as(value)
            key = (key * cos + rotate_half(key) * sin).type_as(value)
            if self.l2_norm:
                query, key = self._l2(query), self._l2(key)
        key, value, past_key_value = _cached(key, value, past_key_value, use_cache)
        key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
        weights = torch.matmul(query, key.transpose(2, 3)) * self.head_dim ** -0.5
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        output = torch.matmul(weights, value).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(output), (weights if output_attentions else None), past_key_value


def sliding_window_of(config, index: int) -> int:
    """gpt-oss's attention window of block ``index`` in positions (0: full attention): config.json's
    ``sliding_window`` on the blocks its ``layer_types`` names ``sliding_attention`` (without layer_types,
    transformers' default: the even blocks).
    """
    types = getattr(config, "layer_types", None)
    kind = types[index] if types else ("sliding_attention" if index % 2 == 0 else "full_attention")
    return int(getattr(config, "sliding_window", 0) or 0) if kind == "sliding_attention" else 0


def rope_of(config, dim: int) -> tuple:
    """(inverse frequencies [dim / 2], the factor on cos and sin) of RoPE over ``dim`` values of each head at
    config.json's ``rope_theta``, scaled by its yarn settings where it has them (``rope_yarn``): the rule of
    :func:`latent_rope` (transformers'), whose softmax scale is not used here.
    """
    from types import SimpleNamespace

    rule = SimpleNamespace(qk_rope_head_dim=dim, qk_nope_head_dim=0, rope_theta=config.rope_theta,
                           rope_yarn=getattr(config, "rope_yarn", None),
                           max_position_embeddings=config.max_position_embeddings)
    inv_freq, factor, _ = latent_rope(rule)
    return inv_freq, factor


class SinkAttention(LlamaAttention):
    """gpt-oss's attention (the block option ``sink_attention``): grouped-query attention with biases on
    q, k, v and o (``attention_bias``), RoPE on every value of each head (yarn where config.json says:
    its factor on cos and sin), and a learned sink logit per head (``sinks``) that joins each query's
    softmax and takes no value; on the blocks :func:`sliding_window_of` names, a query attends to the
    ``sliding_window`` positions up to its own alone (transformers' mask: key > query - window). Every
    window is computed, whatever the row's length. A subclass of the pinned ``LlamaAttention`` because
    petals' server counts the heads of ``config.attn_class`` modules; its ``__init__`` is not called.
    """

    def __init__(self, config, index: int):
        nn.Module.__init__(self)
        self.config = config
        grouped_query_projections(self, config, bool(getattr(config, "attention_bias", True)))
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.window = sliding_window_of(config, index)
        # float32, kept out of the module's buffers: a server's .to(bfloat16) leaves the frequencies as they are
        self.rope_inv_freq, self.rope_factor = rope_of(config, self.head_dim)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[tuple] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs) -> tuple:
        bsz, q_len, _ = hidden_states.size()
        heads = (bsz, q_len, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(heads).transpose(1, 2)
        key = self.k_proj(hidden_states).view(heads).transpose(1, 2)
        value = self.v_proj(hidden_states).view(heads).transpose(1, 2)
        position_ids = _positions(position_ids, past_key_value, q_len, hidden_states.device)
        # as transformers: float32 angles, cos and sin times the yarn factor, then the states' dtype
        freqs = position_ids[..., None].float() * self.rope_inv_freq.to(hidden_states.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.rope_factor).to(query.dtype).unsqueeze(1)
        sin = (angles.sin() * self.rope_factor).to(query.dtype).unsqueeze(1)
        query, key = query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
        key, value, past_key_value = _cached(key, value, past_key_value, use_cache)
        key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
        weights = torch.matmul(query, key.transpose(2, 3)) * self.head_dim ** -0.5
        if attention_mask is not None:
            weights = weights + attention_mask
        if self.window:
            weights = weights.masked_fill(_outside_window(position_ids, key.shape[-2], self.window),
                                          torch.finfo(weights.dtype).min)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(bsz, -1, q_len, -1).to(weights.dtype)
        logits = torch.cat([weights, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values  # as transformers (its guard for bf16)
        weights = F.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1].to(query.dtype)  # the sink dropped
        output = torch.matmul(weights, value).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(output), (weights if output_attentions else None), past_key_value


def _outside_window(position_ids: torch.Tensor, keys: int, window: int) -> torch.Tensor:
    """[batch or 1, 1, queries, keys]: true where a key is at or before the query's position - ``window``."""
    key_positions = torch.arange(keys, device=position_ids.device)
    return (key_positions[None, None, :] <= position_ids[:, :, None] - window).unsqueeze(1)


def _deinterleave(states: torch.Tensor) -> torch.Tensor:
    b, h, s, d = states.shape
    return states.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """RoPE on the first ``rotary_dim`` values of each head, the rest as they are."""
    if rotary_dim == states.shape[-1]:
        return states * cos + rotate_half(states) * sin
    rotated, passed = states[..., :rotary_dim], states[..., rotary_dim:]
    return torch.cat([rotated * cos + rotate_half(rotated) * sin, passed], dim=-1)


class ExpertMLP(nn.Module):
    """One expert: a gated MLP (``down(act(gate(x)) * up(x))``) of its own intermediate size."""

    def __init__(self, config, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MixtralExpert(nn.Module):
    """One Mixtral expert, under Mixtral's names: ``w2(act(w1(x)) * w3(x))`` of ``intermediate_size``."""

    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class SparseMoeMLP(nn.Module):
    """A mixture of experts: softmax router, the top ``num_experts_per_tok`` per token. Mixtral's
    (the block option ``mixture_of_experts`` "mixtral"): ``num_local_experts`` :class:`MixtralExpert`,
    the weights always renormalised.
    """

    def __init__(self, config):
        super().__init__()
        mixtral = getattr(config, "mixture_of_experts", None) in (MIXTRAL, MINIMAX)
        self.num_experts = config.num_local_experts if mixtral else config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = mixtral or bool(config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MixtralExpert(config) if mixtral else ExpertMLP(config, config.moe_intermediate_size)
            for _ in range(self.num_experts))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        probabilities = F.softmax(_rows(self.gate, tokens), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return routed_sum(tokens, chosen, weights.to(tokens.dtype), self.experts.__getitem__).view(hidden_states.shape)


def routed_sum(tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, expert_at) -> torch.Tensor:
    """The sum, in ``weights``' dtype, over each token's ``chosen`` experts ([tokens, top_k]) of their outputs
    (``expert_at(e)``: expert ``e``, called on its tokens) times ``weights``.
    """
    output = torch.zeros_like(tokens, dtype=weights.dtype)
    for expert in torch.unique(chosen).tolist():  # ascending: each token sums its experts in that order
        token, slot = torch.where(chosen == expert)
        output.index_add_(0, token, _rows(expert_at(expert), tokens[token]) * weights[token, slot, None])
    return output


class CorrectedSigmoidMoeMLP(SparseMoeMLP):
    """MiniMax-M2's mixture (the block option ``mixture_of_experts`` "minimax"): Mixtral's names and experts
    (``block_sparse_moe.gate``, ``block_sparse_moe.experts.<e>.w1/w3/w2`` of ``intermediate_size``), each token's
    ``num_experts_per_tok`` experts chosen by the sigmoid of its router logits (float32) plus a correction bias
    (``block_sparse_moe.e_score_correction_bias``, for the choice alone), weighted by those sigmoids
    renormalised over the chosen (transformers 5.x's MiniMaxM2TopKRouter); no groups, no scaling, no shared expert.
    """

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores = _whole_steps(torch.sigmoid, _rows(self.gate, tokens.to(self.gate.weight.dtype)).float())
        chosen = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(tokens.dtype)
        return routed_sum(tokens, chosen, weights, self.experts.__getitem__).view(hidden_states.shape)


class GatedSharedMoeMLP(SparseMoeMLP):
    """Qwen3.5-MoE's mixture (the block option ``mixture_of_experts`` "shared_gate"): :class:`SparseMoeMLP`'s
    softmax router and experts (``mlp.gate``, ``mlp.experts.<e>.*``, the chosen weights renormalised when
    ``norm_topk_prob``), plus a shared expert every token goes through (``shared_expert``, of
    ``shared_expert_intermediate_size``) times the sigmoid of its own gate (``shared_expert_gate``, one
    logit per token), added after the routed experts' sum (transformers' order).
    """

    def __init__(self, config):
        super().__init__(config)
        self.shared_expert = ExpertMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routed = super().forward(hidden_states)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        gate = _whole_steps(torch.sigmoid, _rows(self.shared_expert_gate, tokens))
        return routed + (gate * _rows(self.shared_expert, tokens)).view(hidden_states.shape)


class FusedExperts(nn.Module):
    """Llama 4's experts, their weights fused under its names: ``gate_up_proj`` [experts, hidden,
    2 x intermediate] (gate then up) and ``down_proj`` [experts, intermediate, hidden].
    """

    def __init__(self, config):
        super().__init__()
        experts, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inner).normal_(0.0, 0.02))
        self.down_proj = nn.Parameter(torch.empty(experts, inner, hidden).normal_(0.0, 0.02))
        self.act_fn = ACT2FN[config.hidden_act]

    def expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` on ``rows`` [count, hidden] (at least MIN_ROWS of them: _rows)."""
        gate, up = torch.matmul(rows, self.gate_up_proj[index]).chunk(2, dim=-1)
        return torch.matmul(up * self.act_fn(gate), self.down_proj[index])


class InputScaledMoeMLP(nn.Module):
    """Llama 4's mixture: a router (``router``) choosing the ``num_experts_per_tok`` experts of the
    highest logits, each fed the token times the sigmoid of its logit (the expert's input scaled, not
    its output), their outputs summed with a shared expert's (``shared_expert``) every token goes through.
    """

    reads_child_weights = True  # its forward reads a child's weight without calling the child (backends.streamed)

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = FusedExperts(config)
        self.shared_expert = ExpertMLP(config, config.intermediate_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        top, chosen = torch.topk(_rows(self.router, tokens), self.top_k, dim=-1)
        scores = _whole_steps(torch.sigmoid, top.float()).to(tokens.dtype)
        routed = torch.zeros_like(tokens)
        for expert in torch.unique(chosen).tolist():  # ascending: each token sums its experts in that order
            token, slot = torch.where(chosen == expert)
            run = functools.partial(self.experts.expert, expert)
            routed.index_add_(0, token, _rows(run, tokens[token] * scores[token, slot, None]))
        return (_rows(self.shared_expert, tokens) + routed).view(hidden_states.shape)  # every token: _rows too


class ClampedSwiGLUExperts(nn.Module):
    """gpt-oss's experts, fused under its names with their biases: ``gate_up_proj`` [experts, hidden,
    2 x intermediate] (gate and up interleaved: the even columns gate, the odd up), ``gate_up_proj_bias``,
    ``down_proj`` [experts, intermediate, hidden], ``down_proj_bias``. An expert computes
    ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``, the gate clamped above at ``swiglu_limit`` and up
    within +-``swiglu_limit``, then ``down_proj`` (transformers' GptOssExperts, in its order).
    """

    def __init__(self, config):
        super().__init__()
        experts, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inner).normal_(0.0, 0.02))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * inner))
        self.down_proj = nn.Parameter(torch.empty(experts, inner, hidden).normal_(0.0, 0.02))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` on ``rows`` [count, hidden] (at least MIN_ROWS of them: _rows)."""
        gate_up = torch.matmul(rows, self.gate_up_proj[index]) + self.gate_up_proj_bias[index]
        gate = gate_up[..., ::2].clamp(min=None, max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * _whole_steps(torch.sigmoid, gate * self.alpha)  # every element by the vector path
        return torch.matmul((up + 1) * glu, self.down_proj[index]) + self.down_proj_bias[index]


class TopKSoftmaxMoeMLP(nn.Module):
    """gpt-oss's mixture (the block option ``mixture_of_experts`` "gpt_oss", every block): a router with a
    bias (``mlp.router``) whose ``num_experts_per_tok`` highest logits choose the experts, weighted by the
    softmax over those chosen logits alone; :class:`ClampedSwiGLUExperts` (``mlp.experts.*``).
    """

    reads_child_weights = True  # its forward reads a child's weight without calling the child (backends.streamed)

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = ClampedSwiGLUExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        top, chosen = torch.topk(_rows(self.router, tokens), self.top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=top.dtype)
        return routed_sum(tokens, chosen, weights,
                          lambda expert: functools.partial(self.experts.expert, expert)).view(hidden_states.shape)


class SigmoidRouter(nn.Module):
    """GLM-4.5's router: its logits in float32 (``weight``), and the bias its scores get for the
    choice alone (``e_score_correction_bias``, a float32 buffer saved with the weights).
    """

    def __init__(self, config):
        super().__init__()
        weight = torch.empty(config.n_routed_experts, config.hidden_size)  # as transformers initialises it
        self.weight = nn.Parameter(weight.normal_(0.0, getattr(config, "initializer_range", 0.02)))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens.float(), self.weight.float())


class SigmoidMoeMLP(nn.Module):
    """GLM-4.5's mixture: a sigmoid top-k router with a correction bias for the choice and grouped
    selection, ``routed_scaling_factor``, and a shared expert every token goes through.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = SigmoidRouter(config)
        self.experts = nn.ModuleList(ExpertMLP(config, config.moe_intermediate_size) for _ in range(self.num_experts))
        self.shared_experts = ExpertMLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The experts of each token ([tokens, top_k]): the best scores plus the correction bias,
        within the ``topk_group`` groups whose two best are best. An expert outside them is never chosen (its
        score -inf, as DeepSeek's own code, transformers 5.x and its GLM-4.5, DeepSeek-V3, GLM-5, V3.2 have it);
        transformers 4.x set it to 0, which chose one where the kept groups' corrected scores were below 0.
        """
        choice = scores + self.gate.e_score_correction_bias[None]
        groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        best_groups = torch.topk(groups.topk(2, dim=-1)[0].sum(dim=-1), k=self.topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros(choice.shape[0], self.n_group, dtype=torch.bool, device=choice.device)
        kept.scatter_(1, best_groups, True)
        choice = choice.masked_fill(~kept.repeat_interleave(self.num_experts // self.n_group, dim=1), float("-inf"))
        return torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores = _whole_steps(torch.sigmoid, _rows(self.gate, tokens))
        chosen = self.choose(scores)
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        routed = routed_sum(tokens, chosen, weights, self.experts.__getitem__)
        # the shared expert sees every token, through _rows as the experts do: a batch of fewer tokens than
        # MIN_ROWS would otherwise run another kernel path (on AVX2, other last bits for a row alone)
        return routed.to(tokens.dtype).view(hidden_states.shape) + _rows(self.shared_experts, tokens).view(
            hidden_states.shape)


SCALE_SUFFIX = "_scale_inv"  # <name>.weight_scale_inv: the scale of each tile of <name>.weight (FP8)


def fp8_block_size(config) -> Optional[tuple]:
    """(rows, columns) of a tile of config.json's FP8 weights (``quantization_config``, quant_method
    ``fp8``: ``weight_block_size``); None when the weights are not FP8.
    """
    quantization = getattr(config, "quantization_config", None)
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return None
    return tuple(quantization.get("weight_block_size") or (128, 128))


def dequantize_fp8(tensors: dict, block: tuple, prefix: str = "", where: str = "") -> None:
    """In place: each FP8 (e4m3) ``<name>.weight`` under ``prefix`` becomes a float32 weight, each value
    times the float32 ``<name>.weight_scale_inv`` of its ``block`` tile (DeepSeek-V3's format; the last
    tiles may be partial), the scales removed. ``where``: the file or block named by an error.
    """
    from dist_eval.errors import UsageError

    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    for key in [k for k in tensors if k.startswith(prefix) and k.endswith(".weight" + SCALE_SUFFIX)]:
        name, scale = key[:-len(SCALE_SUFFIX)], tensors.pop(key)
        weight = tensors.get(name)
        if weight is None or weight.dtype not in fp8 or weight.dim() != 2:
            found = "missing" if weight is None else f"{tuple(weight.shape)} {weight.dtype}"
            raise UsageError(f"{key} scales FP8 tiles of {name}, which is {found} beside it; save a weight "
                             "and its weight_scale_inv in the same file (or the model dequantized).",
                             param="model_dir", value=where)
        rows, cols = weight.shape
        tiles = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != tiles:
            raise UsageError(f"{key} has shape {tuple(scale.shape)}; {name} {tuple(weight.shape)} in tiles of "
                             f"{list(block)} (weight_block_size in config.json) needs {tiles}.",
                             param="model_dir", value=where)
        scales = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        tensors[name] = weight.to(torch.float32) * scales


PACKED_SUFFIX = "_packed"  # <name>.weight_packed, beside <name>.weight_scale and <name>.weight_shape (INT4)
NIBBLES = 8  # 4-bit values in an int32


def int4_group_size(config) -> Optional[int]:
    """The values of a row that share a scale in config.json's INT4 weights (compressed-tensors'
    ``pack-quantized``, its one group size: family_of refused the rest); None when not INT4.
    """
    quantization = getattr(config, "quantization_config", None)
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "compressed-tensors":
        return None
    sizes = {group["weights"]["group_size"] for group in quantization["config_groups"].values()}
    return sizes.pop() if len(sizes) == 1 else None


def dequantize_int4(tensors: dict, group: int, prefix: str = "", where: str = "") -> None:
    """In place: each ``<name>.weight_packed`` under ``prefix`` (compressed-tensors' pack-quantized INT4, as Kimi
    K2.5's experts are stored) becomes ``<name>.weight`` of ``<name>.weight_shape``, in the dtype of its
    ``<name>.weight_scale`` (one scale per ``group`` values of a row): value times scale, computed in that
    dtype as compressed-tensors' own dequantization does (so bf16 scales give the bf16 weights transformers
    loads). Layout: int32 ``[k]`` of a row holds columns 8k..8k+7, column 8k+j in bits 4j..4j+3 (the lowest
    first), stored as value + 8 (values -8..7); the scale of column c is ``weight_scale[:, c // group]``.
    """
    for key in [k for k in tensors if k.startswith(prefix) and k.endswith(".weight" + PACKED_SUFFIX)]:
        name = key[:-len(PACKED_SUFFIX)]
        packed, scale, shape = tensors.pop(key), tensors.pop(name + "_scale", None), tensors.pop(name + "_shape", None)
        rows, cols = _int4_shape(name, packed, scale, shape, group, where)
        _drop_zero_point(tensors, name, where)
        shifts = torch.arange(0, 4 * NIBBLES, 4, dtype=torch.int32)
        nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF  # [rows, cols / 8, 8]: column 8k + j
        values = nibbles.reshape(rows, -1)[:, :cols] - 8
        tensors[name] = values.to(scale.dtype) * scale.repeat_interleave(group, 1)[:, :cols]


def _int4_shape(name: str, packed, scale, shape, group: int, where: str) -> tuple:
    """(rows, columns) of the INT4 weight ``name`` from its weight_shape, every tensor's shape checked."""
    from dist_eval.errors import UsageError

    def refuse(why: str):
        return UsageError(f"{name}{PACKED_SUFFIX}: {why}; save each weight_packed with its weight_scale and "
                          "weight_shape in the same file, as compressed-tensors does (or the model dequantized).",
                          param="model_dir", value=where)

    if scale is None or shape is None:
        raise refuse(f"{name}_scale or {name}_shape is not beside it")
    if packed.dtype != torch.int32 or packed.dim() != 2 or shape.numel() != 2:
        raise refuse(f"{tuple(packed.shape)} {packed.dtype} with weight_shape {shape.tolist()} is not an int32 matrix "
                     "packing a matrix")
    rows, cols = (int(n) for n in shape.tolist())
    needed = {"weight_packed": (rows, -(-cols // NIBBLES)), "weight_scale": (rows, -(-cols // group))}
    found = {"weight_packed": tuple(packed.shape), "weight_scale": tuple(scale.shape)}
    if found != needed:
        raise refuse(f"shapes {found}; a weight_shape of {[rows, cols]} in groups of {group} (group_size in "
                     f"config.json) needs {needed}")
    return rows, cols


def _drop_zero_point(tensors: dict, name: str, where: str) -> None:
    """A symmetric scheme's ``<name>.weight_zero_point``, if saved, removed: zeros, or refused."""
    from dist_eval.errors import UsageError

    zero = tensors.pop(name + "_zero_point", None)
    if zero is not None and bool(zero.ne(0).any()):
        raise UsageError(f"{name}_zero_point holds values other than 0, though config.json says the INT4 weights are "
                         "symmetric; fix config.json's quantization_config (or save the model dequantized).",
                         param="model_dir", value=where)


# the e2m1 value of each 4-bit MXFP4 code (the sign its top bit), as transformers' FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"  # <name>_blocks and <name>_scales: the MXFP4 form of <name>


def is_mxfp4(config) -> bool:
    """Whether config.json's ``quantization_config`` says MXFP4 (quant_method ``mxfp4``: gpt-oss's experts)."""
    quantization = getattr(config, "quantization_config", None)
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def dequantize_mxfp4(tensors: dict, prefix: str = "", where: str = "") -> None:
    """In place: each MXFP4 ``<name>_blocks`` under ``prefix`` (uint8 [experts, rows, groups, 16]: per group
    of 32 values, two 4-bit e2m1 codes a byte, the low nibble first) with its ``<name>_scales`` (uint8
    [experts, rows, groups]: the group's power of two, biased by 127) becomes the float32 ``<name>``
    [experts, groups x 32, rows], as transformers 5.x dequantizes gpt-oss's experts (the same operations:
    a table of the codes' values, ``ldexp`` by the scale, the last two dimensions swapped). ``where``: the
    file or block named by an error.
    """
    from dist_eval.errors import UsageError

    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    for key in [k for k in tensors if k.startswith(prefix) and k.endswith(MXFP4_BLOCKS)]:
        name = key[:-len(MXFP4_BLOCKS)]
        blocks, scales = tensors.pop(key), tensors.pop(name + MXFP4_SCALES, None)
        if scales is None or blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            found = "missing" if scales is None else f"{tuple(scales.shape)}"
            raise UsageError(f"{key} {tuple(blocks.shape)} holds MXFP4 values of {name}, whose {name}{MXFP4_SCALES} "
                             f"is {found}; expected blocks [experts, rows, groups, 16] beside scales [experts, rows, "
                             "groups] in the same file (or the model dequantized).", param="model_dir", value=where)
        codes = blocks.to(torch.uint8).long()
        values = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1).reshape(*scales.shape, 32)
        values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
        tensors[name] = values.reshape(*scales.shape[:-1], -1).transpose(1, 2).contiguous()


# MKL computes a matrix product of few rows by another path than one of many, summing in
# another order: measured here (torch 2.13, MKL 2024.2, one thread), the last bits of a row
# differ below 16 rows (below 3 for 64 columns, 6 for 128, 11 for 256) and never from 16 on.
MIN_ROWS = 32


def _rows(module, rows: torch.Tensor) -> torch.Tensor:
    """``module(rows)`` (rows: [count, features]), each row's result independent of the count.

    An expert sees the tokens routed to it, a few or many as the batch goes, so the number of
    rows of its products changes with what else is in the batch; fewer than :data:`MIN_ROWS`
    are computed with zero rows added (their results dropped).
    """
    count = rows.shape[0]
    if count >= MIN_ROWS:
        return module(rows)
    return module(torch.cat([rows, rows.new_zeros(MIN_ROWS - count, rows.shape[1])]))[:count]


# The most elements one vectorised step of torch's CPU elementwise kernels takes (two vectors of 32
# bfloat16 on AVX-512); the elements after the last whole step are computed by a scalar path, whose
# transcendental functions (exp, sigmoid) differ from the vector ones in the last bits
STEP_ELEMENTS = 64


def _whole_steps(function, rows: torch.Tensor) -> torch.Tensor:
    """``function(rows)`` of an elementwise ``function`` (rows: [count, width]), each row's result
    independent of the count: each row padded to a multiple of :data:`STEP_ELEMENTS`, so that every
    element is computed by the vector path (a router's scores: a few experts a row, whose last rows
    would otherwise take the scalar path or not as the batch goes).
    """
    pad = -rows.shape[-1] % STEP_ELEMENTS
    return function(F.pad(rows, (0, pad)))[..., :rows.shape[-1]] if pad else function(rows)


def build_layer_parts(layer: nn.Module, config, index: int) -> None:
    """Give ``layer`` (a Llama decoder layer, its ``__init__`` not run) the parts of block ``index``."""
    layer.hidden_size = config.hidden_size
    hybrid = bool(getattr(config, "gated_delta_net", False))
    if hybrid and layer_type(config, index) == "linear_attention":  # its tensors are linear_attn.*
        interleaved = getattr(config, "interleaved_projections", False)
        layer.linear_attn = (InterleavedGatedDeltaNet if interleaved else GatedDeltaNet)(config)
        object.__setattr__(layer, "self_attn", layer.linear_attn)  # what the pinned layer's forward calls
    elif hybrid:
        layer.self_attn = GatedAttention(config)
    elif getattr(config, "latent_attention", False):
        sparse = getattr(config, "sparse_attention", False)
        layer.self_attn = SparseLatentAttention(config, index) if sparse else LatentAttention(config)
    elif getattr(config, "llama4_attention", False):
        layer.self_attn = ChunkedAttention(config, index)
    elif getattr(config, "sink_attention", False):
        layer.self_attn = SinkAttention(config, index)
    else:
        layer.self_attn = QkNormAttention(config)
    router = getattr(config, "mixture_of_experts", False)
    if router == LLAMA4:  # its tensors are feed_forward.*; the pinned layer's forward calls self.mlp
        sparse = is_sparse(config, index)
        layer.feed_forward = InputScaledMoeMLP(config) if sparse else ExpertMLP(config, config.intermediate_size_mlp)
        object.__setattr__(layer, "mlp", layer.feed_forward)  # the same module, not registered twice
    elif not is_sparse(config, index):
        layer.mlp = LlamaMLP(config)
    elif router == GPT_OSS:
        layer.mlp = TopKSoftmaxMoeMLP(config)
    elif router in (MIXTRAL, MINIMAX):  # its tensors are block_sparse_moe.*; the pinned layer's forward calls mlp
        layer.block_sparse_moe = (CorrectedSigmoidMoeMLP if router == MINIMAX else SparseMoeMLP)(config)
        object.__setattr__(layer, "mlp", layer.block_sparse_moe)  # the same module, not registered twice
    else:
        layer.mlp = (SigmoidMoeMLP(config) if router == SIGMOID else GatedSharedMoeMLP(config)
                     if router == SHARED_GATE else SparseMoeMLP(config))
    norm = OffsetRMSNorm if hybrid else LlamaRMSNorm
    layer.input_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
    layer.post_attention_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
    block = fp8_block_size(config)
    if block is not None:  # transformers' loader hands each module the file's tensors: FP8 ones dequantized first
        layer._register_load_state_dict_pre_hook(_dequantized_on_load(dequantize_fp8, block=block))
    group = int4_group_size(config)
    if group is not None:  # the same, INT4 ones
        layer._register_load_state_dict_pre_hook(_dequantized_on_load(dequantize_int4, group=group))
    if is_mxfp4(config):  # the same, MXFP4 ones (gpt-oss's experts)
        layer._register_load_state_dict_pre_hook(_dequantized_on_load(dequantize_mxfp4))


def _dequantized_on_load(dequantize, **settings):
    """A layer's load hook: its quantized tensors in ``state_dict`` (one file's tensors) dequantized by
    ``dequantize`` (:func:`dequantize_fp8`, ``_int4``, ``_mxfp4``, ``_v4``) with ``settings`` (its tile or group).
    """
    return functools.partial(_dequantize_on_load, functools.partial(dequantize, **settings))


def _dequantize_on_load(dequantize, state_dict: dict, prefix: str, *args) -> None:
    dequantize(state_dict, prefix=prefix, where=prefix + "*")


# ---------------------------------------------------------------- DeepSeek-V4 (the block option hyper_connections)

# the token ids of the rows being computed ([batch, positions], no prompt positions), for DeepSeek-V4's hash-routed
# mixtures (tid2eid[token id]); set around a forward by the local backend (None: not known)
ROW_TOKEN_IDS: contextvars.ContextVar = contextvars.ContextVar("dist_eval_row_token_ids", default=None)
def v4_rope(config, compressed: bool) -> tuple:
    """(inverse frequencies [rope_dim / 2], the factor on cos and sin) of DeepSeek-V4's RoPE: ``main`` (the sliding
    blocks: ``rope_theta``, no scaling) or ``compress`` (the compressed blocks, their compressors and indexers:
    ``compress_rope_theta``, yarn where config.json's rope scaling says, its cos/sin factor 1 unless it names one,
    the correction range always truncated: transformers 5.23 reads ``truncate`` from the outer rope_parameters).
    """
    from types import SimpleNamespace

    yarn = getattr(config, "rope_yarn", None) if compressed else None
    if yarn:
        yarn = {**yarn, "truncate": True, "attention_factor": yarn.get("attention_factor", 1.0)}
    base = getattr(config, "compress_rope_theta", 160000.0) if compressed else config.rope_theta
    rule = SimpleNamespace(qk_rope_head_dim=v4_rope_dim(config), qk_nope_head_dim=0, rope_theta=base, rope_yarn=yarn,
                           max_position_embeddings=config.max_position_embeddings)
    inv_freq, factor, _ = latent_rope(rule)
    return inv_freq, factor


def v4_cos_sin(inv_freq: torch.Tensor, factor: float, positions: torch.Tensor, dtype) -> tuple:
    """Cos and sin [batch, positions, rope_dim / 2] (one per interleaved pair), as transformers 5.x's
    DeepseekV4RotaryEmbedding: float32 angles, times the factor, in ``dtype``.
    """
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    return (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)


def v4_rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last ``2 * cos.shape[-1]`` values of ``states`` [batch, heads, positions, dim] in interleaved pairs
    (cos, sin [batch, positions, rope_dim / 2]), the others as they are: transformers 5.x's apply_rotary_pos_emb.
    """
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rope_dim = cos.shape[-1]
    passed, rope = states[..., :-rope_dim], states[..., -rope_dim:]
    pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = ((rope.float() * cos) + (pairs.float() * sin)).to(states.dtype)
    return torch.cat([passed, rotated], dim=-1)


def _unweighted_rms(states: torch.Tensor, eps: float) -> torch.Tensor:
    return states * torch.rsqrt(states.float().square().mean(-1, keepdim=True) + eps).to(states.dtype)


class V4RMSNorm(nn.Module):
    """DeepSeek-V4's RMSNorm: float32 statistics, the weight times the normed values, then the input's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        normed = states.to(torch.float32)
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(states.dtype)


class V4Compressor(nn.Module):
    """A DeepSeek-V4 compressor (``attn.compressor``, ``attn.indexer.compressor``): every ``rate`` positions one
    entry of ``dim`` values, the softmax over the window of ``wgate``'s logits plus ``ape`` weighting ``wkv``'s
    values, normed (``norm``), RoPE at the window's first position. ``overlap`` (compressed sparse attention): the
    projections are twice as wide, each entry also weighing the previous window's first halves (transformers 5.x's
    Ca / Cb series); no cache: the first window has no previous one.
    """

    def __init__(self, config, rate: int, dim: int, overlap: bool):
        super().__init__()
        self.rate, self.dim, self.overlap = rate, dim, overlap
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(config.hidden_size, width, bias=False)
        self.wgate = nn.Linear(config.hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width))
        self.norm = V4RMSNorm(dim, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, rope: tuple) -> torch.Tensor:
        """[batch, entries, dim]: one entry per whole window of the row (none for a shorter row)."""
        bsz, positions, _ = hidden_states.shape
        windows = positions // self.rate
        if windows == 0:
            return hidden_states.new_zeros((bsz, 0, self.dim))
        usable = windows * self.rate
        kv = self.wkv(hidden_states)[:, :usable].view(bsz, windows, self.rate, -1)
        gate = self.wgate(hidden_states)[:, :usable].view(bsz, windows, self.rate, -1) + self.ape
        if self.overlap:
            kv, gate = self._with_previous(kv, gate)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        compressed = self.norm((kv * weights).sum(dim=2))
        starts = (torch.arange(windows, device=compressed.device) * self.rate).unsqueeze(0).expand(bsz, -1)
        cos, sin = v4_cos_sin(*rope, starts, compressed.dtype)
        return v4_rotate(compressed.unsqueeze(1), cos, sin).squeeze(1)

    def _with_previous(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple:
        """[batch, windows, 2 x rate, dim]: each window's second halves after the previous window's first halves
        (the first window's: values 0, logits -inf, weight 0).
        """
        bsz, windows, rate, _ = kv.shape
        wide_kv = kv.new_zeros((bsz, windows, 2 * rate, self.dim))
        wide_gate = gate.new_full((bsz, windows, 2 * rate, self.dim), float("-inf"))
        wide_kv[:, :, rate:], wide_gate[:, :, rate:] = kv[..., self.dim:], gate[..., self.dim:]
        if windows > 1:
            wide_kv[:, 1:, :rate], wide_gate[:, 1:, :rate] = kv[:, :-1, :, :self.dim], gate[:, :-1, :, :self.dim]
        return wide_kv, wide_gate


class V4Indexer(nn.Module):
    """DeepSeek-V4's lightning indexer (``attn.indexer``): its own compressor of ``index_head_dim`` values, per
    query ``index_n_heads`` heads from the query latent (``wq_b``, RoPE at the compress frequencies); an entry's
    score: the sum over heads of ``weights_proj``'s weight (times heads ** -0.5) times ReLU of the head's product
    (times index_head_dim ** -0.5), in float32. Each query keeps its ``index_topk`` best entries among those whose
    window ended at or before it (:func:`kept_keys`: ties at the bound keep the earlier).
    """

    def __init__(self, config, rate: int):
        super().__init__()
        self.heads, self.dim, self.index_topk, self.rate = (config.index_n_heads, config.index_head_dim,
                                                            config.index_topk, rate)
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)
        self.compressor = V4Compressor(config, rate, self.dim, overlap=True)

    def forward(self, hidden_states: torch.Tensor, q_latent: torch.Tensor, rope: tuple,
                position_ids: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[batch, queries, entries] bool: the entries each query keeps (``visible``: those it may see)."""
        bsz, positions, _ = hidden_states.shape
        entries = self.compressor(hidden_states, rope)
        if entries.shape[1] <= self.index_topk:
            return visible
        cos, sin = v4_cos_sin(*rope, position_ids.expand(bsz, -1), hidden_states.dtype)
        query = self.wq_b(q_latent).view(bsz, positions, -1, self.dim).transpose(1, 2)
        query = v4_rotate(query, cos, sin).transpose(1, 2)  # [batch, positions, heads, dim]
        dots = torch.matmul(query.float(), entries.transpose(-1, -2).float().unsqueeze(1))
        dots = F.relu(dots) * self.dim ** -0.5
        weights = self.weights_proj(hidden_states).float() * self.heads ** -0.5
        scores = (dots * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~visible, float("-inf"))
        return kept_keys(scores, self.index_topk) & visible


class V4Attention(nn.Module):
    """DeepSeek-V4's attention (``attn.*``): q from a latent (``wq_a``, its norm ``q_norm``, ``wq_b``, then each
    head RMS-normed without weight), one key that is also the value (``wkv``, ``norm``), RoPE on the last values of
    each head (interleaved pairs; :func:`v4_rope`: ``main`` on sliding blocks, ``compress`` on the others), a
    window of ``sliding_window`` positions, a learned sink logit per head (``attn_sink``); compressed blocks also
    attend to their compressor's entries (``compressor``: heavily compressed, every one whose window ended at or
    before the query; compressed sparse, the ``index_topk`` its ``indexer`` keeps); the output's rope values
    rotated back to the query's position, then the grouped projection (``wo_a``: ``o_groups`` blocks of heads,
    each to ``o_lora_rank``) and ``wo_b``. transformers 5.x's eager computation, in its order, for a whole row.
    """

    reads_child_weights = True  # its forward reads a child's weight without calling the child (backends.streamed)

    def __init__(self, config, index: int):
        super().__init__()
        self.kind = v4_layer_types(config)[index]
        self.heads, self.head_dim, self.window = config.num_attention_heads, config.head_dim, config.sliding_window
        self.num_heads = self.heads  # petals' server counts the heads of its config.attn_class (this class) modules
        self.groups, self.eps = config.o_groups, config.rms_norm_eps
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = V4RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.norm = V4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.wo_a = nn.Linear(self.heads * self.head_dim // self.groups, self.groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads))
        compressed = self.kind != "sliding_attention"
        # float32, kept out of the module's buffers: a server's .to(bfloat16) leaves the frequencies as they are
        self.rope = v4_rope(config, compressed)
        self.rate = v4_compress_rate(config, self.kind) if compressed else 0
        sparse = self.kind == "compressed_sparse_attention"
        self.compressor = V4Compressor(config, self.rate, self.head_dim, overlap=sparse) if compressed else None
        self.indexer = V4Indexer(config, self.rate) if sparse else None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        bsz, positions, _ = hidden_states.shape
        position_ids = position_ids.expand(bsz, -1)
        cos, sin = v4_cos_sin(*self.rope, position_ids, hidden_states.dtype)
        q_latent = self.q_norm(self.wq_a(hidden_states))
        query = self.wq_b(q_latent).view(bsz, positions, -1, self.head_dim).transpose(1, 2)
        query = v4_rotate(_unweighted_rms(query, self.eps), cos, sin)
        kv = self.norm(self.wkv(hidden_states)).view(bsz, positions, 1, self.head_dim).transpose(1, 2)
        kv = v4_rotate(kv, cos, sin)
        mask = attention_mask.masked_fill(_outside_window(position_ids, positions, self.window),
                                          torch.finfo(attention_mask.dtype).min)
        if self.compressor is not None:
            entries, bias = self._compressed(hidden_states, q_latent, position_ids)
            kv, mask = torch.cat([kv, entries.unsqueeze(1)], dim=2), torch.cat([mask, bias.to(mask.dtype)], dim=-1)
        keys = repeat_kv(kv, self.heads)
        weights = torch.matmul(query, keys.transpose(2, 3)) * self.head_dim ** -0.5 + mask
        sinks = self.attn_sink.reshape(1, -1, 1, 1).expand(bsz, -1, positions, -1).to(weights.dtype)
        logits = torch.cat([weights, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values  # as transformers (its guard for bf16)
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)  # the sink dropped
        output = torch.matmul(probs, keys).transpose(1, 2)  # [batch, positions, heads, head_dim]
        output = v4_rotate(output.transpose(1, 2), cos, -sin).transpose(1, 2)
        return self.wo_b(self._grouped(output.reshape(bsz, positions, self.groups, -1)).flatten(2))

    def _grouped(self, groups: torch.Tensor) -> torch.Tensor:
        """``wo_a`` block-diagonal over the groups ([batch, positions, groups, width] -> [..., groups, o_lora_rank]),
        as transformers 5.x's DeepseekV4GroupedLinear (one batched product).
        """
        width = groups.shape[-1]
        weight = self.wo_a.weight.view(self.groups, -1, width).transpose(1, 2)
        flat = groups.reshape(-1, self.groups, width).transpose(0, 1)
        return torch.bmm(flat, weight).transpose(0, 1).reshape(*groups.shape[:-2], self.groups, -1)

    def _compressed(self, hidden_states: torch.Tensor, q_latent: torch.Tensor, position_ids: torch.Tensor) -> tuple:
        """(the compressor's entries [batch, entries, head_dim], their bias [batch, 1, queries, entries]: 0 where the
        query sees the entry, -inf elsewhere): a query sees an entry whose window ended at or before it, in a
        compressed sparse block only those its indexer keeps.
        """
        entries = self.compressor(hidden_states, self.rope)
        count = entries.shape[1]
        visible = torch.arange(count, device=entries.device)[None, None, :] < (
            (position_ids + 1) // self.rate)[:, :, None]
        if self.indexer is not None and count:
            visible = self.indexer(hidden_states, q_latent, self.rope, position_ids, visible)
        bias = torch.zeros(visible.shape, dtype=entries.dtype, device=entries.device)
        return entries, bias.masked_fill(~visible, float("-inf")).unsqueeze(1)


class V4Expert(nn.Module):
    """A DeepSeek-V4 expert (``w1`` gate, ``w3`` up, ``w2`` down): ``w2(silu(gate) * up)``, the gate clamped above
    and up within +-``swiglu_limit`` (the shared expert too).
    """

    def __init__(self, config):
        super().__init__()
        inner = config.moe_intermediate_size
        self.w1 = nn.Linear(config.hidden_size, inner, bias=False)
        self.w3 = nn.Linear(config.hidden_size, inner, bias=False)
        self.w2 = nn.Linear(inner, config.hidden_size, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class V4Router(nn.Module):
    """DeepSeek-V4's router (``ffn.gate``): scores sqrt(softplus(logits)); the experts chosen by the best scores
    plus ``bias`` (the correction, for the choice alone), or, hash-routed, by ``tid2eid[token id]``; the chosen
    scores renormalised, times ``routed_scaling_factor``.
    """

    def __init__(self, config, hashed: bool):
        super().__init__()
        self.top_k, self.hashed = config.num_experts_per_tok, hashed
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size).normal_(0.0, 0.02))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def __setattr__(self, name: str, value) -> None:
        """``tid2eid`` kept int64 whatever a load gives: transformers 5.x's loader puts the checkpoint's tensor in
        place of the buffer, in its dtype (the release's int32), where the pinned ``load_state_dict`` copies it in.
        """
        if name == "tid2eid" and isinstance(value, torch.Tensor) and value.dtype != torch.long:
            loaded = getattr(value, "_is_hf_initialized", None)  # 5.x's mark of a tensor read, not to initialise
            value = value.long()
            if loaded is not None:
                value._is_hf_initialized = loaded
        super().__setattr__(name, value)

    def forward(self, tokens: torch.Tensor) -> tuple:
        """(chosen experts [tokens, top_k], their weights) of ``tokens`` [tokens, hidden]."""
        logits = _rows(functools.partial(F.linear, weight=self.weight), tokens)
        scores = _whole_steps(lambda x: F.softplus(x).sqrt(), logits)
        if self.hashed:
            chosen = self.tid2eid[_token_ids(tokens.shape[0], tokens.device)].long()
        else:
            chosen = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


def _token_ids(count: int, device) -> torch.Tensor:
    """The flat token ids of the rows being computed (:data:`ROW_TOKEN_IDS`), ``count`` of them."""
    ids = ROW_TOKEN_IDS.get()
    if ids is None or ids.numel() != count:
        found = "none" if ids is None else f"{ids.numel()}"
        raise ValueError(f"a hash-routed block (mlp_layer_types hash_moe) routes each position by its token id; "
                         f"{count} positions, token ids known: {found} (a prompt position has no token id)")
    return ids.reshape(-1).to(device)


class V4MoeMLP(nn.Module):
    """DeepSeek-V4's mixture (``ffn.*``): :class:`V4Router`, ``n_routed_experts`` :class:`V4Expert` summed with
    their weights (in the experts' order), plus the shared expert (``shared_experts``) every token goes through.
    """

    def __init__(self, config, index: int):
        super().__init__()
        self.gate = V4Router(config, v4_mlp_types(config)[index] == "hash_moe")
        self.experts = nn.ModuleList(V4Expert(config) for _ in range(config.n_routed_experts))
        self.shared_experts = V4Expert(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        chosen, weights = self.gate(tokens)
        routed = torch.zeros_like(tokens)
        for expert in torch.unique(chosen).tolist():  # ascending: each token sums its experts in that order
            token, slot = torch.where(chosen == expert)
            routed.index_add_(0, token, (_rows(self.experts[expert], tokens[token]) * weights[token, slot, None])
                              .to(routed.dtype))
        return (routed + _rows(self.shared_experts, tokens)).view(hidden_states.shape)


def hyper_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, config) -> tuple:
    """(post [batch, positions, hc], comb [..., hc, hc], the collapsed input [batch, positions, hidden]) of
    DeepSeek-V4's hyper-connection on ``streams`` [batch, positions, hc, hidden] (transformers 5.x's
    DeepseekV4HyperConnection: a projection of the normed streams, sigmoids for pre and post, a softmax made
    doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn steps for comb).
    """
    bsz, positions, hc, _ = streams.shape
    eps = config.hc_eps
    flat = _unweighted_rms(streams.reshape(bsz, positions, -1).float(), config.rms_norm_eps)
    mixed = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w.view(bsz, positions, hc, hc) * comb_scale + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


class HyperConnectedLayer(nn.Module):
    """DeepSeek-V4's block ``index`` under its release's names: the hidden state between blocks is ``hc_mult``
    streams, [batch, positions, hc_mult x hidden] (flat, as the blocks pass it); the attention (``attn``, after
    ``attn_norm``) and the mixture (``ffn``, after ``ffn_norm``) each read the streams collapsed by their
    hyper-connection (``hc_attn_*``, ``hc_ffn_*``) and add their output to each stream (post) beside the streams
    mixed (comb), transformers 5.x's DeepseekV4DecoderLayer.
    """

    def __init__(self, config, index: int):
        super().__init__()
        self.config, self.index, self.hc = config, index, config.hc_mult
        self.attn_norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = V4Attention(config, index)
        self.ffn_norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = V4MoeMLP(config, index)
        block = fp8_block_size(config)
        if block is not None:  # the release's FP8 + FP4 weights, dequantized as the loader hands them over
            self._register_load_state_dict_pre_hook(_dequantized_on_load(dequantize_v4, block=block))
        width = (2 + self.hc) * self.hc
        for name in ("attn", "ffn"):
            setattr(self, f"hc_{name}_fn", nn.Parameter(torch.zeros(width, self.hc * config.hidden_size)))
            setattr(self, f"hc_{name}_base", nn.Parameter(torch.zeros(width)))
            setattr(self, f"hc_{name}_scale", nn.Parameter(torch.ones(3)))

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[tuple] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs) -> tuple:
        current = layers_return_tensors()
        if current:
            refuse_a_cache(use_cache, kwargs.get("past_key_values"))
        bsz, positions, width = hidden_states.shape
        streams = hidden_states.view(bsz, positions, self.hc, width // self.hc)
        if position_ids is None:
            position_ids = torch.arange(positions, device=hidden_states.device)[None]
        if attention_mask is None:
            attention_mask = torch.full((positions, positions), torch.finfo(hidden_states.dtype).min,
                                        dtype=hidden_states.dtype, device=hidden_states.device).triu(1)[None, None]
        post, comb, collapsed = hyper_weights(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                              self.config)
        output = self.attn(self.attn_norm(collapsed), attention_mask, position_ids)
        streams = self._added(streams, output, post, comb)
        post, comb, collapsed = hyper_weights(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                                              self.config)
        streams = self._added(streams, self.ffn(self.ffn_norm(collapsed)), post, comb)
        hidden_states = streams.reshape(bsz, positions, width)
        if current:  # a layer's output as the installed transformers' model takes it
            return hidden_states
        # the pinned LlamaModel's layer outputs: no attention weights, no cache (a whole row in one pass)
        return (hidden_states,) + (None,) * (bool(output_attentions) + bool(use_cache))

    @staticmethod
    def _added(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                  streams)


class HyperHead(nn.Module):
    """DeepSeek-V4's last collapse of the streams (``hc_head``), before the final norm."""

    def __init__(self, config):
        super().__init__()
        self.hc, self.eps, self.norm_eps = config.hc_mult, config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(self.hc, self.hc * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(self.hc))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = _unweighted_rms(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


class HyperHeadNorm(V4RMSNorm):
    """The backbone's final norm of DeepSeek-V4 (``norm``): the streams [batch, positions, hc x hidden] collapsed by
    ``hc_head`` (the backbone's, held here unregistered), then normed.
    """

    def __init__(self, config, head: HyperHead):
        super().__init__(config.hidden_size, config.rms_norm_eps)
        object.__setattr__(self, "head", head)  # registered on the backbone (model.hc_head.*), not here
        self.hc = config.hc_mult

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        streams = hidden_states.view(*hidden_states.shape[:-1], self.hc, -1)
        return super().forward(self.head(streams))


def expand_streams(hidden_states: torch.Tensor, hc: int) -> torch.Tensor:
    """[batch, positions, hidden] -> the hc_mult streams, each a copy, flat [batch, positions, hc x hidden]."""
    return hidden_states.unsqueeze(2).expand(-1, -1, hc, -1).reshape(*hidden_states.shape[:2], -1)


def _streams_on_entry(backbone, args: tuple, kwargs: dict) -> tuple:
    """The backbone's pre-hook (DeepSeek-V4): its input embeddings as hc_mult streams; called with token ids
    (transformers' own classes' forward), those ids are also the rows' for hash routing (:data:`ROW_TOKEN_IDS`, until
    :func:`_streams_done`).
    """
    config = backbone.config
    input_ids = args[0] if args else kwargs.get("input_ids")
    embeds, token = kwargs.get("inputs_embeds"), None
    if input_ids is not None and embeds is None:
        args, embeds = args[1:], backbone.embed_tokens(input_ids)
        kwargs["input_ids"], token = None, ROW_TOKEN_IDS.set(input_ids)
    backbone.dist_eval_token_ids.append(token)
    if embeds is not None and embeds.shape[-1] == config.hidden_size:
        kwargs["inputs_embeds"] = expand_streams(embeds, config.hc_mult)
    return args, kwargs


def _streams_done(backbone, args: tuple, kwargs: dict, output) -> None:
    """The backbone's forward hook (DeepSeek-V4): the token ids its pre-hook set, reset."""
    token = backbone.dist_eval_token_ids.pop()
    if token is not None:
        ROW_TOKEN_IDS.reset(token)


def build_hyper_connected(backbone, config) -> None:
    """A Llama backbone (no layers yet) as DeepSeek-V4's: its layers, hc_head, final norm, and the streams made on
    entry.
    """
    backbone.layers = nn.ModuleList(HyperConnectedLayer(config, i) for i in range(config.num_hidden_layers))
    backbone.hc_head = HyperHead(config)
    backbone.norm = HyperHeadNorm(config, backbone.hc_head)
    backbone.dist_eval_token_ids = []  # per forward in progress, the ROW_TOKEN_IDS token its pre-hook set (or None)
    backbone.register_forward_pre_hook(_streams_on_entry, with_kwargs=True)
    backbone.register_forward_hook(_streams_done, with_kwargs=True)


class HyperConnectedServerBlock(HyperConnectedLayer):
    """DeepSeek-V4's block on a server dist_eval starts: petals builds it as ``config.block_class(config)`` (the index
    from :data:`SERVER_BLOCK_INDEX`, else :func:`largest_block_index`) and calls it with the streams alone, flat
    [batch, positions, hc_mult x hidden]; the causal mask is the one the local backbone builds (the pinned LlamaModel's,
    as petals' Llama block builds it), so both compute the same bits. A hash-routed block reads the request's token ids
    (:data:`ROW_TOKEN_IDS`, set around the request's blocks by :mod:`dist_eval.swarm.merged_forward`).
    """

    def __init__(self, config, layer_idx: Optional[int] = None):
        index = SERVER_BLOCK_INDEX.get() if layer_idx is None else layer_idx
        super().__init__(config, largest_block_index(config) if index is None else index)

    def forward(self, hidden_states: torch.Tensor, *args, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, layer_past: Optional[tuple] = None,
                use_cache: bool = False, **kwargs) -> tuple:
        if layer_past is not None or use_cache:  # an inference session (petals' generation): a row in one pass here
            raise ValueError("DeepSeek-V4's blocks on dist_eval's servers compute a whole row per forward; an "
                             "inference session (layer_past, use_cache) is not served")
        from transformers.models.llama.modeling_llama import LlamaModel

        bsz, positions = hidden_states.shape[:2]
        ones = torch.ones((bsz, positions), dtype=torch.bool, device=hidden_states.device)
        mask = LlamaModel._prepare_decoder_attention_mask(None, ones, (bsz, positions), hidden_states, 0)
        output = super().forward(hidden_states, attention_mask=mask)
        return output if isinstance(output, tuple) else (output,)  # petals' server takes 4.33's layer outputs


def _streams_to_servers(remote_blocks, args: tuple) -> tuple:
    """The pre-hook of petals' client's remote blocks (DeepSeek-V4): its input embeddings (prompts before them) as
    hc_mult streams, flat, as the local backbone makes them before its first block.
    """
    hidden_states, hc = args[0], remote_blocks.config.hc_mult
    if hidden_states.shape[-1] != remote_blocks.config.hidden_size:
        return args
    return (expand_streams(hidden_states, hc), *args[1:])


def build_hyper_connected_client(backbone, config) -> None:
    """Petals' client backbone (its blocks on the swarm) as DeepSeek-V4's: ``hc_head`` and the final norm that collapses
    the streams (under the local backbone's names), the embeddings expanded into streams before the first server.
    """
    backbone.hc_head = HyperHead(config).requires_grad_(False)  # frozen, as petals' client holds its backbone's
    backbone.norm = HyperHeadNorm(config, backbone.hc_head).requires_grad_(False)
    backbone.layers.register_forward_pre_hook(_streams_to_servers)


V4_SCALES = (".scale", ".weight" + SCALE_SUFFIX)  # DeepSeek-V4's per-tile / per-group scales: the release's name, 5.x's
V4_FP4_GROUP = 32  # the values of an FP4 expert's row that share one scale


def dequantize_v4(tensors: dict, block: tuple, prefix: str = "", where: str = "") -> None:
    """In place: DeepSeek-V4's quantized weights under ``prefix`` (its release: ``<name>.weight`` beside
    ``<name>.scale``, or ``weight_scale_inv``) become float32 ``<name>.weight``, the scales removed: FP8 (e4m3) weights
    times the scale of their ``block`` tile (the last tiles may be partial); FP4 experts (int8, two e2m1 codes a byte,
    the even column in the low nibble) times the scale of their group of 32 values of a row. Scales ue8m0
    (float8_e8m0fnu: a power of two), uint8 (the biased exponent) or float; transformers 5.23's Fp8Dequantize.
    """
    from dist_eval.errors import UsageError

    for key in [k for k in tensors if k.startswith(prefix) and k.endswith(V4_SCALES)]:
        name = key[:key.rindex(".")] + ".weight"
        weight = tensors.get(name)
        if weight is None or weight.dim() != 2 or weight.dtype not in (torch.int8, torch.float8_e4m3fn):
            continue  # not a quantized weight's scale (none in DeepSeek-V4's blocks)
        scale = tensors.pop(key)
        scale = torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32) - 127) if scale.dtype == torch.uint8 else (
            scale.float())
        if weight.dtype == torch.int8:  # FP4 experts: a scale per 32 values of a row
            table = torch.tensor(FP4_VALUES, dtype=torch.float32)
            codes = weight.view(torch.uint8).long()
            values, tile = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1).flatten(-2), (1, V4_FP4_GROUP)
        else:
            values, tile = weight.to(torch.float32), block
        rows, cols = values.shape
        needed = (-(-rows // tile[0]), -(-cols // tile[1]))
        if tuple(scale.shape) != needed:
            raise UsageError(f"{key} has shape {tuple(scale.shape)}; {name} {tuple(values.shape)} in tiles of "
                             f"{list(tile)} needs {needed} (weight_block_size in config.json for FP8, groups of "
                             f"{V4_FP4_GROUP} for FP4 experts).", param="model_dir", value=where)
        tensors[name] = values * scale.repeat_interleave(tile[0], 0)[:rows].repeat_interleave(tile[1], 1)[:, :cols]


def refuse_a_cache(use_cache: bool, past_key_values) -> None:
    """Where transformers' layers take its cache object (:func:`layers_return_tensors`),
    dist_eval's own layers keep none: a forward that asks for one (``generate()``, ``use_cache=True``) is refused
    rather than given an empty cache, which the next step would read as no context at all.
    """
    if use_cache or past_key_values is not None:
        raise ValueError("dist_eval's own layers compute a whole row per forward on this transformers and keep no "
                         "cache: pass use_cache=False (generate() is not supported on them)")


class OwnDecoderLayer(LlamaDecoderLayer):
    """Block ``layer_idx`` of ``--backend local``: these parts, in the pinned Llama layer's order, called as the
    installed transformers calls a layer (:func:`layers_return_tensors`: the model's
    ``position_embeddings`` are not used, these attentions compute their own RoPE; no cache is kept there,
    :func:`refuse_a_cache`; the hidden states alone are returned).
    """

    def __init__(self, config, layer_idx: int):
        nn.Module.__init__(self)
        build_layer_parts(self, config, layer_idx)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[tuple] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs):
        current = layers_return_tensors()
        if current:
            refuse_a_cache(use_cache, kwargs.get("past_key_values"))
            past_key_value, output_attentions = None, False
        attended, weights, present = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, past_key_value=past_key_value, output_attentions=output_attentions,
            use_cache=use_cache)
        hidden_states = hidden_states + attended
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        if current:
            return hidden_states
        return (hidden_states, *((weights,) if output_attentions else ()), *((present,) if use_cache else ()))


def own_layers_init(base: type):
    """An ``__init__`` for a subclass of the pinned ``base`` (a Llama model class) whose
    backbone's layers are :class:`OwnDecoderLayer`: ``base``'s own with no layers (as petals'
    ``DistributedLlamaModel`` builds its own), then the layers, then transformers' post-init.
    """

    def __init__(self, config, *args, **kwargs):
        if layers_return_tensors():  # these attentions add the mask: its additive 4-D form, which sdpa's may leave out
            config._attn_implementation = "eager"
            config.use_cache = False  # no cache is kept (refuse_a_cache): none by default
        count, config.num_hidden_layers = config.num_hidden_layers, 0
        try:
            base.__init__(self, config, *args, **kwargs)
        finally:
            config.num_hidden_layers = count
        if getattr(config, "hyper_connections", False):  # DeepSeek-V4: streams between blocks
            build_hyper_connected(self.base_model, config)
            self.post_init()
            return
        self.base_model.layers = nn.ModuleList(OwnDecoderLayer(config, i) for i in range(count))
        norm = own_final_norm(config)
        if norm is not None:
            self.base_model.norm = norm
        self.post_init()

    __init__.__qualname__ = f"{base.__name__}.__init__ (dist_eval's layers)"
    return __init__


_petals_block_class = None


def petals_block_class() -> type:
    """The block class of petals' server for these families: petals' Llama block (its
    forward, its cache layout) with these parts; built with its index (``layer_idx``, else
    :data:`SERVER_BLOCK_INDEX`, else :func:`largest_block_index`).
    """
    global _petals_block_class
    if _petals_block_class is None:
        from petals.models.llama.block import WrappedLlamaBlock

        class OwnPetalsBlock(WrappedLlamaBlock):
            def __init__(self, config, layer_idx: Optional[int] = None):
                nn.Module.__init__(self)
                index = SERVER_BLOCK_INDEX.get() if layer_idx is None else layer_idx
                build_layer_parts(self, config, largest_block_index(config) if index is None else index)
                self.pre_attn_graph = self.post_attn_graph = None  # petals' CUDA graphs, made on first use

        OwnPetalsBlock.__qualname__ = OwnPetalsBlock.__name__  # found by name in this module (pickle)
        globals()["OwnPetalsBlock"] = _petals_block_class = OwnPetalsBlock
    return _petals_block_class
