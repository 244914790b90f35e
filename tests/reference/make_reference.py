"""Reference models, tokenizers and logits made by a current transformers, of either generation.

    .venv-reference/bin/python tests/reference/make_reference.py OUT     # transformers 4.57
    .venv-reference5/bin/python tests/reference/make_reference.py OUT    # transformers 5.x

The same code runs in both (launch/install_reference.sh makes each environment): each generation
saves config.json in its own form (5.x: ``rope_parameters`` in place of ``rope_theta`` and
``rope_scaling``, ``num_local_experts`` for Qwen3-MoE's expert count, ...), and computes with its own
model classes, so dist_eval is checked against both forms and both computations.

For each family that dist_eval computes, a tiny random model saved by the current
transformers (``*ForCausalLM.save_pretrained``: config.json as it writes it, safetensors) with a
tokenizer trained and saved by the current tokenizers (merges as pairs; Llama 3's
``ignore_merges``; SentencePiece-style for Mistral; Qwen2's own tokenizer class, which Qwen3 uses
too), and, for
the rows of ``CORPUS``: the ids the current tokenizer gives, and the logits of the current
``*ForSequenceClassification`` (no prompts) and of its backbone with prompts prepended (ptune).
Everything is computed here, in one run, from fixed seeds; ``OUT/reference.json`` holds the
numbers and the versions that made them. dist_eval's tests (tests/test_families_reference.py)
read OUT in the project's environment. Nothing here imports dist_eval.

Qwen3 and Qwen3-MoE have a ``head_dim`` (32) other than hidden/heads (16); Qwen3-MoE routes each
token to 2 of 8 experts (``norm_topk_prob``), block 1 dense (``mlp_only_layers``), and
``sparse_layers`` records which blocks transformers gives experts for another mix
(``decoder_sparse_step`` 2 with ``mlp_only_layers``), from its own decoder layers.

GLM-4.5 (``glm4_moe``) has no ``*ForSequenceClassification`` in transformers: its reference logits
are the causal LM's backbone's last position's final hidden state times the head (``score.weight``),
without and with the prompts prepended. Its tiny model: ``head_dim`` 32, q/k/v biases, q/k norms,
RoPE on half of each head (``partial_rotary_factor`` 0.5), block 0 dense (``first_k_dense_replace``
1) and blocks 1-3 a mixture of 8 routed experts (2 per token, chosen within the best of 2 groups,
``e_score_correction_bias`` drawn) and a shared expert, ``routed_scaling_factor`` 2.5.

Mixtral: ``head_dim`` 32, every block a mixture of 8 experts of ``intermediate_size``, 2 per token,
Mistral's tokenizer.

DeepSeek-V3 (``deepseek_v3``): 3 blocks, the latent attention (``q_lora_rank`` 32, ``kv_lora_rank`` 16,
each head 16 values without RoPE and 8 with, values of 32; latent norms drawn), yarn RoPE (factor 40,
``mscale`` 0.9 and ``mscale_all_dim`` 1: both the cos/sin factor and the softmax scale count, a small
original context), block 0 dense and blocks 1-2 a mixture of 8 routed experts (2 per token, chosen within
the best 2 of 4 groups, correction bias drawn) and a shared expert; a byte-level BPE read by
``LlamaTokenizerFast`` with a BOS, as DeepSeek's. Its weights are FP8-rounded: every linear weight of the
blocks but the router quantized to e4m3 per tile of ``FP8_BLOCK`` (the last tiles partial) and
dequantized (value times its tile's scale, float32) before the reference computes and the model is
saved; ``deepseek_v3_fp8`` is the same model as DeepSeek ships it (the e4m3 weights, a float32
``weight_scale_inv`` per tile, ``quantization_config``). Both folders also hold a multi-token-prediction
layer after the last block (``model.layers.3.*``, ``num_nextn_predict_layers`` 1), which the forward
does not use.

Llama 4 (``llama4_text``, a ``Llama4ForCausalLM`` save; no ``*ForSequenceClassification``: the head
apart, as GLM-4.5's): ``head_dim`` 32, llama3 rope, blocks 1 and 3 a mixture (``interleave_moe_layer_step``
2) of 8 experts of 32 (fused ``gate_up_proj`` / ``down_proj``), 2 per token (the flagship's 1), scaled
by the sigmoid of their router logits before they compute, and a shared expert; blocks 0 and 2 a dense
MLP of ``intermediate_size_mlp``; block 3 without RoPE (``no_rope_layer_interval`` 4), the others with
it and the L2 norm of q and k; Llama 3's tokenizer.

Qwen3.5 (``qwen3_5``, transformers 5.2 on: made by the 5.x environment alone) as released: a
``Qwen3_5ForConditionalGeneration`` save, config.json's ``text_config`` nested beside a one-block vision
tower, the text model under ``model.language_model.``; 4 blocks by ``layer_types``, 3 Gated DeltaNet
(2 key heads, 4 value heads of 16, a conv of 4) then 1 gated full attention (``head_dim`` 32, RoPE on a
quarter of each head, MRoPE sections given); its norms' offsets (1 + weight), ``dt_bias`` and the linear
norm drawn. Its reference: the text model's last final hidden state times the head. Qwen3.5-MoE
(``qwen3_5_moe``): the same, every block's MLP a mixture of 8 experts of 32 (2 per token, saved per expert
as the releases are) and a shared expert of 48 behind its sigmoid gate. Qwen3-Next (``qwen3_next``, made by
the 5.x environment alone though 4.57 has it): Qwen3.5-MoE's blocks in a flat ``Qwen3NextForCausalLM`` save
(its linear attention's projections laid out per key head), block 1 dense by ``mlp_only_layers``.
MiniMax-M2 (``minimax_m2``, 5.x alone; no ``*ForSequenceClassification``: the head apart): ``head_dim`` 32, q/k
norms over the whole projection, RoPE on ``rotary_dim`` 16 of each head, every block 2 of 8 experts (sigmoid
router, correction bias drawn), its weights FP8-rounded, and ``minimax_m2_fp8`` the same in FP8 tiles with the
release's config.json form (``rotary_dim``, ``rope_theta``, MiniMax's ``quantization_config``).
GLM-5 (``glm_moe_dsa``, 5.x alone; no ``*ForSequenceClassification``: the head apart): DeepSeek-V3's tiny block
(the latent attention, values of 32 beside heads of 16 + 8) with DeepSeek Sparse Attention: every block an indexer
(32 heads of 16, as GLM-5's count, its key norm drawn) keeping ``index_topk`` 4 keys per query, fewer than most
rows have, so that the choice counts (with 8 heads, scores of exactly 0 tied at the 4th best); block 0 dense,
blocks 1-3 2 of 8 experts (within the best of 2 groups, correction bias drawn) and a shared expert; a
multi-token-prediction layer after the last block, as released. Its case also records, per row and block, the
keys transformers' indexer kept for each query (``kept``: the positions at or before it).
DeepSeek-V3.2 (``deepseek_v32``, 5.x alone; no ``*ForSequenceClassification``: the head apart): DeepSeek-V3's tiny
model (FP8-rounded, its FP8 folder ``deepseek_v32_fp8`` as released, ``scale_fmt`` included, a prediction layer)
with an indexer per block as GLM-5's (RoPE on halves there, as transformers has it), recording ``kept`` too.

Kimi K2.5 (``kimi_k25``, 5.x alone; no ``*ForSequenceClassification``: the head apart) as released: a
``Kimi_K25ForConditionalGeneration`` around DeepSeek-V3's text model (``deepseek_v3``'s tiny one: 3 blocks,
latent attention, yarn, block 0 dense, blocks 1-2 2 of 8 experts of 32 and a shared expert), a one-block vision
tower, laid out as Moonshot's release is (``language_model.model.*``, ``language_model.lm_head.weight``,
``vision_tower.*``, ``mm_projector.*``; text_config's ``model_type`` ``kimi_k2``): transformers 5.23's own save
writes the text model's blocks as ``language_model.model.blocks.*`` and the projector's norm as
``model.mm_projector.*``, so those two are put back, and the folder read back by 5.23 gives every tensor of the
model. Its routed experts' weights are INT4-rounded (each row's groups of ``INT4_GROUP`` values: a bf16 scale of
the group's largest magnitude / 7.5, values rounded into -8..7, the weight the value times its scale computed in
bf16 as compressed-tensors dequantizes) before the reference computes and the model is saved; ``kimi_k25_int4``
is the same model as Moonshot ships it: those weights in compressed-tensors' ``pack-quantized`` form (written
here, compressed-tensors is not installed: ``weight_packed`` int32 holding columns 8k..8k+7 of a row in bits
4j..4j+3, lowest first, each value + 8; ``weight_scale`` bf16 [rows, columns / 32]; ``weight_shape`` int64),
``quantization_config`` at the top level, attention, shared expert, dense block and router ignored.

gpt-oss (``gpt_oss``, 5.x alone) as released: ``head_dim`` 32, biases on q, k, v and o (drawn), a sink logit per
head (drawn), blocks 0 and 2 attending within a sliding window of 8 positions (shorter than most rows, so the
window counts) and blocks 1 and 3 to every position (``layer_types``), yarn RoPE (factor 32, ``truncate`` false,
a small original context), every block 4 of 8 experts of 32 chosen by a router with a bias (drawn), their
weights and biases drawn large enough that the SwiGLU's clamp at ``swiglu_limit`` 7 is reached; its experts'
weights MXFP4-rounded (per 32 values of a row, a power of two and 4-bit e2m1 codes, as the release holds them),
dequantized by transformers' own ``convert_moe_packed_tensors`` before the reference computes and the model is
saved; ``gpt_oss_mxfp4`` is the same model as OpenAI ships it (``*_blocks`` and ``*_scales`` for
``mlp.experts.gate_up_proj`` and ``down_proj``, ``quantization_config`` quant_method ``mxfp4``, config.json's
``rope_scaling`` and ``rope_theta`` form), which transformers reads back (dequantizing it on the CPU) into the
same tensors, checked here.

DeepSeek-V4 (``deepseek_v4``, 5.x alone; no ``*ForSequenceClassification``: the head apart), as transformers 5.23 saves
it (the release's tensor names): 4 blocks, one of each attention kind (sliding, window 8; compressed sparse, an entry
every 4 positions and an indexer of 32 heads keeping 3; heavily compressed, every 8) and a second compressed sparse
one, 4 streams, blocks 0-1 hash-routed (``tid2eid`` drawn) and 2-3 learned; its weights FP8 / FP4-rounded, and
``deepseek_v4_fp8`` the same as DeepSeek ships it (e4m3 tiles of 16 x 16 and FP4 experts, each with a ue8m0
``<name>.scale``), which transformers reads back into the same tensors (recorded). No ptune reference: its
hash-routed blocks route a position by its token id, which a prompt position has not. Its zero-shot reference
(``LABEL_WORDS``): per row and word, the summed log-probabilities under ``DeepseekV4ForCausalLM``'s own logits (its
head, saved as ``head.weight``, after ``hc_head`` and the final norm) of the word's tokens (those after a space in
running text, the rule dist_eval documents) appended to the row, one forward per row and word.

BLOOM and Falcon (the 40B layout: the new decoder architecture, 2 key/value heads, RoPE at theta 50000, so
that a reader taking the default 10000 is caught), byte-level BPE tokenizers. Kimi K2 (``kimi_k2``) has no
class in transformers: DeepSeek-V3's folder with ``model_type`` ``kimi_k2``, the same block (its reference
logits are DeepSeek-V3's).
"""
import json
import os
import shutil
import sys

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tiếng Việt là ngôn ngữ chính thức của Việt Nam.",
    "Người Việt nói tiếng Việt rất hay.",
    "Καλημέρα κόσμε, τι κάνεις σήμερα;",
    "ελληνικά γράμματα και λέξεις",
    "日本語のテキストと中文文本混合。",
    "我爱北京天安门，天安门上太阳升。",
    "Emoji test: 🙂🚀🔥 and 👩‍💻 together!",
    "def add(a, b):\n    return a + b  # code\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "  leading spaces and\ttabs\tand   runs   of spaces",
    "UPPER lower MiXeD 12345 67.89 -0.5e10",
    "naïve café résumé — “quotes” ‘single’ … ellipsis",
    "Ünïcödé ßtraße Ångström Øre ħ ŋ",
    "Việt Việt Việt κόσμε κόσμε 天安门",
    "a",
]
HIDDEN, HEADS, KV_HEADS, LAYERS, INTERMEDIATE = 64, 4, 2, 4, 128
HEAD_DIM, EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE = 32, 8, 2, 32  # Qwen3 (head_dim), Qwen3-MoE
NUM_LABELS, PRE_SEQ_LEN = 3, 4
# whole words put in the Llama-3-style vocabulary without a merge that makes them: emitted
# whole only where ignore_merges is honoured
WHOLE_WORDS = [" ngôn", " Ångström", " σήμερα", "北京", " résumé"]


