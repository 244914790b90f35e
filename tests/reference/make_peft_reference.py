"""PEFT's own prompt-learning adapters and logits, made by a current PEFT in its own environment.

    .venv-reference5/bin/python tests/reference/make_peft_reference.py OUT [--worked-example DIR]

(``launch/install_reference.sh 5`` makes ``.venv-reference5``: transformers 5.x and a current PEFT.)

For each family of ``FAMILIES`` a tiny random model, made as ``make_reference.py`` makes it (its
tokenizer and config: hidden 64, 4 blocks; ``*ForCausalLM.save_pretrained``), and for each
``METHODS`` x ``TASKS`` an adapter drawn, not trained, and saved by PEFT's ``save_pretrained`` to
``OUT/<family>.<method>.<task>/`` (``adapter_config.json``, ``adapter_model.safetensors``):

- ``PROMPT_TUNING``: ``PromptTuningConfig`` (the prompts as PEFT draws them, ``RANDOM`` init);
- ``P_TUNING``: ``PromptEncoderConfig`` (an MLP encoder over the virtual tokens, as PEFT draws it). PEFT's
  save stores what the encoder computes (``get_prompt_embedding_to_save``, the saved config says
  ``inference_mode``), and a loaded adapter prepends those embeddings as they are
  (``get_prompt``: ``prompt_encoder.embedding.weight`` in inference mode). ``ptuning_encoder_vs_saved``
  records, per family, how far the model before the save (its encoder computing the prompts) is from
  the adapter loaded from the files;
- ``SEQ_CLS``: the classifier head (``score``, in ``modules_to_save``) drawn N(0, 1) from a seeded
  generator: transformers' init (std 0.02) would make every logit small;
- ``CAUSAL_LM``: the prompts only; the classes are scored by label words through the LM head.

``NUM_VIRTUAL_TOKENS`` prompts, ``NUM_LABELS`` classes. Then each adapter is loaded as a user loads
it, ``PeftModel.from_pretrained`` onto a base model loaded afresh (``AutoModelForSequenceClassification``
or ``AutoModelForCausalLM``), and its forward is run on each row of ``ROWS`` alone (the tokenizer's
ids, special tokens included): no padding. PEFT's ``SEQ_CLS`` forward passes ``inputs_embeds`` (the
prompts before the text) and no ``input_ids``, so transformers' head reads the last position: a row's
last token alone, a pad in a right-padded batch (``padded_batch`` records one such batch, with PEFT's
attention mask: the prompts' ones prepended). ``CAUSAL_LM``: class k's logit is the summed
log-softmax of PEFT's LM logits at label word k's tokens appended to the row (dist_eval's
``--label-words`` rule: a word's tokens are those of ``"a " + word`` after those of ``"a"``).

Beside them, the llama3 ``PROMPT_TUNING`` ``SEQ_CLS`` adapter saved again as PEFT before 0.6 saved
it (``safe_serialization=False``: ``adapter_model.bin``, in ``<name>.bin/``), and adapters of the
methods that change what the blocks compute (``REFUSED``: ``PREFIX_TUNING``, ``LORA``, ``IA3``),
saved the same way, for the refusals.

``--worked-example DIR``: DIR holds ``snippet.py`` (the PEFT snippet of
docs/models-and-checkpoints.md), the base model it names and ``val.csv``; the snippet is run there
(seed 0), then the adapter it saved is loaded as above and its per-row logits for val.csv's texts (the
base model's tokenizer's ids) go to ``DIR/peft_logits.json``.

``OUT/reference.json`` holds the numbers and the versions that made them. Nothing here imports dist_eval.
"""
import csv
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_reference  # noqa: E402 - its tiny models and tokenizers, the same code

FAMILIES = ("llama3", "qwen2", "bloom", "falcon")
METHODS = ("PROMPT_TUNING", "P_TUNING")
TASKS = ("SEQ_CLS", "CAUSAL_LM")
REFUSED = ("PREFIX_TUNING", "LORA", "IA3")
NUM_VIRTUAL_TOKENS, NUM_LABELS = 8, make_reference.NUM_LABELS
ROWS = make_reference.CORPUS[:8]
LABEL_WORDS = ("fox", "dog", "spaces")


def peft_config(method: str, task: str):
    import peft

    if method == "PROMPT_TUNING":
        return peft.PromptTuningConfig(task_type=task, num_virtual_tokens=NUM_VIRTUAL_TOKENS)
    if method == "P_TUNING":
        return peft.PromptEncoderConfig(task_type=task, num_virtual_tokens=NUM_VIRTUAL_TOKENS, encoder_hidden_size=32)
    if method == "PREFIX_TUNING":
        return peft.PrefixTuningConfig(task_type=task, num_virtual_tokens=NUM_VIRTUAL_TOKENS)
    if method == "LORA":
        return peft.LoraConfig(task_type=task, r=4, target_modules="all-linear")
    return peft.IA3Config(task_type=task, target_modules="all-linear", feedforward_modules=[])


def base_model(folder: str, task: str):
    import transformers

    if task == "SEQ_CLS":
        return transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=NUM_LABELS).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def draw_adapter(folder: str, method: str, task: str, seed: int):
    """The PEFT model of a fresh base with ``method``'s adapter as PEFT draws it, the head drawn N(0, 1)."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(base_model(folder, task), peft_config(method, task))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "modules_to_save" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=g))
    return model.eval()


def word_tokens(tokenizer, word: str) -> list:
    """dist_eval's documented rule: the tokens of ``"a " + word`` after those of ``"a"`` (no special tokens)."""
    anchor = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a " + word, add_special_tokens=False)["input_ids"]
    return full[len(anchor):] if full[:len(anchor)] == anchor else tokenizer(" " + word,
                                                                             add_special_tokens=False)["input_ids"]


