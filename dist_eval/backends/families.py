"""What differs between model families, in one table: the only place that names one.

A family is chosen by config.json's ``model_type`` (:func:`family_of`). Everything else
in dist_eval reaches a model's parts through a :class:`Family`: its classes by name, its
parts by attribute path from the sequence classifier (``get(classifier, family.blocks)``).

Paths are from the ``*ForSequenceClassification`` object, the same in transformers'
class (the local backend) and in petals' ``Distributed*`` class (the petals backend). The
``*ForCausalLM`` classes (zero-shot scoring with label words, :mod:`dist_eval.backends.zeroshot`)
have the same backbone, embeddings and blocks paths, and the language-model head at ``lm_head``:

================  ============================  ================================
field             llama                         bloom / falcon
================  ============================  ================================
petals_class      DistributedLlamaFor...        DistributedBloomFor... / DistributedFalconFor...
local_class       LlamaForSequenceClassification BloomFor... / FalconForSequenceClassification
petals_lm_class   DistributedLlamaForCausalLM   DistributedBloomForCausalLM / DistributedFalconForCausalLM
local_lm_class    LlamaForCausalLM              BloomForCausalLM / FalconForCausalLM
lm_head           lm_head                       lm_head (tied to the embeddings by default)
backbone          model                         transformer
embeddings        model.embed_tokens            transformer.word_embeddings
blocks            model.layers                  transformer.h
prompts           model.prompt_embeddings       transformer.prompt_embeddings
deep_prompts      model.intermediate_prompt_... transformer.intermediate_prompt_embeddings
checkpoint_prefix "model."                      "transformer."
last_token        first_pad                     non_pad_count
embeds_on_server  True                          False / True
server_blocks     model.layers                  h / transformer.h
frozen            embed_tokens layers norm      word_embeddings[_layernorm] h ln_f
key_signature     (keys only this family has, to name the family of a foreign checkpoint key)
small_config      -                             - / new_decoder_architecture, num_kv_heads=2
unsupported       -                             - / the old multi-query layout (falcon-7b)
================  ============================  ================================

``server_blocks`` is where petals 2.2.0's server looks for block ``i``'s tensors
(``<server_blocks>.<i>.``, its ``Distributed*Config.block_prefix``): bigscience's BLOOM
hub checkpoints are ``BloomModel`` saves, without the ``transformer.`` prefix.
:mod:`dist_eval.backends.petals_folder` converts a folder in another layout.

``embeds_on_server``: whether a server dist_eval starts may look a forward's token ids up
itself (:mod:`dist_eval.backends.petals.wire`): true where petals' client builds a forward's
input by a table lookup and a concatenation with the prompts, nothing else, so a server
doing it gets the same bits. BLOOM then normalises the embeddings (arithmetic: it stays on
the client, which sends hidden states).

BLOOM also normalises the embeddings (``transformer.word_embeddings_layernorm``) inside
its backbone, after the prompts are prepended, in petals and in transformers alike; so
the local backend, which calls the backbone with ``inputs_embeds``, needs no field for it.

transformers' Falcon fills its rotary cache on first use without a lock: two threads in
its forward at once can read ``cos_cached=None``. The local backend therefore runs one
forward at a time (``--in-flight`` overlaps nothing there; results are unchanged).
"""
from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Dict, Optional

from dist_eval.errors import UsageError

if TYPE_CHECKING:
    import torch


def dynamic_rope_limit(config) -> int:
    """``max_position_embeddings`` where config.json's RoPE scaling is ``dynamic`` (either generation's form, a
    per-layer-type ``rope_parameters`` too), else 0: the rows a dynamic table computes alike whatever came before.
    """
    found = [getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)]
    found += [v for f in found if isinstance(f, dict) for v in f.values() if isinstance(v, dict)]
    dynamic = any(isinstance(f, dict) and f.get("rope_type", f.get("type")) == "dynamic" for f in found)
    return int(getattr(config, "max_position_embeddings", 0) or 0) if dynamic else 0