# Qwen2's pre-tokenizer (each digit alone), as its released tokenizer.json and transformers 5.x's class have it
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_bpe(byte_level: bool, special: list, vocab_size: int = 400, qwen: bool = False):
    """A BPE trained on CORPUS. ``qwen``: Qwen2's pipeline as released (NFC, its split, then bytes):
    transformers 5.x's Qwen2 tokenizer class imposes it whatever tokenizer.json says, so the saved
    file must be the released shape for both generations to tokenize alike."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if qwen:
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-style (Llama 2, Mistral): metaspace, byte fallback
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        alphabet = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def with_whole_words(tok):
    """A byte-level BPE with ignore_merges and WHOLE_WORDS added to its vocabulary, no merge."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    mapped = {w: _byte_level(w) for w in WHOLE_WORDS}
    vocab = data["model"]["vocab"]
    for word in mapped.values():
        vocab.setdefault(word, max(vocab.values()) + 1)
    data["model"]["ignore_merges"] = True
    return Tokenizer.from_str(json.dumps(data))


def _byte_level(text: str) -> str:
    table = _bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _bytes_to_unicode() -> dict:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_of(kind: str):
    from tokenizers import processors
    from transformers import LlamaTokenizerFast, PreTrainedTokenizerFast, Qwen2TokenizerFast

    if kind in ("llama3", "llama4_text"):  # Llama 3 / 4: tiktoken-style byte-level BPE, ignore_merges, BOS
        tok = with_whole_words(train_bpe(True, ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]))
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                       eos_token="<|end_of_text|>", pad_token="<|pad|>")
    if kind in ("bloom", "falcon"):  # BLOOM, Falcon: a byte-level BPE, no BOS
        tok = train_bpe(True, ["<pad>", "<s>", "</s>"] if kind == "bloom" else [">>PAD<<", "<|endoftext|>"])
        if kind == "bloom":  # its own class where the generation has one (4.x; 5.x has one class for all)
            import transformers

            bloom = getattr(transformers, "BloomTokenizerFast", PreTrainedTokenizerFast)
            return bloom(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token=">>PAD<<")
    if kind in ("glm4_moe", "glm_moe_dsa"):  # GLM-4.5, GLM-5: a byte-level BPE read by the plain fast class, no BOS
        tok = train_bpe(True, ["<|endoftext|>", "[gMASK]", "<sop>"])
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if kind in ("deepseek_v3", "kimi_k25", "deepseek_v32", "deepseek_v4"):  # DeepSeek: byte BPE, Llama's class, BOS
        tok = train_bpe(True, [DEEPSEEK_BOS, DEEPSEEK_EOS, "<｜▁pad▁｜>"])
        return LlamaTokenizerFast(tokenizer_object=tok, bos_token=DEEPSEEK_BOS, eos_token=DEEPSEEK_EOS,
                                  pad_token=DEEPSEEK_EOS, add_bos_token=True, add_eos_token=False, legacy=True)
    if kind in ("mistral", "mixtral"):  # Llama 2 / Mistral: SentencePiece-style BPE with byte fallback, BOS
        tok = train_bpe(False, ["<unk>", "<s>", "</s>"])
        return LlamaTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>", add_bos_token=True, add_eos_token=False, legacy=False)
    if kind == "gpt_oss":  # gpt-oss: a byte-level BPE read by the plain fast tokenizer class, no BOS
        tok = train_bpe(True, ["<|endoftext|>", "<|start|>", "<|return|>"])
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>")
    tok = train_bpe(True, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], qwen=True)  # Qwen2, Qwen3: no BOS
    return Qwen2TokenizerFast(tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                              pad_token="<|endoftext|>")


