"""dist_eval.backends.zeroshot: label words scored by the causal LM, against an independent
reference (transformers' ``*ForCausalLM`` run on each row + word, its log-softmax gathered at
the word's tokens), for every family, with and without ptune prompts; through evaluate()
with a template; and the bad inputs (wrong count of words, unknown words, a template without
{text}, a head given with label words). Petals on a real swarm: test_backends_zeroshot_swarm.py."""
import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import build_checkpoint, build_tiny_model
from float_promises import assert_same_bits, assert_within_rounding

from dist_eval.backends import load_model
from dist_eval.backends.compat import configs_are_dataclasses
from dist_eval.backends.families import FAMILIES
from dist_eval.errors import UsageError
from dist_eval.ranks import RankFailure

BY_TRANSFORMERS = "another implementation: the causal LM's log-probabilities computed with transformers directly"

# one single-token word, two sharing their first token, one of three tokens: 3 forwards
WORDS = ["w1", "w2 w5", "w2 w9", "w3 w4 w6"]
TEXTS = ["w10", "w11 w12 w13 w14", "w15 w16", "w17 w18 w19 w20 w21 w22 w23"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_models")
    return {f: build_tiny_model(str(root / f), family=f) for f in FAMILIES}


# the families whose tiny folder here (dist_eval's save, its config class's fields) transformers 5.x's own classes
# read as another model: its causal LM there is dist_eval's class, as on the pinned stack, where AutoModelForCausalLM
# gives it (4.33 has none of them). 5.x's config fills what the save leaves out with its own defaults: DeepSeek-V3's
# rope_interleave, routed_scaling_factor 2.5, norm_topk_prob; V3.2's and GLM-5's head_dim from qk_rope_head_dim (4
# for the saved 8); gpt-oss's yarn RoPE (factor 32) for the saved default RoPE, swiglu_limit 7.0; Qwen3.5's and
# Kimi K2.5's configs are their multimodal ones (the text model's fields under text_config; Kimi's does not read
# this one at all); 5.x's Auto class of llama4_text is Llama4ForCausalLM; DeepSeek-V4's head is head.weight there.
# Each family's blocks against 5.x's own classes on folders 5.x made: tests/test_families_reference.py
READ_OTHERWISE_BY_5X = ("deepseek_v3", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "gpt_oss", "kimi_k25",
                        "llama4_text", "qwen3_5", "qwen3_5_moe")


def tokenizer_of(folder):
    """The folder's tokenizer as saved (its tokenizer.json): 5.x's AutoTokenizer would build the config's family's
    own class from the word-level vocabulary instead (Qwen2's, Qwen3.5's: no id at all for these words)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


def reference_scores(folder, texts, words, prompts=None):
    """sum_j log p(word_j | text, word_<j) from transformers' causal LM, one row and word at a time;
    the word's tokens are those the tokenizer gives the text followed by a space and the word."""
    import transformers

    with open(os.path.join(folder, "config.json")) as f:  # 5.x's AutoConfig cannot read Kimi K2.5's text config
        model_type = json.load(f)["model_type"]
    if model_type in READ_OTHERWISE_BY_5X and configs_are_dataclasses():
        from dist_eval.backends.blocks import family_class

        lm_class = family_class(FAMILIES[model_type].local_lm_class, in_petals=False)
    else:
        lm_class = transformers.AutoModelForCausalLM
    lm = lm_class.from_pretrained(folder, torch_dtype=torch.float32).eval()
    assert type(lm).__name__ == FAMILIES[model_type].local_lm_class
    tok = tokenizer_of(folder)
    out = np.zeros((len(texts), len(words)), dtype=np.float64)
    with torch.no_grad():
        for i, text in enumerate(texts):
            context = tok(text)["input_ids"]
            for k, word in enumerate(words):
                full = tok(text + " " + word)["input_ids"]
                assert full[: len(context)] == context
                continuation = full[len(context):]
                if prompts is None:  # the model's own path from token ids (DeepSeek-V4's hash routing reads them)
                    log_probs = lm(input_ids=torch.tensor([full])).logits[0]
                else:
                    embeds = lm.get_input_embeddings()(torch.tensor([full]))
                    embeds = torch.cat([prompts.unsqueeze(0), embeds], dim=1)
                    log_probs = lm(inputs_embeds=embeds).logits[0, len(prompts):]
                log_probs = log_probs.log_softmax(-1)
                out[i, k] = sum(float(log_probs[len(context) - 1 + j, t]) for j, t in enumerate(continuation))
    return out


def padded(folder, texts):
    tok = tokenizer_of(folder)
    ids = [tok(t)["input_ids"] for t in texts]
    batch = torch.zeros((len(ids), max(map(len, ids))), dtype=torch.long)  # pad id 0
    for i, row in enumerate(ids):
        batch[i, : len(row)] = torch.tensor(row)
    return batch


# (DeepSeek-V4's folder here is dist_eval's own save, lm_head.weight; its head as released and as transformers 5.x
# saves it, head.weight, against 5.23's own causal LM: tests/test_families_reference.py)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_local_equals_the_causal_lm_reference(models, family):
    model = load_model("local", models[family], label_words=WORDS)
    assert model.num_labels == 4 and model.label_words == tuple(WORDS) and model.appended_tokens == 2
    with torch.no_grad():
        logits = model.module(padded(models[family], TEXTS))
    assert logits.dtype == torch.float32 and logits.shape == (4, 4)
    assert_within_rounding(logits, reference_scores(models[family], TEXTS, WORDS),
                           f"{family}: the scores, against the reference", why=BY_TRANSFORMERS)
    # a row alone gives the same logits as in a padded batch (right padding, causal attention)
    with torch.no_grad():
        alone = model.module(padded(models[family], TEXTS[:1]))
    assert_within_rounding(alone, logits[:1], f"{family}: a row alone, against the same row in a batch",
                           why="another batch: the row alone, unpadded, against the row in a padded batch of 4")


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_ptune_prompts_are_used_and_the_head_is_not(models, family, tmp_path, capsys):
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode="ptune", pre_seq_len=3)
    model = load_model("local", models[family], checkpoint=checkpoint, label_words=WORDS)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "classifier head is not used" in err
    prompts = torch.load(checkpoint, weights_only=True)["state_dict"]["prompt_embeddings.weight"]
    with torch.no_grad():
        logits = model.module(padded(models[family], TEXTS))
    expected = reference_scores(models[family], TEXTS, WORDS, prompts=prompts)
    assert_within_rounding(logits.numpy(), expected, f"{family}: the scores with prompts, against the reference",
                           why=BY_TRANSFORMERS)
    assert model.prompt_tokens == 3
    assert not np.allclose(expected, reference_scores(models[family], TEXTS, WORDS), atol=1e-3)  # prompts matter