@dataclass(frozen=True)
class Family:
    """One model family: class names and attribute paths (dotted, from the sequence classifier)."""

    model_type: str  # config.json "model_type"
    petals_class: str  # class in the ``petals`` package: blocks on the swarm, the rest here
    local_class: str  # class in ``transformers``: the whole model in-process
    petals_lm_class: str  # petals' causal-LM class (zero-shot): blocks on the swarm, LM head here
    local_lm_class: str  # transformers' causal-LM class (zero-shot), in-process
    backbone: str  # the base model; called with ``inputs_embeds`` it returns the final (normed) hidden states
    embeddings: str  # the token embeddings (nn.Embedding)
    blocks: str  # the stack of transformer blocks (petals: the RemoteSequential over the swarm)
    prompts: str  # petals' prompt embeddings [pre_seq_len, hidden] (ptune, deep_ptune)
    deep_prompts: str  # petals' per-block prompts [pre_seq_len, layers * hidden] (deep_ptune)
    checkpoint_prefix: str  # prefix of the backbone's keys in petals' trainable state dict
    last_token: str  # which position the head reads: "first_pad" or "non_pad_count" (see last_token_index)
    server_blocks: str  # key prefix of the blocks' tensors that petals' server reads
    frozen: tuple  # first names (under the backbone) of the base model's own tensors
    # the first server may look token ids up itself: the input is a lookup + concatenation (backends.petals.wire)
    embeds_on_server: bool = False
    # a regex matching key names (with or without the prefix) that only this family's models have
    key_signature: str = ""
    head: str = "score"  # the classifier head (nn.Linear, no bias)
    lm_head: str = "lm_head"  # the causal LM's head (vocabulary logits), from the *ForCausalLM object
    # the causal LM's head as the family's releases save it where not under ``lm_head`` (DeepSeek-V4's ``head``, which
    # transformers 5.x saves too): read from there into ``lm_head`` when the folder has no ``lm_head.weight``
    # (backends.zeroshot.read_saved_lm_head; the pinned loader knows only its own name)
    saved_lm_head: str = ""
    # config settings a small model of this family needs to be one petals serves (the demo's)
    small_config: tuple = ()
    # settings of config.json dist_eval does not compute: ((attribute, value or a test of the value), ...), why
    unsupported: tuple = ()
    # transformers' fast tokenizer classes of the family whose own _batch_encode_plus only refuses
    # pre-split words before calling the base class's: their Rust backend gives the call's ids
    # (data/tokenize.py calls it directly; a class overriding nothing needs no entry)
    tokenizers_calling_the_base: tuple = ()
    # "module:Name" of transformers' config and attention classes that dist_eval's block options
    # extend (backends.blocks); the families built on this one get them too
    config_class: str = ""
    attention_class: str = ""
    # a family newer than the pinned transformers: the family whose classes and block it runs
    # (its own classes subclass those, with this model_type), with these config options (class
    # attributes of its config classes: also the defaults of a key config.json leaves out);
    # ``own_layers``: the blocks are dist_eval's own layers (backends.layers); ``mixture_of_experts``
    # (the router, "softmax", "sigmoid", "mixtral" or "llama4"): with experts where config.json's
    # num_experts, mlp_only_layers and decoder_sparse_step say (softmax), or n_routed_experts and
    # first_k_dense_replace (sigmoid), or moe_layers / interleave_moe_layer_step (llama4); Mixtral's in
    # every block; ``latent_attention`` (DeepSeek-V3), ``llama4_attention``: those attentions;
    # ``sparse_attention`` (GLM-5, DeepSeek-V3.2): the latent attention with DeepSeek Sparse Attention's indexer;
    # ``hyper_connections`` (DeepSeek-V4): its own blocks, streams between them (backends.layers.HyperConnectedLayer)
    built_on: str = ""
    block_options: tuple = ()
    # set where the family's quantized folders (config.json's quantization_config) were computed otherwise by an
    # earlier dist_eval: named in the row store's key of such a folder (its rows stored before are not served)
    quantized_revision: str = ""
    # other model_type names config.json gives the family's models, read as ``model_type`` (backends.config_json): a
    # vision-language release's text model saved alone (transformers 5.x's *ForCausalLM of the release, which the
    # usual trainers save: config.json flat, the tensors under the release's names or under model.), the same blocks
    model_type_aliases: tuple = ()
    # transformers 5.x's defaults of the family's own config class where they differ from those of the class built
    # here (Llama's), for fields the blocks read: ((field, value), ...), filled into a config.json that leaves the
    # field out (backends.config_json), as transformers fills it; ``rope_scaling``: the RoPE settings of a file that
    # has neither rope_scaling nor rope_parameters (or has them null)
    config_defaults: tuple = ()
    # config.json's keys of a sliding attention window: (the window, the switch that turns it on,
    # "" when the window alone says it[, the first block the switch makes slide: Qwen2's and Qwen3's
    # max_window_layers]); rows longer than an active window are refused
    sliding_window: tuple = ()
    # config.json's fields transformers 5.x saves under another name: ((5.x name, the name read here), ...)
    # (backends.config_json reads either)
    config_renames: tuple = ()
    # the attention kinds of config.json's layer_types the blocks compute beyond full attention (a sliding
    # window or a chunk: the rows longer than it are refused; GLM-5's indexed attention, the sparse attention);
    # another kind is refused (backends.config_json)
    layer_types: tuple = ()
    # "module:Name" of petals' server attention whose rotary table ignores config.json's rope_theta (its base
    # is always 10000) and has no rope_scaling: dist_eval's servers rebuild it at rope_theta
    # (backends.blocks), a rope_scaling is refused, and so are petals' own servers for another rope_theta
    server_rotary_attention: str = ""
    # the attention implementation transformers' local classes are built with where a transformers offers a choice
    # (>= 4.36; the pinned 4.33 has one): the one whose arithmetic the server block repeats, so that --backend local
    # equals the swarm bit for bit (5.x's default, "sdpa", rounds otherwise): petals' llama block
    # divides q k^T by sqrt(head_dim) (backends.layers.DIVIDED_ATTENTION), its bloom block multiplies and softmaxes as
    # "eager" does, its falcon block calls torch's scaled_dot_product_attention ("sdpa"); dist_eval's own layers
    # compute their attention themselves
    local_attention: str = "eager"
    # what of petals 2.2's server code of this family needs a bridge on transformers 5.x (the bodies, one per kind,
    # in backends.petals.shims: SERVER_BRIDGES): ((kind, "module:Name" it replaces on, the kind's other class), ...)
    server_bridges: tuple = ()
    # a vision-language release (Qwen3.5): the key prefix of its text model's tensors, read as checkpoint_prefix
    # (config.json's text_config is the text model's config: backends.config_json), and the prefixes of the
    # tensors beside it that are never read (the vision tower, a multi-token-prediction layer)
    text_prefix: str = ""
    skipped_prefixes: tuple = ()
    # other prefixes of the text model's tensors there, each read as another ((as saved, as read), ...): Kimi
    # K2.5's head, language_model.lm_head. beside its text model's language_model.model.
    text_renames: tuple = ()
    # a release's own tensor names, in a folder whose keys have no checkpoint_prefix (DeepSeek-V4's: embed.weight,
    # layers.<i>., hc_head_fn, ...): ((regex, replacement), ...) each applied (re.sub) to every key, read under the
    # names that come out (then prefixed, in the converted copy: backends.petals_folder); its saved_lm_head stays a
    # head, its skipped_prefixes (a multi-token-prediction layer) are never read
    release_renames: tuple = ()
    # keys of config.json's rope_parameters that change nothing on text rows (MRoPE's sections: a text
    # position is the same on each of its axes, so every section rotates by it): read and set aside
    inert_rope_keys: tuple = ()
    # config.json's rotary_dim (MiniMax-M2's release) read as partial_rotary_factor (rotary_dim / head_dim) where
    # the config gives no partial_rotary_factor, as transformers 5.x's MiniMaxM2Config does
    partial_from_rotary_dim: bool = False
    # config.json's rope_parameters keyed by RoPE kind, not by layer type (DeepSeek-V4's main and compress):
    # read apart (backends.config_json), the first kind's base as rope_theta, the second's as compress_rope_theta
    rope_labels: tuple = ()

    def computation_revision(self, config=None) -> dict:
        """What dist_eval computes for this family's model of ``config`` otherwise than it once did, for the row
        store's key (the model's identity): rows stored before are not served for it. {} for most. Sigmoid routers:
        an expert outside the kept groups is never chosen (-inf, as transformers 5.x), where 4.x's rule (0) chose one
        when the kept groups' corrected scores were below 0. Quantized folders (config.json's quantization_config)
        of a family with a ``quantized_revision``: that revision.
        """
        revision = {}
        if dict(self.block_options).get("mixture_of_experts") == "sigmoid":
            revision["router_groups_left_out"] = "-inf"
        if self.quantized_revision and getattr(config, "quantization_config", None):
            revision["quantized_weights"] = self.quantized_revision
        return revision

    @property
    def hyper_connected(self) -> bool:
        """Whether its blocks pass hc_mult streams (the block option ``hyper_connections``: DeepSeek-V4)."""
        return bool(dict(self.block_options).get("hyper_connections"))

    @property
    def block_name(self) -> str:
        """The block stack's name under the backbone (``layers``, ``h``)."""
        return self.blocks[len(self.checkpoint_prefix):]

    @property
    def lm_head_weights(self) -> tuple:
        """The causal LM head's weight names a classifier of this family does not read (every causal LM save has
        them, a release's under its own name: ``saved_lm_head``): unread without a word
        (backends.compat.heads_read_after).
        """
        names = (self.lm_head, self.saved_lm_head) if self.lm_head else ()
        return tuple(dict.fromkeys(f"{name}.weight" for name in names if name))

    @property
    def served_embeddings_key(self) -> str:
        """The token embeddings' key in the folder a server reads (the ``server_blocks`` layout)."""
        prefixed = self.server_blocks.startswith(self.checkpoint_prefix)
        return (self.embeddings if prefixed else self.embeddings[len(self.checkpoint_prefix):]) + ".weight"

    def unsupported_reason(self, config) -> str:
        """Why dist_eval cannot compute this config of the family ('' when it can)."""
        for settings, why in self.unsupported:  # a setting's value, or a test of the value found (callable)
            found = {name: getattr(config, name, None) for name, _ in settings}
            if all(wanted(found[name]) if callable(wanted) else found[name] == wanted for name, wanted in settings):
                shown = ", ".join(f"{name}={value}" for name, value in found.items())
                return f"{why} ({shown} in config.json)"
        if self.hyper_connected:  # DeepSeek-V4's own checks, its release's weights too
            return _hyper_connected_refusal(config, dict(self.block_options))
        if _reads_mxfp4(config, dict(self.block_options)):  # gpt-oss's MXFP4 experts, dequantized on load
            return _block_refusal(config, dict(self.block_options))
        why = _quantization_refusal(getattr(config, "quantization_config", None),
                                    bool(dict(self.block_options).get("own_layers")))
        if why:
            return why
        kind = rope_type(getattr(config, "rope_scaling", None))
        if self.server_rotary_attention and kind not in (None, "default"):
            return (f"rope_scaling of rope_type {kind!r} in config.json is not computed here (this family's server "
                    "block has no RoPE scaling)")
        if self.attention_class or self.built_on:  # the block of backends.blocks
            return _block_refusal(config, dict(self.block_options))
        return ""

    def prompts_refusal(self, config, tuning_mode: Optional[str]) -> str:
        """Why this config cannot compute ``tuning_mode``'s prompts ('' when it can): DeepSeek-V4's hash-routed
        blocks route each position by its token id, which a prompt position has not; its blocks pass hc_mult
        streams, to which a deep prompt of one hidden state's width does not add.
        """
        if not tuning_mode or not self.hyper_connected:
            return ""
        if tuning_mode == "deep_ptune":
            return (f"deep_ptune on {self.model_type}: its blocks pass hc_mult ({config.hc_mult}) streams of "
                    "hidden_size, to which a deep prompt of hidden_size does not add; use ptune or no prompts")
        hashed = [i for i, kind in enumerate(v4_mlp_types(config)) if kind == "hash_moe"]
        if hashed:
            return (f"ptune on {self.model_type}: blocks {hashed} route each position by its token id "
                    "(mlp_layer_types hash_moe, tid2eid), and a prompt position has no token; use no prompts "
                    "(--head alone)")
        return ""

    def token_routed_blocks(self, config) -> frozenset:
        """The blocks that choose a position's experts by its token id (DeepSeek-V4's mlp_layer_types ``hash_moe``):
        their servers are sent the rows' token ids with each forward (backends.petals.wire).
        """
        if not self.hyper_connected:
            return frozenset()
        return frozenset(i for i, kind in enumerate(v4_mlp_types(config)) if kind == "hash_moe")

    @property
    def stock_servers_lack(self) -> str:
        """What petals' own servers cannot compute of this family beyond the block options ('' when nothing more):
        DeepSeek-V4's blocks, which petals 2.2 has no class for.
        """
        if not self.hyper_connected:
            return ""
        return (f"petals has no {self.model_type} block: hc_mult streams between blocks, hash routing by the rows' "
                "token ids")

    def attention_window(self, config) -> int:
        """The positions a row may span (0: any): the sliding attention window of this config (0: none, or not on);
        with blocks that reuse an earlier block's choice of keys (GLM-5's ``indexer_types`` ``shared``),
        ``index_topk``; with ``dynamic`` RoPE scaling, ``max_position_embeddings`` at most (:func:`dynamic_rope_limit`).
        """
        window, dynamic = self._window(config), dynamic_rope_limit(config)
        return min(window, dynamic) if window and dynamic else window or dynamic

    def _window(self, config) -> int:
        if self._shares_choices(config):
            return int(config.index_topk)
        if not self.sliding_window:
            return 0
        window_key, switch, *first = self.sliding_window
        window = getattr(config, window_key, None)
        on = getattr(config, switch, False) and _slides_somewhere(config, *first) if switch else True
        window = int(window) if window and on else 0
        floor = getattr(config, "floor_scale", 0) if getattr(config, "attn_temperature_tuning", False) else 0
        if floor:  # Llama 4's temperature tuning scales q from position floor_scale - 1 on
            window = min(window, floor - 1) if window else floor - 1
        return window

    def attention_limit(self, config) -> str:
        """What :meth:`attention_window` is, as the refusal of a longer row names it."""
        dynamic = dynamic_rope_limit(config)
        if dynamic and self.attention_window(config) == dynamic:
            return ("max_position_embeddings under dynamic RoPE scaling (past it a row's rotary frequencies are "
                    "those of the longest row evaluated before it, as in transformers and petals' servers: other rows "
                    "on each rank)")
        if self._shares_choices(config):
            return ("sparse attention's index_topk (blocks that indexer_types marks 'shared' reuse an earlier "
                    "block's choice of keys, which dist_eval's blocks do not pass on)")
        return "sliding attention window"

    def _shares_choices(self, config) -> bool:
        shared = bool(dict(self.block_options).get("shared_indexers"))
        return shared and "shared" in indexer_types(config, shared)

    def get(self, module, path: str):
        """The attribute at the dotted ``path`` of ``module`` (a field of this family)."""
        return operator.attrgetter(path)(module)

    def final_hidden(self, classifier, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """The hidden states after the last block and the final norm, for ``inputs_embeds``."""
        return self.get(classifier, self.backbone)(inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state

    def last_token_index(self, input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
        """Per row, the position the head reads, as transformers computes it for this family.

        ``first_pad`` (Llama): the token before the first pad, or the last one when there
        is no pad; ``non_pad_count`` (BLOOM, Falcon): the number of non-pad tokens - 1.
        They agree on right-padded rows without a pad inside the text (dist_eval refuses those).
        """
        import torch

        if self.last_token == "first_pad":
            return (torch.eq(input_ids, pad_token_id).long().argmax(-1) - 1) % input_ids.shape[1]
        return torch.ne(input_ids, pad_token_id).sum(-1) - 1


# rope_scaling types the block computes (backends.blocks): the pinned transformers' own, and llama3
SERVED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# those of dist_eval's own grouped-query attention (backends.layers.QkNormAttention and its gated kind, whose table,
# backends.rope.RotaryTable, computes yarn too)
OWN_LAYERS_ROPE_TYPES = (*SERVED_ROPE_TYPES, "yarn")
# those of the latent attention (backends.layers.LatentAttention, DeepSeek-V3)
LATENT_ROPE_TYPES = ("default", "yarn")
LLAMA4_ROPE_TYPES = ("default", "llama3")  # Llama 4's (backends.layers.ChunkedAttention)
# families seen in configs that no block here computes, and why (the rest: "not a family dist_eval knows")
NOT_COMPUTED = {
    "qwen2_moe": "mixture-of-experts blocks with a shared expert",
    "gemma": "scaled embeddings and GeGLU blocks", "gemma2": "soft-capped, alternating sliding attention",
    "gemma3": "soft-capped, alternating sliding attention", "phi3": "fused projections and longrope",
    "glm5_next": "linear-attention layers beside full attention",
    "llama4": ("multimodal layout (a vision tower, the text model under language_model.: save that text model "
               "alone, Llama4ForConditionalGeneration's .language_model.save_pretrained(DIR), model_type "
               "llama4_text, which works)"),
}


def _slides_somewhere(config, first_key: str = "") -> bool:
    """Whether a config whose window is switched on (Qwen's ``use_sliding_window``) has a block that slides: its
    ``layer_types`` say so; without them, the blocks from ``first_key`` on (Qwen2's and Qwen3's
    ``max_window_layers``: transformers' rule, 4.57's and 5.x's), none where it is the number of blocks or more;
    every block where the family has no such key (Qwen3-MoE).
    """
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        return "sliding_attention" in types
    first, blocks = getattr(config, first_key, None) if first_key else None, getattr(config, "num_hidden_layers", None)
    return not (isinstance(first, int) and isinstance(blocks, int) and first >= blocks)


def indexer_types(config, shared: bool) -> list:
    """Per block of a sparse-attention config (a transformers config or config.json's dict), ``full`` (the block
    has its own indexer) or ``shared`` (it reuses the choice of keys of the full block before it), as transformers
    5.x's GlmMoeDsaConfig derives it: config.json's ``indexer_types``, else ``index_topk_pattern`` (``F`` and
    ``S``), else ``full`` every ``index_topk_freq``-th block from ``index_skip_topk_offset`` on (every block when
    config.json says neither, GLM-5's). Only a family with the block option ``shared_indexers`` reads these keys
    (``shared``); another's blocks are all full (DeepSeek-V3.2's).
    """
    read = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    if not shared:
        return ["full"] * read("num_hidden_layers")
    if read("indexer_types") is not None:
        return list(read("indexer_types"))
    pattern = read("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(read("index_topk_freq", 1), 1), read("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(read("num_hidden_layers"))]


V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}  # transformers 5.x's
_V4_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def v4_layer_types(config) -> list:
    """Each block's attention of a DeepSeek-V4 config, as transformers 5.x's DeepseekV4Config derives it:
    config.json's ``layer_types``, else its per-block ``compress_ratios`` (0, 4, 128), else two heavily compressed
    blocks then compressed sparse and heavily compressed ones in turn.
    """
    count = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    ratios = getattr(config, "compress_ratios", None)
    if types is None and ratios is not None:
        types = [_V4_RATIO_TYPES.get(ratio, f"compress ratio {ratio}") for ratio in ratios]
    if types is None:
        types = ["heavily_compressed_attention"] * min(count, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(count - 2, 0))]
    return list(types)[:count]


def v4_mlp_types(config) -> list:
    """Each block's mixture of a DeepSeek-V4 config (``hash_moe``: routed by token id; ``moe``): config.json's
    ``mlp_layer_types``, else the first ``num_hash_layers`` (3) hash-routed (transformers 5.x's rule).
    """
    count = config.num_hidden_layers
    types = getattr(config, "mlp_layer_types", None)
    if types is None:
        hashed = getattr(config, "num_hash_layers", None)
        hashed = 3 if hashed is None else hashed
        types = ["hash_moe"] * min(count, hashed) + ["moe"] * max(0, count - hashed)
    return list(types)[:count]


def v4_compress_rate(config, kind: str) -> int:
    """Positions per compressed entry of attention ``kind``: config.json's ``compress_rates``, else its
    ``compress_rate_csa`` / ``compress_rate_hca``, else transformers 5.x's defaults (4, 128).
    """
    rates = dict(V4_COMPRESS_RATES)
    rates.update(getattr(config, "compress_rates", None) or {})
    legacy = {"compressed_sparse_attention": "compress_rate_csa", "heavily_compressed_attention": "compress_rate_hca"}
    if getattr(config, legacy[kind], None) is not None:
        rates[kind] = getattr(config, legacy[kind])
    return int(rates[kind])


def v4_rope_dim(config) -> int:
    """The values of each head that rotate (the last ones): ``head_dim`` times ``partial_rotary_factor``, else
    config.json's ``qk_rope_head_dim``, else 64 / 512 of it (transformers 5.x's rule).
    """
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None:
        legacy = getattr(config, "qk_rope_head_dim", None)
        factor = legacy / config.head_dim if legacy is not None else 64 / 512
    return int(config.head_dim * factor)


def rope_type(rope_scaling) -> Optional[str]:
    """The type of config.json's ``rope_scaling`` in either format (``rope_type`` since
    transformers 4.43, ``type`` before); None without one.
    """
    if not isinstance(rope_scaling, dict):
        return None
    return rope_scaling.get("rope_type", rope_scaling.get("type"))


def rope_types_computed(options: dict) -> tuple:
    """The ``rope_scaling`` types the Llama-shaped block of a family with these block ``options`` computes."""
    if any(options.get(key) for key in ("latent_attention", "sink_attention", "hyper_connections")):
        return LATENT_ROPE_TYPES  # the latent attention's, gpt-oss's, DeepSeek-V4's
    if options.get("llama4_attention"):
        return LLAMA4_ROPE_TYPES
    return OWN_LAYERS_ROPE_TYPES if options.get("own_layers") else SERVED_ROPE_TYPES


def _block_refusal(config, options: dict) -> str:
    """What in a config of a Llama-shaped block the block does not compute ('' when nothing).
    ``options``: the family's block options; with ``own_layers`` the block's attention is
    dist_eval's own (backends.layers.QkNormAttention), which computes any head_dim, biases
    (``attention_bias``) and a partial rotary embedding (``partial_rotary_factor``).
    """
    kind = rope_type(getattr(config, "rope_scaling", None))
    latent = bool(options.get("latent_attention"))
    served = rope_types_computed(options)
    if kind is not None and kind not in served:
        return f"rope_scaling of rope_type {kind!r} in config.json is not computed here (computed: {', '.join(served)})"
    if latent:
        heads, kv_heads = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", None)
        if kv_heads not in (None, heads):
            return (f"num_key_value_heads {kv_heads} in config.json is not num_attention_heads ({heads}); the "
                    "latent attention gives every head its own key")
        if options.get("sparse_attention"):
            why = _sparse_attention_refusal(config, options)
            if why:
                return why
        elif getattr(config, "index_topk", None):  # DeepSeek V3.2's indexer in a deepseek_v3 config
            return (f"index_topk {config.index_topk} in config.json (DeepSeek V3.2's sparse attention) is not "
                    "computed here (this model_type's latent attention is dense; DeepSeek-V3.2's is deepseek_v32)")
        scoring = getattr(config, "scoring_func", "sigmoid")
        if scoring != "sigmoid":
            return f"scoring_func {scoring!r} in config.json is not computed here (the router's scores: sigmoid)"
    if options.get("gated_delta_net"):
        why = _linear_attention_refusal(config, options)
        if why:
            return why
    own_attention = bool(options.get("own_layers"))
    for key in ("mlp_bias",) if own_attention else ("attention_bias", "mlp_bias"):
        if getattr(config, key, False):
            return f"{key}: true in config.json (biases this block does not have) is not computed here"
    hidden, heads = getattr(config, "hidden_size", 0), getattr(config, "num_attention_heads", 0) or 1
    head_dim = getattr(config, "head_dim", None)
    if head_dim and head_dim * heads != hidden and not own_attention:
        return (f"head_dim {head_dim} in config.json is not hidden_size / num_attention_heads "
                f"({hidden} / {heads}); only that head size is computed here")
    factor = getattr(config, "partial_rotary_factor", 1.0)
    if not 0 < factor <= 1:
        return f"partial_rotary_factor {factor} in config.json is not in (0, 1]; no head rotates that share"
    if options.get("mixture_of_experts"):
        return _experts_refusal(config, options["mixture_of_experts"])
    return ""


def _hyper_connected_refusal(config, options: dict) -> str:
    """What in a DeepSeek-V4 config the blocks do not compute ('' when nothing); a key config.json leaves out has
    the family's default (``options``).
    """
    def read(key):
        return getattr(config, key, options.get(key))

    why = _v4_quantization_refusal(read("quantization_config"))
    if why:
        return why
    kind = rope_type(read("rope_scaling"))
    if kind not in (None, "default", "yarn"):
        return f"rope_scaling of rope_type {kind!r} in config.json is not computed here (computed: default, yarn)"
    if read("scoring_func") != "sqrtsoftplus":
        return f"scoring_func {read('scoring_func')!r} in config.json is not computed here (the router's: sqrtsoftplus)"
    layers = read("num_hidden_layers")
    types, mlp = v4_layer_types(config), v4_mlp_types(config)
    if len(types) != layers or not set(types) <= set(V4_LAYER_TYPES):
        return (f"layer_types {types} in config.json is not one of {', '.join(V4_LAYER_TYPES)} for each of {layers} "
                "blocks")
    if len(mlp) != layers or not set(mlp) <= {"hash_moe", "moe"}:
        return f"mlp_layer_types {mlp} in config.json is not hash_moe or moe for each of the {layers} blocks"
    for key in ("attention_bias", "mlp_bias"):
        if read(key):
            return f"{key}: true in config.json (biases this block does not have) is not computed here"
    if read("hidden_act") != "silu":
        return f"hidden_act {read('hidden_act')!r} in config.json is not computed here (the experts': silu)"
    heads, head_dim, groups = read("num_attention_heads"), read("head_dim"), read("o_groups")
    if not groups or (heads * head_dim) % groups:
        return (f"o_groups {groups} in config.json does not split the {heads} heads of {head_dim} values into equal "
                "groups (the grouped output projection)")
    rope_dim = v4_rope_dim(SimpleNamespace(head_dim=head_dim, partial_rotary_factor=read("partial_rotary_factor"),
                                           qk_rope_head_dim=read("qk_rope_head_dim")))
    if read("index_head_dim") < rope_dim or rope_dim % 2:
        return (f"index_head_dim {read('index_head_dim')} in config.json is below the {rope_dim} values of each head "
                "that rotate, or those are odd")
    experts, chosen = read("n_routed_experts"), read("num_experts_per_tok")
    if not experts or not 0 < chosen <= experts:
        return f"num_experts_per_tok {chosen} in config.json is not between 1 and n_routed_experts ({experts})"
    return ""


def _v4_quantization_refusal(quantization) -> str:
    """Why a DeepSeek-V4 config.json's ``quantization_config`` is not read ('' when it is, or there is none): read is
    the release's, FP8 e4m3 tiles (scales float or ue8m0) with experts in FP8 or FP4 (``expert_dtype``), dequantized
    on load (backends.layers.dequantize_v4).
    """
    if not quantization:
        return ""
    shown = {key: quantization.get(key) for key in ("quant_method", "fmt", "activation_scheme", "scale_fmt",
                                                    "expert_dtype", "weight_block_size")
             if isinstance(quantization, dict) and quantization.get(key) is not None}
    block = shown.get("weight_block_size", [128, 128])
    read = (shown.get("quant_method") == "fp8" and shown.get("fmt", "e4m3") in ("e4m3", "float8_e4m3fn")
            and shown.get("activation_scheme", "dynamic") == "dynamic" and shown.get("scale_fmt", "float") in (
                "float", "ue8m0") and shown.get("expert_dtype", "fp8") in ("fp8", "fp4") and isinstance(block, list)
            and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block))
    return "" if read else (
        f"quantization_config {json.dumps(shown)} in config.json is not read for deepseek_v4 here (read: the "
        "release's FP8 e4m3 tiles, scales float or ue8m0, experts FP8 or FP4, dynamic activations); save the model "
        "dequantized")