def forward(model, task: str, ids: list, words: list) -> list:
    """PEFT's forward on one row alone: the classifier's logits, or each label word's summed log-probabilities."""
    with torch.no_grad():
        if task == "SEQ_CLS":
            return model(input_ids=torch.tensor([ids])).logits[0].tolist()
        scores = []
        for word in words:
            logits = model(input_ids=torch.tensor([ids + word])).logits[0]  # [prompts + row + word, vocabulary]
            start = logits.shape[0] - len(word) - 1  # the position that predicts the word's first token
            log_probs = logits[start:start + len(word)].float().log_softmax(-1)
            scores.append(sum(log_probs[j, token].item() for j, token in enumerate(word)))
        return scores


def padded_batch(model, ids: list, pad: int) -> dict:
    """PEFT's SEQ_CLS forward on the rows right-padded in one batch, with their attention mask."""
    longest = max(map(len, ids))
    batch = torch.tensor([row + [pad] * (longest - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in ids])
    with torch.no_grad():
        return {"lengths": [len(row) for row in ids], "logits": model(input_ids=batch, attention_mask=mask)
                .logits.tolist()}


def make_family(kind: str, out: str) -> dict:
    import peft
    import transformers

    folder = os.path.join(out, kind)
    tokenizer = make_reference.tokenizer_of(kind)
    config = make_reference.config_of(kind, len(tokenizer), tokenizer.pad_token_id)
    torch.manual_seed(0)
    lm = getattr(transformers, f"{make_reference.CLASSES[kind]}ForCausalLM")(config).eval()
    lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    ids = [loaded(text)["input_ids"] for text in ROWS]
    words = [word_tokens(loaded, word) for word in LABEL_WORDS]
    case = {"folder": kind, "pad_token_id": tokenizer.pad_token_id, "ids": ids, "word_ids": words, "adapters": {},
            "ptuning_encoder_vs_saved": 0.0}
    for seed, (method, task) in enumerate((m, t) for m in METHODS for t in TASKS):
        name = f"{kind}.{method}.{task}"
        drawn = draw_adapter(folder, method, task, seed)
        drawn.save_pretrained(os.path.join(out, name))
        if (kind, method, task) == ("llama3", "PROMPT_TUNING", "SEQ_CLS"):  # as PEFT before 0.6 saved it: .bin
            drawn.save_pretrained(os.path.join(out, name + ".bin"), safe_serialization=False)
        model = peft.PeftModel.from_pretrained(base_model(folder, task), os.path.join(out, name)).eval()
        logits = [forward(model, task, row, words) for row in ids]
        case["adapters"][f"{method}.{task}"] = {"folder": name, "logits": logits}
        if method == "P_TUNING":  # the encoder computing the prompts, against the saved prompts
            before = [forward(drawn, task, row, words) for row in ids]
            gap = max(abs(a - b) for x, y in zip(before, logits) for a, b in zip(x, y))
            case["ptuning_encoder_vs_saved"] = max(case["ptuning_encoder_vs_saved"], gap)
        if kind == "llama3" and (method, task) == ("PROMPT_TUNING", "SEQ_CLS"):
            case["padded_batch"] = padded_batch(model, ids, tokenizer.pad_token_id)
    return case


def make_refused(out: str) -> dict:
    """Adapters of the methods that change the blocks, saved by PEFT for the llama3 model."""
    folders = {}
    for method in REFUSED:
        name = f"llama3.{method}.SEQ_CLS"
        draw_adapter(os.path.join(out, "llama3"), method, "SEQ_CLS", 0).save_pretrained(os.path.join(out, name))
        folders[method] = name
    return folders


def worked_example(folder: str) -> None:
    """docs/models-and-checkpoints.md's PEFT snippet run in ``folder``, then its adapter's logits on val.csv."""
    import peft
    import transformers

    before = os.getcwd()
    os.chdir(folder)
    try:
        torch.manual_seed(0)
        with open("snippet.py", encoding="utf-8") as f:
            exec(compile(f.read(), "docs/models-and-checkpoints.md PEFT snippet", "exec"), {})
        with open(os.path.join("my-adapter", "adapter_config.json"), encoding="utf-8") as f:
            base = json.load(f)["base_model_name_or_path"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(base)
        model = peft.PeftModel.from_pretrained(base_model(base, "SEQ_CLS"), "my-adapter").eval()
        with open("val.csv", encoding="utf-8") as f:
            texts = [row["text"] for row in csv.DictReader(f)]
        logits = [forward(model, "SEQ_CLS", tokenizer(text)["input_ids"], []) for text in texts]
        with open("peft_logits.json", "w", encoding="utf-8") as f:
            json.dump({"logits": logits, "versions": versions()}, f)
    finally:
        os.chdir(before)


def versions() -> dict:
    import peft
    import tokenizers
    import transformers

    return {"peft": peft.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "torch": torch.__version__}


def main(argv: list) -> None:
    # one thread: on models this small, threads only wait on each other (the 2-core test machine)
    torch.set_num_threads(1)
    out = argv[0]
    if argv[1:2] == ["--worked-example"]:
        worked_example(argv[2])
    os.makedirs(out, exist_ok=True)
    result = {"versions": versions(), "num_virtual_tokens": NUM_VIRTUAL_TOKENS, "num_labels": NUM_LABELS,
              "label_words": list(LABEL_WORDS), "cases": {kind: make_family(kind, out) for kind in FAMILIES},
              "refused": make_refused(out)}
    with open(os.path.join(out, "reference.json.tmp"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)
    os.replace(os.path.join(out, "reference.json.tmp"), os.path.join(out, "reference.json"))


if __name__ == "__main__":
    main(sys.argv[1:])