def config_of(kind: str, vocab_size: int, pad_token_id: int):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=HIDDEN, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS, intermediate_size=INTERMEDIATE,
                  pad_token_id=pad_token_id, max_position_embeddings=512, num_labels=NUM_LABELS)
    if kind == "llama3":  # Llama 3.2-style: llama3 rope (a small original context, so it matters here), tied
        return transformers.LlamaConfig(rope_theta=500000.0, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **common)
    if kind == "bloom":
        return transformers.BloomConfig(vocab_size=vocab_size, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                        pad_token_id=pad_token_id, num_labels=NUM_LABELS)
    if kind == "falcon":  # falcon-40b's layout (petals serves it; the 7B's multi-query one it cannot)
        return transformers.FalconConfig(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                         num_attention_heads=HEADS, new_decoder_architecture=True,
                                         num_kv_heads=KV_HEADS, rope_theta=50000.0, pad_token_id=pad_token_id,
                                         num_labels=NUM_LABELS)
    if kind == "mistral":  # Mistral-Nemo / Small 3-style: a head_dim apart from hidden / heads
        return transformers.MistralConfig(rope_theta=1000000.0, sliding_window=4096, head_dim=HEAD_DIM, **common)
    if kind == "qwen3":  # Qwen3-0.6B-style (tied), with biases on q, k, v and o (attention_bias)
        return transformers.Qwen3Config(rope_theta=1000000.0, tie_word_embeddings=True, head_dim=HEAD_DIM,
                                        attention_bias=True, use_sliding_window=False, **common)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(rope_theta=1000000.0, head_dim=HEAD_DIM, **MOE, **common)
    if kind == "mixtral":  # Mixtral-8x7B-style, with a head_dim apart and a smaller expert
        return transformers.MixtralConfig(rope_theta=1000000.0, head_dim=HEAD_DIM, num_local_experts=EXPERTS,
                                          num_experts_per_tok=EXPERTS_PER_TOKEN, **common)
    if kind in ("deepseek_v3", "kimi_k25", "deepseek_v32"):  # DeepSeek-V3-style, 3 blocks, every head its own key
        return deepseek_config(kind, common)
    if kind == "llama4_text":  # Llama-4-Maverick-style: dense and MoE blocks alternate, the 4th block without RoPE
        return transformers.Llama4TextConfig(rope_theta=500000.0, head_dim=HEAD_DIM, **LLAMA4, **common)
    if kind == "qwen3_5":  # Qwen3.5 as released: a vision-language config, the text model's nested
        return transformers.Qwen3_5Config(text_config={**common, **QWEN3_5}, vision_config=QWEN3_5_VISION,
                                          tie_word_embeddings=False)
    if kind == "qwen3_5_moe":  # Qwen3.5-MoE as released: every block a mixture, 2 of 8 experts + a gated shared one
        return transformers.Qwen3_5MoeConfig(text_config={**common, **QWEN3_5, **QWEN3_5_MOE},
                                             vision_config=QWEN3_5_VISION, tie_word_embeddings=False)
    if kind in FLAT:  # Qwen3-Next-style: Qwen3.5-MoE's hybrid, flat (no vision tower), block 1 dense; GLM-5-style
        return getattr(transformers, FLAT[kind][0])(**{**common, **FLAT[kind][1]})
    if kind in EXPERT_SIZED:  # MiniMax-M2, gpt-oss: every block a mixture, intermediate_size each expert's
        config_class = getattr(transformers, f"{CLASSES[kind]}Config")
        return config_class(**{**common, "intermediate_size": EXPERT_INTERMEDIATE, **EXPERT_SIZED[kind]})
    if kind == "glm4_moe":  # GLM-4.5-style, with n_group 2 (the flagship's 1) so that the grouped choice counts
        return transformers.Glm4MoeConfig(rope_theta=1000000.0, head_dim=HEAD_DIM, **GLM_MOE, **common)
    return transformers.Qwen2Config(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
                                    **common)