def _sparse_attention_refusal(config, options: dict) -> str:
    """What in a config of the latent attention with DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2) the blocks do
    not compute
    ('' when nothing); a key config.json leaves out has the family's default (``options``).
    """
    def read(key):
        return getattr(config, key, options.get(key))

    if read("q_lora_rank") is None:
        return ("q_lora_rank null in config.json: the sparse attention's indexer reads the query latent, which "
                "a q_proj without one does not have")
    if read("rope_interleave") is False:
        return ("rope_interleave false in config.json: transformers' sparse attention always rotates DeepSeek's "
                "interleaved pairs; which layout the weights have is not known")
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        if not isinstance(read(key), int) or read(key) < 1:
            return f"{key} {read(key)} in config.json is not a positive integer"
    if read("index_head_dim") < read("qk_rope_head_dim"):
        return (f"index_head_dim {read('index_head_dim')} in config.json is below qk_rope_head_dim "
                f"{read('qk_rope_head_dim')}, the share of each indexer head that rotates")
    layers = read("num_hidden_layers")
    kinds = indexer_types(config, bool(read("shared_indexers")))
    if len(kinds) != layers or not set(kinds) <= {"full", "shared"} or kinds[0] != "full":
        return (f"indexer_types {kinds} in config.json is not full or shared for each of the {layers} blocks, "
                "the first full")
    mlp = read("mlp_layer_types")
    if mlp is not None and (len(mlp) != layers or not set(mlp) <= {"dense", "sparse"}):
        return f"mlp_layer_types {mlp} in config.json is not dense or sparse for each of the {layers} blocks"
    return ""