def test_evaluate_applies_the_template(models):
    import datasets
    from sklearn.metrics import accuracy_score

    from dist_eval.evaluation import evaluate

    folder = models["llama"]
    data = datasets.Dataset.from_dict({"text": TEXTS, "label": [0, 1, 3, 2]})
    template = "w40 {text} w41"
    model = load_model("local", folder, label_words=WORDS)
    result = evaluate(model, data, tokenizer=tokenizer_of(folder), template=template, batch_size=3,
                      return_logits=True, bootstrap_resamples=0)
    expected = reference_scores(folder, [template.replace("{text}", t) for t in TEXTS], WORDS)
    assert_within_rounding(result.predictions.logits, expected, "the scores with a template, against the reference",
                           why=BY_TRANSFORMERS)
    assert list(result.predictions.preds) == list(expected.argmax(1))
    assert result.metrics["accuracy"] == pytest.approx(accuracy_score([0, 1, 3, 2], expected.argmax(1)))
    with pytest.raises(UsageError, match=r"label_words=\['a', 'b', 'c', 'd'\]: the model was loaded to score"):
        evaluate(model, data, tokenizer=tokenizer_of(folder), label_words=["a", "b", "c", "d"])


def test_label_words_from_a_file(models, tmp_path):
    (tmp_path / "words.txt").write_text("\n".join(WORDS) + "\n\n")
    model = load_model("local", models["llama"], label_words="@" + str(tmp_path / "words.txt"))
    assert model.label_words == tuple(WORDS)