MOE = dict(num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=EXPERT_INTERMEDIATE,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
GLM_MOE = dict(partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=EXPERTS,
               n_shared_experts=1, num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=EXPERT_INTERMEDIATE,
               first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, n_group=2, topk_group=1)
DEEPSEEK_LAYERS, DEEPSEEK_BOS, DEEPSEEK_EOS = 3, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DEEPSEEK = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32,
                n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=EXPERTS_PER_TOKEN,
                moe_intermediate_size=EXPERT_INTERMEDIATE, n_group=4, topk_group=2, first_k_dense_replace=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
                rope_scaling={"type": "yarn", "factor": 40.0, "mscale": 0.9, "mscale_all_dim": 1.0, "beta_fast": 32,
                              "beta_slow": 1, "original_max_position_embeddings": 64})
# GLM-5 (glm_moe_dsa): DeepSeek-V3's tiny latent attention and mixture (n_group 2, the flagship's 1, so that the
# grouped choice counts) and an indexer of 32 heads of 16 keeping INDEX_TOPK keys per query (the flagship's 2048)
INDEX_TOPK = 4
GLM_DSA = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32,
               n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=EXPERTS_PER_TOKEN,
               moe_intermediate_size=EXPERT_INTERMEDIATE, n_group=2, topk_group=1, first_k_dense_replace=1,
               routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=INDEX_TOPK, index_head_dim=16,
               index_n_heads=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
LLAMA4 = dict(num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, intermediate_size_mlp=INTERMEDIATE,
              interleave_moe_layer_step=2, no_rope_layer_interval=4, use_qk_norm=True,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64})
# Qwen3.5 (qwen3_5): blocks 0-2 Gated DeltaNet, block 3 gated full attention (the releases' 3:1), 2 key heads
# and 4 value heads of 16 in the linear blocks, a head_dim of 32 (hidden / heads is 16) rotating a quarter
QWEN3_5 = dict(head_dim=HEAD_DIM, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
               linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN3_5_MOE = dict(num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
                   moe_intermediate_size=EXPERT_INTERMEDIATE, shared_expert_intermediate_size=48)
# Qwen3-Next (qwen3_next): Qwen3.5-MoE's blocks, 4 value heads of 16 on 2 key heads (their projections laid out
# per key head), experts by Qwen3-MoE's rule: mlp_only_layers [1] leaves block 1 dense (the release: none)
QWEN3_NEXT = dict(
    head_dim=HEAD_DIM, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    decoder_sparse_step=1, mlp_only_layers=[1], **QWEN3_5_MOE)
# DeepSeek-V4 (deepseek_v4): block 0 sliding (window 8), blocks 1 and 3 compressed sparse (every 4 positions
# compressed, the indexer's 32 heads of 16 keeping 3 entries), block 2 heavily compressed (every 8: the release's
# 128, shorter than most rows here); blocks 0-1 hash-routed (tid2eid drawn), 2-3 learned (sqrt-softplus scores,
# correction bias); 4 heads of 32 sharing one key = value, RoPE on the last 8 of each, yarn on the compressed
# kinds; grouped output (2 groups of 16); 4 residual streams (hc_mult as released); swiglu_limit 0.25 so the clamp
# is reached with weights of this size
DEEPSEEK_V4 = dict(
    num_key_value_heads=1, head_dim=HEAD_DIM, q_lora_rank=32, partial_rotary_factor=0.25,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=8,
    n_routed_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=EXPERT_INTERMEDIATE,
    o_groups=2, o_lora_rank=16, index_n_heads=32, index_head_dim=16, index_topk=3, hc_mult=4, swiglu_limit=0.25,
    bos_token_id=None, eos_token_id=None, intermediate_size=EXPERT_INTERMEDIATE,  # (its experts', as 5.x maps it)
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1})
# the spread DeepSeek-V4's tensors are drawn with (by the end of their names; transformers starts them at 0 or 1)
DEEPSEEK_V4_SPREAD = {"self_attn.sinks": 1.0, "position_bias": 0.5, "attn_hc.base": 0.5, "ffn_hc.base": 0.5,
                      "hc_head.hc_base": 0.5, "attn_hc.fn": 0.1, "ffn_hc.fn": 0.1, "hc_head.hc_fn": 0.1}
# the families whose config is the common settings and their own: (config class, settings)
FLAT = {"qwen3_next": ("Qwen3NextConfig", QWEN3_NEXT), "deepseek_v4": ("DeepseekV4Config", DEEPSEEK_V4),
        "glm_moe_dsa": ("GlmMoeDsaConfig", {
    **GLM_DSA, "num_key_value_heads": HEADS})}  # GLM-5: DeepSeek-V3's tiny block, an indexer keeping 4 keys per block
QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
KIMI_VISION = dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                   num_hidden_layers=1, hidden_size=32, intermediate_size=64)
INT4_GROUP = 32  # Kimi K2.5's group size (the tiny experts' rows: 64 or 32 values)
FP8_BLOCK = (24, 24)  # the tiny model's tiles (the flagship's 128 x 128): partial ones at the edges
FP8_MAX = 448.0  # the largest e4m3 value
# gpt-oss (gpt_oss): a window of 8 on blocks 0 and 2 (the release's 128), 4 of 8 experts (the release's 4 of 128)
GPT_OSS = dict(head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=4, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=7.0, attention_bias=True,
               bos_token_id=None, eos_token_id=None,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
# MiniMax-M2-style: every block 2 of 8 experts, RoPE on rotary_dim 16 of each head of 32
MINIMAX_M2 = dict(head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, rotary_dim=16,
                  rope_theta=5000000.0, bos_token_id=None, eos_token_id=None)
# the families whose intermediate_size is each expert's, with their settings (gpt-oss: yarn's context, 64 x 32)
EXPERT_SIZED = {"minimax_m2": MINIMAX_M2, "gpt_oss": {**GPT_OSS, "max_position_embeddings": 2048}}
# the spread gpt-oss's tensors are drawn with (by the end of their names): sink logits and a router bias that
# count, experts whose gate values pass swiglu_limit (7) now and then
GPT_OSS_SPREAD = {"self_attn.sinks": 1.0, "router.bias": 1.0, "experts.gate_up_proj": 0.5, "experts.down_proj": 0.05,
                  "experts.gate_up_proj_bias": 0.5, "experts.down_proj_bias": 0.5}
MXFP4_GROUP = 32  # values sharing one power-of-two scale
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the e2m1 codes 0-7 (8-15: their negatives)
CLASSES = {"bloom": "Bloom", "falcon": "Falcon",
           "llama3": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
           "glm4_moe": "Glm4Moe", "mixtral": "Mixtral", "deepseek_v3": "DeepseekV3", "llama4_text": "Llama4",
           "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "qwen3_next": "Qwen3Next", "gpt_oss": "GptOss",
           "minimax_m2": "MiniMaxM2", "kimi_k25": "Kimi_K25", "glm_moe_dsa": "GlmMoeDsa",
           "deepseek_v32": "DeepseekV32", "deepseek_v4": "DeepseekV4"}
# vision-language releases: saved from *ForConditionalGeneration, the text model under model.language_model.
# beside a vision tower; the reference is the text model's last final hidden state times the head
VISION_LANGUAGE = ("qwen3_5", "qwen3_5_moe", "kimi_k25")
OFFSET_NORMS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # norms scaling by 1 + weight (zeros at first)
# families checked against transformers 5.x alone, though an earlier one has them (Qwen3-Next: 4.57 on; gpt-oss:
# 4.55 on)
LATER = {"qwen3_next": 5, "gpt_oss": 5}  # (deepseek_v4: 5.8 on, hasattr below)
# transformers has no *ForSequenceClassification: the backbone times the head
NO_CLASSIFIER = ("glm4_moe", "llama4_text", "minimax_m2", "glm_moe_dsa", "deepseek_v32", "deepseek_v4")
# the first blocks route each position by its token id (tid2eid): a prompt position has none, no ptune reference
HASH_ROUTED = ("deepseek_v4",)
# zero-shot label words scored by the causal LM's own head (DeepSeek-V4's as released: head.weight), one per class
LABEL_WORDS_CASES = ("deepseek_v4",)
LABEL_WORDS = ["Việt", "fox", "spaces"]
SPARSE_ATTENTION = ("glm_moe_dsa", "deepseek_v32")  # an indexer per block: the keys it kept recorded too


def deepseek_config(kind: str, common: dict):
    """DeepSeek-V3's tiny config (as the flagship, every head its own key and value), DeepSeek-V3.2's (the same and
    an indexer per block), or Kimi K2.5's as released: that text model (no MTP layer) nested beside a one-block
    vision tower."""
    import transformers

    text = {**common, **DEEPSEEK, "num_hidden_layers": DEEPSEEK_LAYERS, "num_key_value_heads": HEADS,
            "max_position_embeddings": 2560}
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(rope_theta=10000.0, **text)
    if kind == "deepseek_v32":  # and an indexer per block of 32 heads of 16 keeping INDEX_TOPK keys per query
        return transformers.DeepseekV32Config(rope_theta=10000.0, **text, index_topk=INDEX_TOPK, index_head_dim=16,
                                              index_n_heads=32)
    text.update(num_nextn_predict_layers=0, rope_theta=50000.0)
    return transformers.Kimi_K25Config(text_config=text, vision_config=KIMI_VISION, projection_hidden_size=32,
                                       tie_word_embeddings=False)


def sparse_layers() -> dict:
    """The blocks transformers' Qwen3-MoE decoder layers give experts, for a config of 6 blocks,
    decoder_sparse_step 2 and mlp_only_layers [3] (its own layers, built one by one)."""
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    settings = dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4,
                    num_experts_per_tok=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=32, moe_intermediate_size=8, vocab_size=16)
    config = transformers.Qwen3MoeConfig(**settings)
    sparse = [i for i in range(6) if isinstance(m.Qwen3MoeDecoderLayer(config, i).mlp, m.Qwen3MoeSparseMoeBlock)]
    return {"settings": settings, "sparse": sparse}