def _linear_attention_refusal(config, options: dict) -> str:
    """What in a Gated DeltaNet hybrid's config (Qwen3.5) the blocks do not compute ('' when nothing);
    a key config.json leaves out has the family's default (``options``).
    """
    def read(key):
        return getattr(config, key, options.get(key))

    keys, values = read("linear_num_key_heads"), read("linear_num_value_heads")
    if not keys or not values or values % keys:
        return (f"linear_num_value_heads {values} in config.json is not a multiple of linear_num_key_heads {keys}; "
                "no key head serves a whole group of value heads")
    kernel = read("linear_conv_kernel_dim")
    if not isinstance(kernel, int) or kernel < 1:
        return f"linear_conv_kernel_dim {kernel} in config.json is not 1 or more"
    return ""


def _quantization_refusal(quantization, own_layers: bool = False) -> str:
    """Why config.json's ``quantization_config`` is not read here ('' when it is, or there is none):
    FP8 (e4m3) weights with a scale per tile are (dequantized on load, backends.layers.dequantize_fp8), and,
    in the blocks of dist_eval's own layers (``own_layers``: their load hook), compressed-tensors' INT4
    pack-quantized weights (backends.layers.dequantize_int4).
    """
    if not isinstance(quantization, dict):
        return ""
    method = quantization.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_refusal(quantization, own_layers)
    if method == "fp8" and quantization.get("fmt", "e4m3") in ("e4m3", "float8_e4m3fn") and quantization.get(
            "activation_scheme",
                                                                                          "dynamic") == "dynamic":
        block = quantization.get("weight_block_size") or [128, 128]
        if len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block):
            return ""
        return f"FP8 weight_block_size {block} in config.json is not two tile sizes"
    shown = {"mxfp4": "MXFP4"}.get(method, method)
    return (f"{shown} weights (quantization_config quant_method {method!r} in config.json) are not read here "
            "(read: FP8 e4m3 with a weight_scale_inv per tile, compressed-tensors INT4 pack-quantized, and "
            "unquantized weights)")