def test_bad_label_words(models, tmp_path):
    import datasets

    from dist_eval.evaluation import evaluate

    folder = models["llama"]
    cases = [
        (dict(label_words=["w1"]), r"label_words=\['w1'\]: expected one word per class, at least 2; got 1"),
        (dict(label_words=["w1", "w1"]), r"\['w1'\] given for more than one class"),
        (dict(label_words=["w1", "nope"]), r"the word 'nope' is the unknown token 1 to the tokenizer"),
        (dict(label_words=["w1", "w2"], num_labels=3), r"label_words=\['w1', 'w2'\]: 2 words given, one per class, "
                                                       r"but num_labels is 3"),
        (dict(label_words=["w1", "w2"], checkpoint="c.pt", head="h.pt"), r"head='h.pt': not used with label words"),
        (dict(label_words="@" + str(tmp_path / "missing.txt")), r"cannot read the file of label words"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(UsageError, match=pattern):
            load_model("local", folder, **kwargs)
    model = load_model("local", folder, label_words=["w1", "w2"])
    data = datasets.Dataset.from_dict({"text": TEXTS, "label": [0, 1, 2, 1]})
    with pytest.raises(RankFailure, match=r"label_words=\['w1', 'w2'\]: 2 words given, one per class \(ids 0..1\), "
                                         r"but the data does not fit them: row 2 has label 2 \(column 'label'\)"):
        evaluate(model, data, tokenizer=tokenizer_of(folder))
    with pytest.raises(UsageError, match=r"template='Review: text': expected a text with the placeholder \{text\}"):
        evaluate(model, data, tokenizer=tokenizer_of(folder), template="Review: text")


def test_a_folder_without_an_lm_head_is_refused(tmp_path):
    folder = build_tiny_model(str(tmp_path / "seq_cls"), layout="seq_cls")  # llama: an untied head, not saved
    with pytest.raises(UsageError, match=r"holds no language-model head \('lm_head.weight'\)"):
        load_model("local", folder, label_words=["w1", "w2"])


def test_word_tokens_are_those_after_a_space():
    """A byte-level BPE tokenizer: 'great' is scored as the token it has in '... great', not as
    the token of 'great' at the start of a text."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from dist_eval.backends.zeroshot import label_word_tokens

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["it was great", "great fun", "it was awful", "awful stuff"] * 20, vocab_size=300,
                            min_frequency=1, special_tokens=["<pad>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>")
    scored = label_word_tokens(tok, ["great", "awful"], tok.pad_token_id)
    for word, ids in zip(["great", "awful"], scored.token_ids):
        in_context = tok(f"it was {word}")["input_ids"][len(tok("it was")["input_ids"]):]
        assert list(ids) == in_context != tok(word)["input_ids"]


def test_cli_settings_name_the_flags(models, tmp_path):
    from dist_eval.config import EvalConfig
    from dist_eval.errors import flag_names

    data = str(tmp_path / "d.csv")
    base = dict(model=models["llama"], data_files=[data], backend="local")
    cases = [
        (dict(label_words=["w1", "w2"], num_labels=3),
         r"^--label-words w1 w2: 2 words given, one per class, but --num-labels is 3\. Give 3 words"),
        (dict(label_words=["w1", "w2"], head="h.pt"), r"^--head h.pt: not used with --label-words"),
        (dict(template="{text} {text_pair}"), r"^--template \{text\} \{text_pair\}: \{text_pair\} must be in it "
                                              r"exactly when there is a text pair column; drop \{text_pair\}"),
    ]
    with flag_names():
        for extra, pattern in cases:
            with pytest.raises(UsageError) as caught:
                EvalConfig(**base, **extra)
            assert re.search(pattern, str(caught.value)), str(caught.value)
        config = EvalConfig(**base, label_words=["w1", "w2"], template="w3 {text}")
    assert config.settings.label_words == ("w1", "w2") and config.settings.template == "w3 {text}"


def test_swapping_prompt_checkpoints_equals_loading_each(models, tmp_path):
    """Several --checkpoint with --label-words: the loaded scorer takes each one's prompts in place, read
    as load_model read the first's (its label words included: swap_checkpoint, as the CLI swaps them)."""
    from dist_eval.backends.classifier import swap_checkpoint

    folder = models["llama"]
    first, second = (build_checkpoint(str(tmp_path / f"ck{s}.pt"), tuning_mode="ptune", seed=s) for s in (1, 2))
    model = load_model("local", folder, checkpoint=first, label_words=WORDS)
    swap_checkpoint(model, second)
    assert model.checkpoint == second
    fresh = load_model("local", folder, checkpoint=second, label_words=WORDS)
    with torch.no_grad():
        assert_same_bits(model.module(padded(folder, TEXTS)), fresh.module(padded(folder, TEXTS)),
                         "the scores, the prompts swapped in against loaded")


def test_deepseek_v4s_head_is_read_as_released(models, tmp_path):
    """DeepSeek-V4's LM head saved as released and as transformers 5.x saves it (``head.weight``, not
    ``lm_head.weight``): read into the causal LM's lm_head, the scores those of the same model saved with
    lm_head.weight bit for bit; into a head petals' client left on the meta device too (read_saved_lm_head)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from torch import nn
    from transformers import AutoConfig

    from dist_eval.backends.zeroshot import read_saved_lm_head

    released = tmp_path / "released"
    shutil.copytree(models["deepseek_v4"], released)
    tensors = load_file(str(released / "model.safetensors"))
    tensors["head.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, str(released / "model.safetensors"), metadata={"format": "pt"})
    scores = []
    for folder in (models["deepseek_v4"], str(released)):
        with torch.no_grad():
            scores.append(load_model("local", folder, label_words=WORDS).module(padded(folder, TEXTS)))
    assert_same_bits(scores[1], scores[0], "the scores, the head read from head.weight against lm_head.weight")
    config = AutoConfig.from_pretrained(str(released))
    unread = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
    read_saved_lm_head(unread, str(released), config, FAMILIES["deepseek_v4"])
    assert not unread.weight.is_meta and torch.equal(unread.weight, tensors["head.weight"])