def fp8_tiles(weight: torch.Tensor) -> tuple:
    """(the e4m3 weight, its float32 scale per FP8_BLOCK tile): each tile divided by its largest
    magnitude / 448, as DeepSeek quantizes."""
    rows, cols = weight.shape
    (br, bc), quantized = FP8_BLOCK, torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // br), -(-cols // bc), dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            quantized[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def fp8_value(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight an FP8 weight stands for: each e4m3 value (as float32) times its tile's scale."""
    (br, bc), value = FP8_BLOCK, quantized.to(torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            value[i * br:(i + 1) * br, j * bc:(j + 1) * bc] *= scale[i, j]
    return value


def is_fp8_weight(key: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3's FP8 tensors: the blocks' linear weights, but the router's (and DeepSeek-V3.2's indexer's
    weights_proj, which transformers keeps in float32)."""
    return key.startswith("model.layers.") and tensor.dim() == 2 and not key.endswith(
        ("mlp.gate.weight", "indexer.weights_proj.weight"))


def with_prediction_layer(tensors: dict, config) -> dict:
    """The tensors plus a multi-token-prediction layer after the last block (DeepSeek-V3's names,
    random values): what a checkpoint saves beside the blocks and the forward never uses."""
    g = torch.Generator().manual_seed(2)
    last, extra = config.num_hidden_layers - 1, {}
    for key, tensor in tensors.items():
        if key.startswith(f"model.layers.{last}."):
            extra[key.replace(f".{last}.", f".{last + 1}.", 1)] = torch.randn(tensor.shape, generator=g)
    mtp = f"model.layers.{last + 1}."
    extra.update({mtp + "enorm.weight": torch.ones(HIDDEN), mtp + "hnorm.weight": torch.ones(HIDDEN),
                  mtp + "eh_proj.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=g),
                  mtp + "shared_head.norm.weight": torch.ones(HIDDEN)})
    return {**tensors, **extra}


def save_deepseek_folders(lm, folder: str, fp8_folder: str) -> dict:
    """Replace ``folder``'s weights by the FP8-rounded ones plus a prediction layer, and write
    ``fp8_folder``: the same model in FP8 (e4m3 weights, a weight_scale_inv per tile, its config; DeepSeek-V3.2's
    quantization_config as released, with its scale_fmt); the reference case's fields of it."""
    from safetensors.torch import load_file, save_file

    tensors = with_prediction_layer(load_file(os.path.join(folder, "model.safetensors")), lm.config)
    fp8 = {}
    for key, tensor in tensors.items():
        if is_fp8_weight(key, tensor):
            quantized, scale = fp8_tiles(tensor)
            fp8[key], fp8[key + "_scale_inv"] = quantized, scale
            tensors[key] = fp8_value(quantized, scale)
        else:
            fp8[key] = tensor
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(folder, fp8_folder)
    save_file(fp8, os.path.join(fp8_folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK),
                                     **({"scale_fmt": "ue8m0"} if config["model_type"] == "deepseek_v32" else {})}
    with open(os.path.join(fp8_folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return {"fp8_folder": os.path.basename(fp8_folder), "fp8_block": list(FP8_BLOCK)}


def save_minimax_fp8_folder(lm, folder: str, fp8_folder: str) -> None:
    """MiniMax-M2 as released: ``folder``'s weights replaced by their FP8-rounded values, and ``fp8_folder``
    the same model in FP8 tiles (the blocks' linear weights but the router, MiniMax's modules_to_not_convert),
    its config.json in the release's form (rope_theta and rotary_dim, no rope_parameters; MiniMax's
    quantization_config, fmt float8_e4m3fn)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    fp8 = {}
    for key, tensor in tensors.items():
        if key.startswith("model.layers.") and tensor.dim() == 2 and not key.endswith("block_sparse_moe.gate.weight"):
            quantized, scale = fp8_tiles(tensor)
            fp8[key], fp8[key + "_scale_inv"] = quantized, scale
            tensors[key] = fp8_value(quantized, scale)
        else:
            fp8[key] = tensor
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(folder, fp8_folder)
    save_file(fp8, os.path.join(fp8_folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK),
                                     "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    with open(os.path.join(fp8_folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def int4_groups(weight: torch.Tensor) -> tuple:
    """(values in -8..7 as int8, bf16 scales [rows, columns / INT4_GROUP]): each row's groups of INT4_GROUP
    divided by a bf16 scale of their largest magnitude / 7.5, rounded (symmetric, as compressed-tensors')."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    scale = (groups.abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
    values = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int8)
    return values.reshape(rows, cols), scale


def int4_value(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight INT4 values stand for: each value times its group's scale, in bf16 (compressed-tensors
    computes in the scale's dtype), as float32."""
    scales = scale.repeat_interleave(INT4_GROUP, 1)
    return (values.to(torch.bfloat16) * scales).float()


def int4_pack(values: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized int32s of int8 ``values`` in -8..7: ``packed[r, k]`` holds columns
    8k..8k+7 of row r, column 8k+j in bits 4j..4j+3 (the lowest first), each as value + 8."""
    rows, cols = values.shape
    unsigned = torch.nn.functional.pad(values.to(torch.int64) + 8, (0, -cols % 8)).reshape(rows, -1, 8)
    packed = sum(unsigned[:, :, j] << (4 * j) for j in range(8))
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def is_int4_weight(key: str) -> bool:
    """Kimi K2.5's INT4 tensors: the routed experts' weights (not attention, shared expert, dense MLP, router)."""
    import re

    return re.fullmatch(r"language_model\.model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
                        key) is not None


KIMI_INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": INT4_GROUP, "strategy": "group",
                    "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None}


def save_kimi_folders(lm, folder: str) -> dict:
    """``folder`` (5.23's save of Kimi K2.5, ``lm``) in Moonshot's layout, its routed experts INT4-rounded, read
    back by 5.23 whole; and ``<folder>_int4``: the same model with those experts in compressed-tensors'
    pack-quantized form. The reference case's fields naming it."""
    from safetensors.torch import load_file, save_file

    def released(key: str) -> str:  # what 5.23's save writes otherwise (see the module doc)
        return key.replace("language_model.model.blocks.", "language_model.model.layers.").replace(
            "model.mm_projector.", "mm_projector.")

    tensors = {released(k): v for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    int4 = {}
    for key, tensor in tensors.items():
        if is_int4_weight(key):
            values, scale = int4_groups(tensor)
            tensors[key] = int4_value(values, scale)
            int4[key + "_packed"], int4[key + "_scale"] = int4_pack(values), scale
            int4[key + "_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
        else:
            int4[key] = tensor
    assert any(v.dtype == torch.int32 and (v < 0).any() for v in int4.values())  # the high nibble's bit is used
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["text_config"]["model_type"] = "kimi_k2"  # Moonshot's name (5.23 reads it as deepseek_v3)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    int4_folder = folder + "_int4"
    shutil.copytree(folder, int4_folder)
    save_file(int4, os.path.join(int4_folder, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = KIMI_INT4_CONFIG
    with open(os.path.join(int4_folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    read_back_whole(lm, folder)
    return {"int4_folder": os.path.basename(int4_folder), "int4_group": INT4_GROUP}


def read_back_whole(lm, folder: str) -> None:
    """The released layout read back by this transformers: every tensor of ``lm``, its experts INT4-rounded."""
    read = type(lm).from_pretrained(folder).eval()
    held, experts = read.state_dict(), lambda model: model.model.language_model.layers[1].mlp.experts.gate_up_proj
    assert set(held) == set(lm.state_dict()) and not experts(read).equal(experts(lm))
    assert all(held[k].equal(v) for k, v in lm.state_dict().items() if ".experts." not in k)


def gpt_oss_spread(key: str) -> float:
    """The spread gpt-oss's tensor ``key`` is drawn with (GPT_OSS_SPREAD; 0: another tensor)."""
    return next((spread for end, spread in GPT_OSS_SPREAD.items() if key.endswith(end)), 0.0)


def mxfp4_quantized(weight: torch.Tensor) -> tuple:
    """(blocks uint8 [..., rows, columns / 32, 16], scales uint8 [..., rows, columns / 32]) of ``weight``
    [..., rows, columns] in MXFP4: per 32 values of a row the smallest power of two putting their largest
    magnitude within 6 (biased by 127), each value the nearest e2m1 code (the sign its top bit), two codes a
    byte, the even column in the low nibble (gpt-oss's release format)."""
    groups = weight.reshape(*weight.shape[:-1], -1, MXFP4_GROUP)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent.to(torch.int32))[..., None]
    magnitudes = torch.tensor(FP4_MAGNITUDES)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8).reshape(*groups.shape[:-1], MXFP4_GROUP // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), (exponent + 127).to(torch.uint8)


def save_gpt_oss_mxfp4_folder(folder: str, mxfp4_folder: str) -> dict:
    """gpt-oss as released: ``folder``'s experts' weights replaced by their MXFP4 values (dequantized by
    transformers' own convert_moe_packed_tensors), and ``mxfp4_folder`` the same model with those weights as
    ``*_blocks`` / ``*_scales`` (quantization_config quant_method mxfp4; rope_theta and rope_scaling as the
    release's config.json has them). Both read back by transformers: every tensor the same (its own CPU
    dequantization), recorded in the returned fields."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors, mxfp4 = load_file(os.path.join(folder, "model.safetensors")), {}
    for key, tensor in tensors.items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # [experts, in, out]
            blocks, scales = mxfp4_quantized(tensor.transpose(1, 2))  # stored [experts, out, in / 32, 16]
            mxfp4[key + "_blocks"], mxfp4[key + "_scales"] = blocks, scales
            tensors[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            mxfp4[key] = tensor
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(folder, mxfp4_folder)
    save_file(mxfp4, os.path.join(mxfp4_folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(mxfp4_folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(mxfp4_folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    plain, read = (transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
                   for path in (folder, mxfp4_folder))
    assert set(plain) == set(read) and any(t.dtype == torch.uint8 for t in mxfp4.values())
    return {"mxfp4_folder": os.path.basename(mxfp4_folder),
            "mxfp4_read_by_transformers_equal": all(torch.equal(plain[k], read[k]) for k in plain)}


def save_as_kimi(folder: str, kimi_folder: str) -> None:
    """Kimi K2's folder: DeepSeek-V3's (the same block) under model_type kimi_k2, as Moonshot saves it."""
    shutil.copytree(folder, kimi_folder)
    with open(os.path.join(kimi_folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["model_type"] = "kimi_k2"
    with open(os.path.join(kimi_folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def save_with_prediction_layer(lm, folder: str) -> dict:
    """A sparse-attention family's folder as released (GLM-5): a multi-token-prediction layer after the last block."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    save_file(with_prediction_layer(load_file(path), lm.config), path, metadata={"format": "pt"})
    return {}


V4_FP8_BLOCK = (16, 16)  # the tiny DeepSeek-V4's tiles (the release's 128 x 128; 5.23 needs whole tiles)
V4_FP4_GROUP = 32  # the values of an expert's row sharing one power-of-two scale (the release's)
# DeepSeek-V4's release: FP8 tiles for the blocks' linear weights but the compressors', the indexer's weights_proj
# (bf16 there: transformers' _keep_in_fp32_modules) and the router's; FP4 for the routed experts
V4_FP4 = r"model\.layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight"
V4_FP8 = r"model\.layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight"


def e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Powers of two 2 ** exponent as ue8m0 scales (float8_e8m0fnu: the biased exponent alone)."""
    return (exponent.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def v4_fp8(weight: torch.Tensor) -> tuple:
    """(e4m3 weight, ue8m0 scale per V4_FP8_BLOCK tile): each tile divided by the power of two putting its largest
    magnitude within 448 (DeepSeek-V4's scale_fmt ue8m0)."""
    rows, cols = weight.shape
    br, bc = V4_FP8_BLOCK
    tiles = weight.reshape(rows // br, br, cols // bc, bc)
    exponent = torch.ceil(torch.log2(tiles.abs().amax((1, 3)).clamp(min=2.0 ** -100) / FP8_MAX))
    scale = torch.ldexp(torch.ones_like(exponent), exponent.to(torch.int32))
    quantized = (tiles / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    value = (quantized.float().reshape(rows // br, br, cols // bc, bc) * scale[:, None, :, None]).reshape(rows, cols)
    return quantized, e8m0(exponent), value


def v4_fp4(weight: torch.Tensor) -> tuple:
    """(int8 [rows, cols / 2]: two e2m1 codes a byte, the even column in the low nibble; ue8m0 scale [rows, cols /
    32]; the value they stand for): MXFP4's rounding (mxfp4_quantized), as DeepSeek-V4 ships its experts."""
    blocks, scales = mxfp4_quantized(weight)
    rows, cols = weight.shape
    exponent = scales.to(torch.int32) - 127
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(rows, cols).long()
    table = torch.tensor(FP4_MAGNITUDES + tuple(-m for m in FP4_MAGNITUDES))
    value = torch.ldexp(table[codes].reshape(rows, cols // V4_FP4_GROUP, V4_FP4_GROUP), exponent[..., None])
    return blocks.reshape(rows, cols // 2).view(torch.int8), e8m0(exponent), value.reshape(rows, cols)


def save_deepseek_v4_folders(lm, folder: str) -> dict:
    """DeepSeek-V4 as released: ``folder``'s weights replaced by their FP8 / FP4 values, and ``<folder>_fp8`` the same
    model with those weights quantized (``<name>.scale`` beside each, ue8m0; quantization_config fp8, expert_dtype
    fp4), read back by transformers (its CPU dequantization) into the same tensors, recorded."""
    import re

    import transformers
    from safetensors.torch import load_file, save_file

    tensors, quantized = load_file(os.path.join(folder, "model.safetensors")), {}
    for key, tensor in tensors.items():
        kind = v4_fp4 if re.fullmatch(V4_FP4, key) else v4_fp8 if re.fullmatch(V4_FP8, key) else None
        if kind is None:
            quantized[key] = tensor
            continue
        quantized[key], quantized[key[:-len("weight")] + "scale"], tensors[key] = kind(tensor)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    fp8_folder = folder + "_fp8"
    shutil.copytree(folder, fp8_folder)
    save_file(quantized, os.path.join(fp8_folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(V4_FP8_BLOCK), "scale_fmt": "ue8m0",
                                     "expert_dtype": "fp4"}
    with open(os.path.join(fp8_folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    plain, read = (transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
                   for path in (folder, fp8_folder))
    return {"fp8_folder": os.path.basename(fp8_folder), "fp8_block": list(V4_FP8_BLOCK),
            "fp8_read_by_transformers_equal": set(plain) == set(read) and all(
                torch.equal(plain[k], read[k].to(plain[k].dtype)) for k in plain)}


# the quantized releases' folders, written beside the model's own (each returns its reference case's fields)
AS_RELEASED = {"gpt_oss": lambda lm, folder: save_gpt_oss_mxfp4_folder(folder, folder + "_mxfp4"),
               "kimi_k25": save_kimi_folders, "glm_moe_dsa": save_with_prediction_layer,
               "deepseek_v32": lambda lm, folder: save_deepseek_folders(lm, folder, folder + "_fp8"),
               "deepseek_v4": save_deepseek_v4_folders}


def draw_values(lm, kind: str) -> None:
    """Values that count for the tensors transformers starts at 0 or 1 (biases, norms, routers, ...)."""
    # biases (Qwen2's q/k/v) start at zero, norms at one: give them values that count
    for key, tensor in lm.named_parameters():
        if key.endswith(("proj.bias", "indexer.k_norm.bias")):  # (GLM-5's indexer's key LayerNorm)
            tensor.normal_(0.0, 0.5)
        elif key.endswith(("q_norm.weight", "k_norm.weight", "a_layernorm.weight")):
            tensor.uniform_(0.5, 1.5)
        elif key.endswith(("mlp.gate.weight", "moe.gate.weight", "router.weight")):  # a router far from uniform
            tensor.normal_(0.0, 0.3)
        elif kind == "gpt_oss" and gpt_oss_spread(key):  # gpt-oss's sinks, router bias and experts
            tensor.normal_(0.0, gpt_oss_spread(key))
        elif kind == "deepseek_v4":
            draw_deepseek_v4(key, tensor)
        elif kind in OFFSET_NORMS and key.endswith(("layernorm.weight", "language_model.norm.weight")) or (
                kind == "qwen3_next" and key == "model.norm.weight"):
            tensor.normal_(0.0, 0.3)  # Qwen3.5's norms scale by 1 + weight: zeros at first
        elif key.endswith(("linear_attn.norm.weight", "dt_bias")):
            tensor.uniform_(0.5, 1.5)
    for key, tensor in lm.named_buffers():  # GLM's choice-only bias: big enough to change choices
        if key.endswith("e_score_correction_bias"):
            tensor.normal_(0.0, 0.3)
        elif key.endswith("tid2eid"):  # DeepSeek-V4's hash routing: distinct experts per token id
            tensor.copy_(torch.stack([torch.randperm(EXPERTS)[:tensor.shape[1]] for _ in range(tensor.shape[0])]))


def draw_deepseek_v4(key: str, tensor: torch.Tensor) -> None:
    """A DeepSeek-V4 tensor transformers starts at 0 or 1 given values that count (DEEPSEEK_V4_SPREAD; its norms
    and the hyper-connections' scales around 1)."""
    spread = next((spread for end, spread in DEEPSEEK_V4_SPREAD.items() if key.endswith(end)), 0.0)
    if spread:
        tensor.normal_(0.0, spread)
    elif key.endswith(("norm.weight", "hc.scale", "hc_head.hc_scale")):
        tensor.uniform_(0.5, 1.5)


def recorded_choices(backbone, kind: str) -> list:
    """A list to which each forward appends, per block of a sparse-attention family, the keys its indexer kept
    for each query (those at or before it, sorted; the list's last item is the forward's own list)."""
    kept = []
    for layer in backbone.layers if kind in SPARSE_ATTENTION else ():
        layer.self_attn.indexer.register_forward_hook(lambda module, args, out: kept[-1].append(
            [sorted(k for k in keys if k <= query) for query, keys in enumerate(out[0].tolist())]))
    return kept


def sparse_attention_case(kind: str, kept: list) -> dict:
    """What a sparse-attention family's case records beside the logits: the keys kept, per row and block."""
    return {"kept": kept, "index_topk": INDEX_TOPK} if kind in SPARSE_ATTENTION else {}


def label_word_ids(tokenizer, word: str) -> list:
    """A label word's tokens as dist_eval documents them (its backends/zeroshot.py): after a space in running text,
    those of "a " + word after those of "a", without special tokens."""
    anchor = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a " + word, add_special_tokens=False)["input_ids"]
    assert full[:len(anchor)] == anchor, (word, full, anchor)
    return full[len(anchor):]


def label_words_case(kind: str, lm, tokenizer, ids: list) -> dict:
    """A zero-shot case's fields (LABEL_WORDS_CASES): the words, their tokens and, per row and word, the summed
    log-probabilities of the word's tokens after the row (its ids, BOS included) under the causal LM ``lm``'s own
    logits, one forward per row and word with the word's tokens appended."""
    if kind not in LABEL_WORDS_CASES:
        return {}
    words = [label_word_ids(tokenizer, word) for word in LABEL_WORDS]
    scores = []
    with torch.no_grad():
        for row in ids:
            scores.append([])
            for word in words:
                log_probs = lm(input_ids=torch.tensor([row + word[:-1]])).logits[0].float().log_softmax(-1)
                scores[-1].append(sum(float(log_probs[len(row) - 1 + j, t]) for j, t in enumerate(word)))
    return {"label_words": LABEL_WORDS, "label_word_ids": words, "logits_label_words": scores}


def make(kind: str, out: str) -> dict:
    import transformers
    from safetensors.torch import save_file

    folder = os.path.join(out, kind)
    tokenizer = tokenizer_of(kind)
    config = config_of(kind, len(tokenizer), tokenizer.pad_token_id)
    torch.manual_seed(0)
    name = CLASSES[kind]
    lm_class = f"{name}ForConditionalGeneration" if kind in VISION_LANGUAGE else f"{name}ForCausalLM"
    lm = getattr(transformers, lm_class)(config).eval()
    with torch.no_grad():
        draw_values(lm, kind)
    lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if kind in ("qwen3_5", "qwen3_5_moe"):  # a trainer's save of the release's text model: AutoModelForCausalLM's
        getattr(transformers, f"{name}ForCausalLM").from_pretrained(folder).save_pretrained(folder + "_text")
        tokenizer.save_pretrained(folder + "_text")
    if kind == "minimax_m2":
        save_minimax_fp8_folder(lm, folder, folder + "_fp8")
    released = AS_RELEASED.get(kind, lambda lm, folder: {})(lm, folder)  # a quantized release's folder too
    if kind == "deepseek_v3":
        save_deepseek_folders(lm, folder, folder + "_fp8")
        save_as_kimi(folder, os.path.join(out, "kimi_k2"))
    g = torch.Generator().manual_seed(1)
    trainable = {"score.weight": torch.randn(NUM_LABELS, HIDDEN, generator=g),
                 "prompt_embeddings.weight": torch.randn(PRE_SEQ_LEN, HIDDEN, generator=g)}
    save_file(trainable, os.path.join(out, f"{kind}.trainable.safetensors"))
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    ids = [loaded(text)["input_ids"] for text in CORPUS]
    causal = None  # the causal LM, where the backbone is its (its head scores label words: LABEL_WORDS_CASES)
    if kind in VISION_LANGUAGE:
        backbone = getattr(transformers, lm_class).from_pretrained(folder).eval().model.language_model
        score = lambda hidden: hidden @ trainable["score.weight"].T  # noqa: E731
    elif kind in NO_CLASSIFIER:
        causal = getattr(transformers, f"{name}ForCausalLM").from_pretrained(folder).eval()
        backbone = causal.model
        score = lambda hidden: hidden @ trainable["score.weight"].T  # noqa: E731
    else:
        clf = getattr(transformers, f"{name}ForSequenceClassification").from_pretrained(folder, num_labels=NUM_LABELS)
        clf.score.weight.data.copy_(trainable["score.weight"])
        backbone, score = clf.eval().base_model, clf.score
    head, ptune, kept = [], [], recorded_choices(backbone, kind)
    with torch.no_grad():
        for row in ids:
            x = torch.tensor([row])
            kept.append([])
            head.append(score(backbone(input_ids=x).last_hidden_state[0, -1]).tolist())
            embeds = torch.cat([trainable["prompt_embeddings.weight"][None], backbone.get_input_embeddings()(x)], dim=1)
            if kind in HASH_ROUTED:  # no token id at a prompt position: dist_eval refuses ptune there
                ptune.append(None)
                continue
            kept.append([])  # the prompted forward's, not kept
            hidden = backbone(inputs_embeds=embeds).last_hidden_state[0, -1]
            kept.pop()
            ptune.append(score(hidden).tolist())
    return {"folder": kind, "class": type(loaded).__name__, "ids": ids, "logits_head": head, "logits_ptune": ptune,
            "pad_token_id": tokenizer.pad_token_id, "num_labels": NUM_LABELS, "pre_seq_len": PRE_SEQ_LEN, **released,
            **({"fp8_folder": kind + "_fp8", "fp8_block": list(FP8_BLOCK)}
               if kind in ("deepseek_v3", "minimax_m2") else {}), **sparse_attention_case(kind, kept),
            **label_words_case(kind, causal, loaded, ids)}


def main(out: str) -> None:
    import tokenizers
    import transformers

    os.makedirs(out, exist_ok=True)
    # one thread: on models this small, threads only wait on each other (on the 2-core test machine,
    # busy, the mixtures' index_add_ took 22 ms a call with two: 42 s of the makes, 9 s with one)
    torch.set_num_threads(1)
    # the families of a later transformers than this one (Qwen3.5: 5.2 on) are made by the later one alone
    major = int(transformers.__version__.split(".")[0])
    cases = {kind: make(kind, out) for kind, name in CLASSES.items()
             if hasattr(transformers, f"{name}Config") and major >= LATER.get(kind, 0)}
    cases["kimi_k2"] = {**cases["deepseek_v3"], "folder": "kimi_k2"}  # DeepSeek-V3's block, numbers, prompts + head
    shutil.copyfile(os.path.join(out, "deepseek_v3.trainable.safetensors"),
                    os.path.join(out, "kimi_k2.trainable.safetensors"))
    result = {"versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                           "torch": torch.__version__}, "corpus": CORPUS, "cases": cases,
              "sparse_layers": sparse_layers()}
    with open(os.path.join(out, "reference.json.tmp"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)
    os.replace(os.path.join(out, "reference.json.tmp"), os.path.join(out, "reference.json"))


if __name__ == "__main__":
    main(sys.argv[1])