def _reads_mxfp4(config, options: dict) -> bool:
    """Whether config.json's quantization_config is MXFP4 (quant_method ``mxfp4``) and the family's blocks read
    it (the block option ``mxfp4_experts``: gpt-oss's experts, backends.layers.dequantize_mxfp4).
    """
    quantization = getattr(config, "quantization_config", None)
    return bool(options.get("mxfp4_experts")) and isinstance(quantization, dict) and (
        quantization.get("quant_method") == "mxfp4")


def _compressed_tensors_refusal(quantization: dict, own_layers: bool) -> str:
    """Why a compressed-tensors ``quantization_config`` is not read ('' when it is): read are weight-only INT4
    ``pack-quantized`` groups, symmetric, a scale per ``group_size`` values of a row (Kimi K2.5's experts).
    """
    groups = quantization.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return "compressed-tensors quantization_config in config.json has no config_groups (the formats of its weights)"
    for name, group in sorted(groups.items()):
        why = _int4_group_refusal(group, quantization.get("format"))
        if why:
            return (f"compressed-tensors {name} ({why}) in config.json is not read here (read: INT4 "
                    "pack-quantized, symmetric, a scale per group of a row, weights only)")
    if not own_layers:
        return ("compressed-tensors INT4 weights in config.json are read only by dist_eval's own layers' load "
                "(backends.layers), not by this family's blocks")
    return ""


def _int4_group_refusal(group, default_format) -> str:
    """What in a compressed-tensors config group is not INT4 pack-quantized symmetric groups ('' when nothing)."""
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        return "no weights scheme"
    form = group.get("format") or default_format
    shown = (f"format {form}, {weights.get('type')} {weights.get('num_bits')}-bit, strategy {weights.get('strategy')}"
             f", symmetric {weights.get('symmetric')}")
    packed = form == "pack-quantized" and weights.get("type") == "int" and weights.get("num_bits") == 4
    grouped = weights.get("strategy") == "group" and isinstance(weights.get("group_size"), int) and (
        weights["group_size"] > 0)
    plain = weights.get("symmetric") is True and not weights.get("actorder") and not weights.get("dynamic")
    activations = group.get("input_activations") or group.get("output_activations")
    return "" if packed and grouped and plain and not activations else shown


def _experts_refusal(config, router) -> str:
    """What in a mixture-of-experts config the block does not compute ('' when nothing).
    ``router``: the family's, "softmax" (num_experts) or "sigmoid" (n_routed_experts, in groups).
    """
    key = {"sigmoid": "n_routed_experts", "mixtral": "num_local_experts", "llama4": "num_local_experts",
           "minimax": "num_local_experts", "gpt_oss": "num_local_experts"}.get(
        router, "num_experts")
    experts, chosen = getattr(config, key, 0) or 0, getattr(config, "num_experts_per_tok", 0)
    if experts and not 0 < chosen <= experts:
        return (f"num_experts_per_tok {chosen} in config.json is not between 1 and {key} ({experts}); "
                "no router chooses that many experts")
    if router == "sigmoid" and experts:
        groups, kept = getattr(config, "n_group", 1), getattr(config, "topk_group", 1)
        if not groups or groups < 1 or experts % groups or experts // groups < 2:
            return (f"n_group {groups} in config.json does not split the {experts} n_routed_experts into equal "
                    "groups of 2 or more (the router scores a group by its two best)")
        if not 1 <= kept <= groups:
            return f"topk_group {kept} in config.json is not between 1 and n_group ({groups})"
    if getattr(config, "decoder_sparse_step", 1) < 1:
        return f"decoder_sparse_step {config.decoder_sparse_step} in config.json is not 1 or more"
    return ""


DEMO_FAMILY = "llama"  # the built-in demo's family, unless --demo-family says another


def class_names(name: str) -> dict:
    """The class fields of a family whose classes are named ``name`` (``Llama``: ``LlamaForCausalLM``, ...)."""
    return dict(petals_class=f"Distributed{name}ForSequenceClassification",
                local_class=f"{name}ForSequenceClassification", petals_lm_class=f"Distributed{name}ForCausalLM",
                local_lm_class=f"{name}ForCausalLM")


# the paths of the families under ``transformer.`` (BLOOM's and Falcon's)
TRANSFORMER_PATHS = dict(backbone="transformer", embeddings="transformer.word_embeddings", blocks="transformer.h",
                         prompts="transformer.prompt_embeddings",
                         deep_prompts="transformer.intermediate_prompt_embeddings", checkpoint_prefix="transformer.",
                         last_token="non_pad_count")

FAMILIES: Dict[str, Family] = {
    "llama": Family(
        model_type="llama",
        **class_names("Llama"),
        backbone="model",
        embeddings="model.embed_tokens",
        blocks="model.layers",
        prompts="model.prompt_embeddings",
        deep_prompts="model.intermediate_prompt_embeddings",
        checkpoint_prefix="model.",
        last_token="first_pad",
        server_blocks="model.layers",
        frozen=("embed_tokens", "layers", "norm"),
        embeds_on_server=True,
        key_signature=r"^(model\.)?(embed_tokens|layers\.\d+|norm)\.",
        config_class="transformers.models.llama.configuration_llama:LlamaConfig",
        attention_class="transformers.models.llama.modeling_llama:LlamaAttention",
        local_attention="divided_by_sqrt_head_dim",
        server_bridges=(("decoder_mask", "transformers.models.llama.modeling_llama:LlamaModel"),
                        ("attention_init", "petals.models.llama.block:OptimizedLlamaAttention",
                         "transformers.models.llama.modeling_llama:LlamaRotaryEmbedding")),
    ),
    "bloom": Family(
        model_type="bloom",
        **class_names("Bloom"),
        **TRANSFORMER_PATHS,
        server_blocks="h",
        frozen=("word_embeddings", "word_embeddings_layernorm", "h", "ln_f"),
        key_signature=r"^(transformer\.)?(word_embeddings_layernorm\.|h\.\d+\.self_attention\.query_key_value\.bias)",
        tokenizers_calling_the_base=("BloomTokenizerFast",),
        server_bridges=(("cache_block", "petals.models.bloom.block:WrappedBloomBlock"),),
    ),
    "falcon": Family(
        model_type="falcon",
        **class_names("Falcon"),
        **TRANSFORMER_PATHS,
        server_blocks="transformer.h",
        frozen=("word_embeddings", "h", "ln_f"),
        embeds_on_server=True,
        key_signature=r"^(transformer\.)?h\.\d+\.(ln_attn|ln_mlp|self_attention\.query_key_value\.weight$)",
        small_config=(("new_decoder_architecture", True), ("num_kv_heads", 2)),  # the falcon-40b layout
        server_rotary_attention="petals.models.falcon.block:OptimizedFalconAttention",
        local_attention="sdpa",
        server_bridges=(("bool_mask", "transformers.models.falcon.modeling_falcon:FalconModel"),),
        # petals' OptimizedFalconAttention reshapes the one shared key/value head of the old
        # multi-query layout (falcon-7b, falcon-rw) as if every head had its own: the server
        # fails every forward. falcon-40b/180b (the new decoder architecture) work.
        unsupported=(
            ((("new_decoder_architecture", False), ("multi_query", True)),
             "petals 2.2.0's Falcon server cannot run the old multi-query layout (falcon-7b style)"),
        ),
    ),
}


def _built_on_llama(model_type: str, name: str, **fields) -> Family:
    """A family newer than the pinned transformers whose block is Llama's with options."""
    llama = FAMILIES["llama"]
    return dataclasses.replace(llama, model_type=model_type, **class_names(name), key_signature="", config_class="",
                               attention_class="", built_on="llama", **fields)


# what dist_eval's own attention would compute from config.json where a family's transformers attention has no such
# part (and reads no such key): refused (Family.unsupported), never computed otherwise than transformers does; each
# key's value of a part it does not have
_UNREAD_PARTS = {"attention_bias": ("biases", False), "use_qk_norm": ("q/k norms", False),
                 "qk_norm_whole": ("q/k norms", False), "partial_rotary_factor": ("partial RoPE", 1.0)}


@dataclasses.dataclass(frozen=True)
class _AsksFor:
    """A test of a config.json value (``Family.unsupported``): given, and not ``neutral``."""

    neutral: object

    def __call__(self, value) -> bool:
        return value is not None and value != self.neutral


def _unread(name: str, *keys: str) -> tuple:
    """``Family.unsupported`` entries refusing each of ``keys`` in config.json where it asks for a part ``name``'s
    attention has not.
    """
    return tuple((((key, _AsksFor(_UNREAD_PARTS[key][1])),),
                  f"{name}'s attention has no {_UNREAD_PARTS[key][0]} (transformers' reads no {key})") for key in keys)


# Mistral: Llama's block (grouped-query attention) in dist_eval's layers (any head_dim: Mistral-Nemo's and Mistral
# Small 3's 128 beside hidden / heads of 160; the same bits as the pinned attention where head_dim is hidden / heads);
# v0.1 attends within a sliding window
FAMILIES["mistral"] = _built_on_llama("mistral", "Mistral", sliding_window=("sliding_window", ""),
                                      block_options=(("own_layers", True), ("use_qk_norm", False)),
                                      # the pinned block read FP8 weights without their scales on the local backend
                                      quantized_revision="dequantized by dist_eval's layers",
                                      unsupported=_unread("Mistral", "attention_bias", "use_qk_norm",
                                                          "qk_norm_whole", "partial_rotary_factor"),
                                      layer_types=("sliding_attention",),
                                      config_defaults=(("sliding_window", 4096), ("max_position_embeddings", 131072)))
# Qwen2 / Qwen2.5: Llama's block with biases on the q, k and v projections (not on o, whatever attention_bias says,
# as transformers'), in dist_eval's layers (any head_dim, yarn; the pinned attention's bits where head_dim is
# hidden / heads); the window use_sliding_window turns on where config.json gives none
QWEN_DEFAULTS = (("sliding_window", 4096), ("max_position_embeddings", 32768))
FAMILIES["qwen2"] = _built_on_llama("qwen2", "Qwen2",
                                    block_options=(("own_layers", True), ("use_qk_norm", False), ("qkv_bias", True)),
                                    # the pinned block read FP8 weights without their scales on the local backend
                                    quantized_revision="dequantized by dist_eval's layers",
                                    unsupported=_unread("Qwen2", "use_qk_norm", "qk_norm_whole",
                                                        "partial_rotary_factor"),
                                    sliding_window=("sliding_window", "use_sliding_window", "max_window_layers"),
                                    layer_types=("sliding_attention",), config_defaults=QWEN_DEFAULTS)
# Qwen3: Llama's block with dist_eval's attention (an RMSNorm over each head's q and k before
# RoPE, head_dim set apart from hidden/heads); the options' values are also the config's defaults
# (transformers' Qwen3Config), for a config.json that leaves a key out
FAMILIES["qwen3"] = _built_on_llama(
    "qwen3", "Qwen3", block_options=(("own_layers", True), ("use_qk_norm", True), ("head_dim", 128)),
    sliding_window=("sliding_window", "use_sliding_window", "max_window_layers"), layer_types=("sliding_attention",),
    config_defaults=QWEN_DEFAULTS)
# Qwen3-MoE: Qwen3's attention; the MLP of a block a mixture of experts (a softmax router choosing
# num_experts_per_tok of num_experts), but the blocks in mlp_only_layers or off decoder_sparse_step
FAMILIES["qwen3_moe"] = _built_on_llama(
    "qwen3_moe", "Qwen3Moe", block_options=(
        ("own_layers", True), ("use_qk_norm", True), ("mixture_of_experts", "softmax"), ("num_experts", 128),
        ("num_experts_per_tok", 8),
        ("moe_intermediate_size", 768), ("norm_topk_prob", False), ("decoder_sparse_step", 1), ("mlp_only_layers", ())),
    sliding_window=("sliding_window", "use_sliding_window"), layer_types=("sliding_attention",),
    config_renames=(("num_local_experts", "num_experts"),),  # transformers 5.x names the expert count so
    config_defaults=QWEN_DEFAULTS)
# GLM-4.5 / 4.6 / 4.7: dist_eval's attention with q/k/v biases (o without), q/k norms only when
# use_qk_norm, RoPE on partial_rotary_factor of each head; the blocks from first_k_dense_replace
# on a mixture of n_routed_experts (a sigmoid router, its choice shifted by e_score_correction_bias,
# in n_group groups) and a shared expert; the options' values are transformers' Glm4MoeConfig defaults
FAMILIES["glm4_moe"] = _built_on_llama(
    "glm4_moe", "Glm4Moe", block_options=(
        ("own_layers", True), ("use_qk_norm", False), ("attention_output_bias", False),
        ("partial_rotary_factor", 0.5), ("mixture_of_experts", "sigmoid"), ("n_routed_experts", 128),
        ("n_shared_experts", 1), ("num_experts_per_tok", 8), ("moe_intermediate_size", 1408),
        ("routed_scaling_factor", 1.0), ("n_group", 1), ("topk_group", 1), ("first_k_dense_replace", 1),
        ("norm_topk_prob", True)), config_defaults=(("rms_norm_eps", 1e-5), ("max_position_embeddings", 131072)))
# Mixtral: Llama's attention (dist_eval's layers: any head_dim, no q/k norm); each block's MLP a mixture
# of num_local_experts experts of intermediate_size (Mixtral's names: block_sparse_moe, w1/w3/w2), a
# softmax router choosing num_experts_per_tok, their weights renormalised; a window as Mistral's
FAMILIES["mixtral"] = _built_on_llama(
    "mixtral", "Mixtral", block_options=(
        ("own_layers", True), ("use_qk_norm", False), ("mixture_of_experts", "mixtral"), ("num_local_experts", 8),
        ("num_experts_per_tok", 2)),
    unsupported=_unread("Mixtral", "attention_bias", "use_qk_norm", "qk_norm_whole", "partial_rotary_factor"),
    sliding_window=("sliding_window", ""), layer_types=("sliding_attention",),
    config_defaults=(("rope_theta", 1e6), ("rms_norm_eps", 1e-5), ("max_position_embeddings", 131072)))

# DeepSeek-V3 / R1 / V3.1: the latent attention (backends.layers.LatentAttention: q and kv latents,
# their norms, RoPE on each head's rope part in DeepSeek's interleaved layout, yarn whose mscale also
# scales the softmax); GLM-4.5's mixture (a sigmoid router with a correction bias, grouped choice,
# routed_scaling_factor, a shared expert) from first_k_dense_replace on; the multi-token-prediction
# layer saved after the last block is not read; FP8 weights dequantized on load. Kimi K2 (kimi_k2)
# is the same block. The options' values are transformers' DeepseekV3Config defaults
DEEPSEEK_V3_OPTIONS = (
    ("own_layers", True), ("latent_attention", True), ("q_lora_rank", 1536), ("kv_lora_rank", 512),
    ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64), ("v_head_dim", 128), ("rope_interleave", True),
    ("mixture_of_experts", "sigmoid"), ("n_routed_experts", 256), ("n_shared_experts", 1),
    ("num_experts_per_tok", 8), ("moe_intermediate_size", 2048), ("routed_scaling_factor", 2.5), ("n_group", 8),
    ("topk_group", 4), ("first_k_dense_replace", 3), ("norm_topk_prob", True))
DEEPSEEK_V3_DEFAULTS = (("max_position_embeddings", 4096),)
FAMILIES["deepseek_v3"] = _built_on_llama("deepseek_v3", "DeepseekV3", block_options=DEEPSEEK_V3_OPTIONS,
                                          config_defaults=DEEPSEEK_V3_DEFAULTS)
FAMILIES["kimi_k2"] = _built_on_llama("kimi_k2", "KimiK2", block_options=DEEPSEEK_V3_OPTIONS,
                                      config_defaults=DEEPSEEK_V3_DEFAULTS)
# Kimi K2.5 / K2.6 (kimi_k25: 1T-A32B), as released: a vision-language checkpoint around a DeepSeek-V3 text model
# (config.json's text_config; tensors under language_model.model., the head language_model.lm_head.; the vision
# tower and its projector never read), its routed experts in compressed-tensors' INT4 pack-quantized groups,
# dequantized on load (backends.layers.dequantize_int4), attention and shared expert in bf16
FAMILIES["kimi_k25"] = _built_on_llama(
    "kimi_k25", "KimiK25", block_options=DEEPSEEK_V3_OPTIONS, config_defaults=DEEPSEEK_V3_DEFAULTS,
    text_prefix="language_model.model.",
    text_renames=(("language_model.lm_head.", "lm_head."),), skipped_prefixes=("vision_tower.", "mm_projector."))
# Llama 4 Scout / Maverick, text (llama4_text: a Llama4ForCausalLM save): dist_eval's layers
# (backends.layers.ChunkedAttention: RoPE in interleaved pairs but on every no_rope_layer_interval-th
# block, a weightless L2 norm of q and k after it; InputScaledMoeMLP: a top-k sigmoid router scaling
# the chosen experts' input, fused expert weights, a shared expert) in the blocks of moe_layers (every
# interleave_moe_layer_step-th), a dense MLP of intermediate_size_mlp in the others; the chunked
# attention and temperature tuning are inert on shorter rows, longer ones refused (attention_window).
# The options' values are transformers' Llama4TextConfig defaults
FAMILIES["llama4_text"] = _built_on_llama(
    "llama4_text", "Llama4Text", block_options=(
        ("own_layers", True), ("llama4_attention", True), ("mixture_of_experts", "llama4"), ("head_dim", 128),
        ("num_local_experts", 16), ("num_experts_per_tok", 1), ("interleave_moe_layer_step", 1),
        ("intermediate_size_mlp", 16384), ("use_qk_norm", True), ("no_rope_layer_interval", 4),
        ("attention_chunk_size", 8192), ("attn_temperature_tuning", True), ("floor_scale", 8192)),
    sliding_window=("attention_chunk_size", ""), layer_types=("chunked_attention",),
    config_defaults=(("rope_theta", 5e5), ("rms_norm_eps", 1e-5), ("max_position_embeddings", 131072)))

# Qwen3.5 / 3.6 dense (qwen3_5), as released: a vision-language checkpoint whose text model is read
# (config.json's text_config, tensors under model.language_model.; the vision tower never read). Its blocks
# are dist_eval's layers (backends.layers): by layer_types (else every full_attention_interval-th full),
# Gated DeltaNet blocks (backends.layers.GatedDeltaNet: a causal depthwise conv, the gated delta rule over
# the whole row, a gated per-head norm) and gated full attention (backends.layers.GatedAttention: a sigmoid
# output gate from a q projection of twice the width, q/k norms, RoPE on partial_rotary_factor of each head;
# MRoPE's sections are inert on text); every norm scales by 1 + weight (backends.layers.OffsetRMSNorm).
# The options' values are transformers 5.x's Qwen3_5TextConfig defaults
QWEN3_5_OPTIONS = (
    ("own_layers", True), ("gated_delta_net", True), ("use_qk_norm", True), ("head_dim", 256),
    ("partial_rotary_factor", 0.25), ("linear_conv_kernel_dim", 4), ("linear_key_head_dim", 128),
    ("linear_value_head_dim", 128), ("linear_num_key_heads", 16), ("linear_num_value_heads", 32),
    ("full_attention_interval", 4))
FAMILIES["qwen3_5"] = _built_on_llama(
    "qwen3_5", "Qwen3_5", block_options=QWEN3_5_OPTIONS, layer_types=("linear_attention",),
    model_type_aliases=("qwen3_5_text",),
    text_prefix="model.language_model.", skipped_prefixes=("model.visual.", "mtp."),
    inert_rope_keys=("mrope_section", "mrope_interleaved"), config_defaults=(("max_position_embeddings", 32768),))

# Qwen3.5 / 3.6 MoE (qwen3_5_moe: 397B-A17B, 122B-A10B, 35B-A3B), as released: Qwen3.5's hybrid blocks,
# every block's MLP a mixture (backends.layers.GatedSharedMoeMLP): Qwen3-MoE's softmax router choosing
# num_experts_per_tok of num_experts, their weights renormalised, plus a shared expert of
# shared_expert_intermediate_size scaled by the sigmoid of its own gate; transformers 5.x's defaults
FAMILIES["qwen3_5_moe"] = dataclasses.replace(
    FAMILIES["qwen3_5"], model_type="qwen3_5_moe", **class_names("Qwen3_5Moe"),
    model_type_aliases=("qwen3_5_moe_text",), block_options=QWEN3_5_OPTIONS + (
        ("mixture_of_experts", "shared_gate"), ("num_experts", 256), ("num_experts_per_tok", 8),
        ("moe_intermediate_size", 512), ("shared_expert_intermediate_size", 512), ("norm_topk_prob", True)))
# Qwen3-Next (qwen3_next: 80B-A3B Instruct / Thinking): Qwen3.5-MoE's hybrid blocks without the
# vision-language wrapper (a *ForCausalLM save, model.* keys, config.json flat); its Gated DeltaNet reads
# two projections laid out per key head (backends.layers.InterleavedGatedDeltaNet: in_proj_qkvz, in_proj_ba);
# a mixture with a gated shared expert where Qwen3-MoE's rule puts one (decoder_sparse_step, mlp_only_layers:
# every block in the release), the dense MLP of intermediate_size elsewhere; transformers 5.x's defaults
FAMILIES["qwen3_next"] = _built_on_llama(
    "qwen3_next", "Qwen3Next", layer_types=("linear_attention",), block_options=QWEN3_5_OPTIONS + (
        ("interleaved_projections", True), ("mixture_of_experts", "shared_gate"), ("moe_by_step", True),
        ("num_experts", 512), ("num_experts_per_tok", 10), ("moe_intermediate_size", 512),
        ("shared_expert_intermediate_size", 512), ("norm_topk_prob", True), ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()), ("intermediate_size", 5632)), config_defaults=(("max_position_embeddings", 32768),))

# MiniMax-M2 / M2.5 / M2.7 (minimax_m2: 230B-A10B), bf16 or FP8 128 x 128 tiles as released (dequantized on load):
# grouped-query attention with q/k RMSNorms over the whole projection (backends.layers.WholeWidthRMSNorm: every
# head at once), RoPE on rotary_dim of each head (config.json's rotary_dim read as partial_rotary_factor);
# every block a mixture (backends.layers.CorrectedSigmoidMoeMLP: Mixtral's names and experts of
# intermediate_size, a sigmoid router whose choice adds e_score_correction_bias, the chosen renormalised);
# transformers 5.x's MiniMaxM2Config defaults
FAMILIES["minimax_m2"] = _built_on_llama(
    "minimax_m2", "MiniMaxM2", block_options=(
        ("own_layers", True), ("use_qk_norm", True), ("qk_norm_whole", True), ("head_dim", 128),
        ("mixture_of_experts", "minimax"), ("num_local_experts", 256), ("num_experts_per_tok", 8),
        ("intermediate_size", 1536)),
    partial_from_rotary_dim=True, config_defaults=(("rope_theta", 5e6), ("max_position_embeddings", 196608)))

# gpt-oss (gpt_oss: 120b, 20b), bf16 or its experts in MXFP4 as released (dequantized on load): dist_eval's layers
# (backends.layers.SinkAttention: grouped-query attention with biases on q, k, v and o, yarn RoPE, a learned sink
# logit per head joining the softmax, a sliding window of sliding_window positions on the blocks layer_types names
# sliding_attention, computed for rows of any length; TopKSoftmaxMoeMLP: a router with a bias, the softmax over
# the num_experts_per_tok chosen logits, fused experts with biases and a SwiGLU clamped at swiglu_limit, (up + 1));
# transformers 5.x's GptOssConfig defaults
FAMILIES["gpt_oss"] = _built_on_llama(
    "gpt_oss", "GptOss", layer_types=("sliding_attention",), block_options=(
        ("own_layers", True), ("sink_attention", True), ("use_qk_norm", False), ("head_dim", 64),
        ("attention_bias", True), ("sliding_window", 128), ("mixture_of_experts", "gpt_oss"),
        ("num_local_experts", 128), ("num_experts_per_tok", 4), ("intermediate_size", 2880), ("swiglu_limit", 7.0),
        ("swiglu_alpha", 1.702), ("mxfp4_experts", True)),
    config_defaults=(("rope_theta", 150000.0), ("rms_norm_eps", 1e-5), ("max_position_embeddings", 131072),
                     ("rope_scaling", {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 4096})))


# GLM-5 / 5.1 (glm_moe_dsa: 744B-A40B), bf16 as released: DeepSeek-V3's block (the latent attention, RoPE in
# interleaved pairs; from first_k_dense_replace on, or where mlp_layer_types says sparse, a sigmoid router with a
# correction bias choosing within groups, -inf for the groups left out as transformers 5.x has it, scaled, and a
# shared expert) plus DeepSeek Sparse Attention (backends.layers.SparseLatentAttention: each query attends to the
# index_topk keys its block's indexer keeps, RoPE in interleaved pairs there too; the blocks indexer_types marks
# shared reuse an earlier block's choice, not passed between blocks: rows past index_topk refused there). The
# options' values are transformers 5.x's GlmMoeDsaConfig defaults
FAMILIES["glm_moe_dsa"] = _built_on_llama(
    "glm_moe_dsa", "GlmMoeDsa", layer_types=("indexed_attention",), block_options=(
        ("own_layers", True), ("latent_attention", True), ("sparse_attention", True), ("shared_indexers", True),
        ("q_lora_rank", 2048), ("kv_lora_rank", 512), ("qk_nope_head_dim", 192), ("qk_rope_head_dim", 64),
        ("v_head_dim", 256), ("rope_interleave", True), ("index_topk", 2048), ("index_head_dim", 128),
        ("index_n_heads", 32), ("indexer_rope_interleave", True), ("mixture_of_experts", "sigmoid"),
        ("n_routed_experts", 256), ("n_shared_experts", 1), ("num_experts_per_tok", 8),
        ("moe_intermediate_size", 2048), ("routed_scaling_factor", 2.5), ("n_group", 1), ("topk_group", 1),
        ("first_k_dense_replace", 3), ("norm_topk_prob", True)),
    config_defaults=(("rms_norm_eps", 1e-5), ("max_position_embeddings", 202752)))
# DeepSeek-V3.2 / V3.2-Exp (deepseek_v32: 685B-A37B), FP8 128 x 128 tiles as released (dequantized on load) or bf16:
# DeepSeek-V3's block (its options) plus DeepSeek Sparse Attention as GLM-5's, every block with its own indexer,
# whose RoPE rotates halves (not interleaved pairs: transformers 5.x's DeepseekV32Indexer); the options' values
# are transformers 5.x's DeepseekV32Config defaults
FAMILIES["deepseek_v32"] = _built_on_llama(
    "deepseek_v32", "DeepseekV32", layer_types=("indexed_attention",), block_options=DEEPSEEK_V3_OPTIONS + (
        ("sparse_attention", True), ("index_topk", 2048), ("index_head_dim", 128), ("index_n_heads", 64),
        ("indexer_rope_interleave", False)), config_defaults=(("max_position_embeddings", 163840),))


# DeepSeek-V4-Flash / Pro (deepseek_v4: 284B-A13B, 1.6T-A49B), FP8 tiles + FP4 experts as released (dequantized on
# load: backends.layers.dequantize_v4) or bf16: dist_eval's layers under the release's names
# (backends.layers.HyperConnectedLayer): hc_mult residual streams between blocks, mixed by each block's
# hyper-connections and collapsed by hc_head before the final norm; the attention of each block's layer_types (a
# window of sliding_window positions; compressed sparse: a compressor's entries every compress_rates positions
# chosen by an indexer, index_topk of them; heavily compressed: every entry), one key that is also the value, RoPE
# on the last values of each head (yarn on the compressed kinds), a sink logit per head, a grouped output
# projection; a mixture with sqrt-softplus scores, chosen by tid2eid[token id] on the hash_moe blocks (no prompts
# there), clamped SwiGLU experts and a shared expert. On the servers dist_eval starts (backends.layers.
# HyperConnectedServerBlock): the streams flat between them, the token ids sent to those of hash-routed blocks
# (backends.petals.wire), hc_head and the final norm on the client. Label words: the LM head as released and as
# transformers 5.x saves it (head.weight), read into lm_head, after the final norm of the collapsed streams as 5.x's
# DeepseekV4ForCausalLM. The options' values are transformers 5.x's DeepseekV4Config defaults
FAMILIES["deepseek_v4"] = _built_on_llama(
    "deepseek_v4", "DeepseekV4", layer_types=V4_LAYER_TYPES, rope_labels=("main", "compress"), embeds_on_server=False,
    saved_lm_head="head",
    frozen=("embed_tokens", "layers", "norm", "hc_head"),
    # the release's names (deepseek-ai's index: embed.weight, layers.<i>.attn.kv_norm, hc_head_fn, norm.weight,
    # head.weight, mtp.<k>. beside them) read as transformers 5.x saves them (its conversion mapping's inverse)
    release_renames=((r"^embed\.weight$", "embed_tokens.weight"), (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
                     (r"^(layers\.\d+\.attn)\.kv_norm\.", r"\1.norm.")),
    skipped_prefixes=("mtp.",),
    block_options=(
        ("own_layers", True), ("hyper_connections", True), ("head_dim", 512), ("q_lora_rank", 1024),
        ("hc_mult", 4), ("hc_sinkhorn_iters", 20), ("hc_eps", 1e-6), ("sliding_window", 128), ("o_groups", 8),
        ("o_lora_rank", 1024), ("index_n_heads", 64), ("index_head_dim", 128), ("index_topk", 512),
        ("compress_rope_theta", 160000.0), ("swiglu_limit", 10.0), ("routed_scaling_factor", 1.5),
        ("n_routed_experts", 256), ("n_shared_experts", 1), ("num_experts_per_tok", 6), ("moe_intermediate_size", 2048),
        ("scoring_func", "sqrtsoftplus"), ("norm_topk_prob", True)),
    config_defaults=(("max_position_embeddings", 1048576),))


def tokenizers_calling_the_base() -> frozenset:
    """Every family's ``tokenizers_calling_the_base``: class names."""
    return frozenset(name for family in FAMILIES.values() for name in family.tokenizers_calling_the_base)


def family_named(model_type) -> Optional[Family]:
    """The family whose ``model_type`` (or one of its ``model_type_aliases``) is ``model_type``; None if none."""
    family = FAMILIES.get(model_type)
    return family or next((f for f in FAMILIES.values() if model_type in f.model_type_aliases), None)


def family_of(config, model_dir: str = "") -> Family:
    """The family of a transformers config (its ``model_type``); refuses an unsupported one."""
    model_type = getattr(config, "model_type", None)
    family = family_named(model_type)
    if family:
        why = family.unsupported_reason(config)
    elif model_type in NOT_COMPUTED:
        why = f"config.json has model_type {model_type!r}, whose {NOT_COMPUTED[model_type]} dist_eval does not compute"
    else:
        why = f"config.json has model_type {model_type!r}"
    if why:
        raise UsageError(
            f"{why}: not a model dist_eval computes; the families that work: {', '.join(sorted(FAMILIES))} "
            "(docs/models-and-checkpoints.md).", param="model_dir", value=model_dir,
        )
    return family


def family_of_object(model) -> tuple:
    """(family, "petals" | "local" | "") of a model object in memory: "petals" for the
    family's ``Distributed*ForSequenceClassification`` (petals' Auto classes build those),
    "local" for its transformers ``*ForSequenceClassification``, "" for another class of
    the family (a ``*ForCausalLM``, the base model); (None, "") outside the families.
    By class name (the classes' MRO), so neither petals nor transformers is imported.
    """
    family = family_named(getattr(getattr(model, "config", None), "model_type", None))
    if family is None:
        return None, ""
    names = {cls.__name__ for cls in type(model).__mro__}
    if family.petals_class in names:  # also a subclass of local_class: checked first
        return family, "petals"
    return family, "local" if family.local_class in names else ""


def checkpoint_prefixes() -> tuple:
    """Every family's checkpoint key prefix (a bare state dict does not say its family)."""
    return tuple(sorted({family.checkpoint_prefix for family in FAMILIES.values()}))


def family_of_key(key: str) -> str:
    """The model_type whose models alone have a tensor named ``key`` ('' when not one alone)."""
    import re

    matches = [family.model_type for family in FAMILIES.values()
               if family.key_signature and re.search(family.key_signature, key)]
    return matches[0] if len(matches) == 1 else ""
