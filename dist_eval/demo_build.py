"""Makes the built-in demo's shipped assets: ``python -m dist_eval.demo_build [FAMILY ...]``.

Trains, on the CPU, each family's small causal LM on the demo's train texts and prompt-tunes
its prompts and head (:mod:`dist_eval.demo` describes the task and the files), then writes
``dist_eval/demo_assets/<family>/`` (``model/``, ``checkpoint.pt``, ``manifest.json``), which
the package ships. Run it after changing this file, a module it builds through (:data:`BUILD_MODULES`)
or a family's ``small_config`` (a test fails until the assets are made again: the manifest records
:func:`build_fingerprint`), then commit the new assets. The bits of a build differ by CPU instruction
set, so the assets are made once and shipped rather than built on each user's machine.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from typing import Callable, List, Optional, Sequence

from dist_eval.demo import (
    BOS,
    EOS,
    FILLER,
    LABEL_NAMES,
    MANIFEST,
    NUM_LABELS,
    PAD,
    PAD_ID,
    PRE_SEQ_LEN,
    SEED,
    SHIPPED_DIR,
    UNK,
    data_sha256,
    file_sha256,
    make_dataset,
    topic_words,
)

# Fixed during the build, so the weights do not depend on the caller's thread setting. One
# thread: a little slower on idle cores, but two threads slow down far more than one when
# the cores are busy with other work (OpenMP spin-waits).
BUILD_THREADS = 1
EPOCHS = (6, 4)  # causal-LM pre-training, then prompt tuning


# The modules of dist_eval the build goes through, each read whole into the fingerprint: every module this
# file imports from, the one that defines each name it imports, and every other whose code runs while it
# builds (tests/test_demo.py checks both against the imports and a traced build): the demo's data and
# constants, the token ids' padding, the family table, the blocks of families newer than the pinned
# transformers and what they compute with (RoPE, dist_eval's own layers), config.json's forms and the patches
# that apply them, the models' initialization (compat), the prompt-tuned classifier it trains, the checkpoint
# it writes, the local model that measures the accuracy the manifest records (its loading), the digests.
BUILD_MODULES = (
    "dist_eval.demo", "dist_eval.data.tokenize", "dist_eval.backends", "dist_eval.backends.families",
    "dist_eval.backends.blocks", "dist_eval.backends.rope", "dist_eval.backends.layers",
    "dist_eval.backends.config_json", "dist_eval.backends.petals.shims", "dist_eval.backends.compat",
    "dist_eval.backends.local", "dist_eval.backends.checkpoint", "dist_eval.backends.classifier",
    "dist_eval.backends.kinds", "dist_eval.backends.petals_folder", "dist_eval.atomic",
)


def module_source(module: str) -> bytes:
    """The source of a module of dist_eval (a package: its ``__init__.py``), read from this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, *module.split("."))
    with open(os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py", "rb") as f:
        return f.read()


def build_fingerprint(family: str, source: Callable[[str], bytes] = module_source) -> str:
    """What the assets of ``family`` are made from: this file's source, that of every module of
    :data:`BUILD_MODULES` (``source(module)``) and the family's small config (a change of any makes
    other assets).
    """
    from dist_eval.backends.families import FAMILIES

    digest = hashlib.sha256()
    digest.update(source("dist_eval.demo_build"))
    for module in BUILD_MODULES:
        digest.update(f"\0{module}\0".encode())
        digest.update(source(module))
    digest.update(json.dumps(dict(FAMILIES[family].small_config), sort_keys=True, default=str).encode())
    return digest.hexdigest()


def build(root: str, family: str, log=print, epochs: Sequence[int] = EPOCHS, train_rows: Optional[int] = None) -> dict:
    """Train ``family``'s demo model and prompts and write them into ``root`` (an empty folder):
    ``model/``, ``checkpoint.pt`` and ``manifest.json`` (returned). ``epochs`` and ``train_rows``
    (the first rows of the train split) make a quick build for tests; the shipped one uses neither.
    """
    import torch
    import transformers

    from dist_eval.backends import load_model

    log(f"building the demo of the family {family} in {root} ...")
    started = time.perf_counter()
    model_dir, checkpoint = os.path.join(root, "model"), os.path.join(root, "checkpoint.pt")
    with _build_environment():
        dataset = make_dataset()
        tokenizer, (train_ids, train_labels), (test_ids, test_labels) = _build_data(dataset, model_dir, log)
        train_ids, train_labels = train_ids[:train_rows], train_labels[:train_rows]
        torch.manual_seed(SEED)
        rng = random.Random(SEED)
        config, architecture = _build_base_model(model_dir, tokenizer, train_ids, rng, log, family, epochs[0])
        _build_checkpoint(model_dir, checkpoint, config, train_ids, train_labels, rng, log, family, epochs[1])
        # Accuracy of what was saved, loaded back the way the evaluator loads it.
        loaded = load_model("local", model_dir, checkpoint=checkpoint)
        test_accuracy = _accuracy(loaded.module, test_ids, test_labels)
        train_accuracy = _accuracy(loaded.module, train_ids, train_labels)
    seconds = time.perf_counter() - started
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, root)] = file_sha256(path)
    manifest = {
        "family": family,
        "seed": SEED,
        "label_names": list(LABEL_NAMES),
        "num_labels": NUM_LABELS,
        "tuning_mode": "ptune",
        "pre_seq_len": PRE_SEQ_LEN,
        "splits": {"train": len(train_ids), "test": len(test_ids)},
        "model": {
            "architecture": architecture,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size,
        },
        "accuracy": {"test": test_accuracy, "train": train_accuracy, "backend": "local"},
        "build_seconds": round(seconds, 2),
        "built_with": {"torch": torch.__version__, "transformers": transformers.__version__, "threads": BUILD_THREADS,
                       "epochs": list(epochs)},
        "build_fingerprint": build_fingerprint(family),
        "data_sha256": data_sha256(dataset),
        "files": dict(sorted(files.items())),
    }
    with open(os.path.join(root, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    log(f"  demo of {family} built: test accuracy {test_accuracy:.4f} (local model), in {seconds:.1f} s")
    if test_accuracy <= 0.9:
        log(f"  warning: the demo model reached only {test_accuracy:.4f} test accuracy (expected > 0.90)")
    return manifest


def main(argv: Optional[List[str]] = None) -> int:
    """Build the named families' assets (default: every family already shipped) into the package."""
    from dist_eval.backends.families import FAMILIES
    from dist_eval.demo import shipped_families

    parser = argparse.ArgumentParser(prog="python -m dist_eval.demo_build", description=main.__doc__)
    parser.add_argument("families", nargs="*", metavar="FAMILY",
                        help=f"model_type of a family ({', '.join(sorted(FAMILIES))}); default: every shipped one")
    args = parser.parse_args(argv)
    families = args.families or shipped_families()
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"FAMILY {', '.join(unknown)}: expected one of {', '.join(sorted(FAMILIES))}")
    os.makedirs(SHIPPED_DIR, exist_ok=True)
    for family in families:
        tmp = tempfile.mkdtemp(prefix=f".{family}.tmp-", dir=SHIPPED_DIR)
        try:
            os.chmod(tmp, 0o755)
            build(tmp, family)
            final = os.path.join(SHIPPED_DIR, family)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return 0


# ---------------------------------------------------------------------------- tokenizer


def _make_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = topic_words()
    vocab_words = [PAD, UNK, BOS, EOS] + FILLER + [w for name in LABEL_NAMES for w in words[name]]
    vocab = {word: index for index, word in enumerate(vocab_words)}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = Whitespace()
    # No post-processor: nothing is added around the text, so pad (id 0) never occurs in it.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="right",
        model_max_length=128,
    )


# ---------------------------------------------------------------------------- training


def _length_batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> List[List[int]]:
    """Batches of rows of similar length (little padding), in a seeded random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def _pretrain_lm(model, train_ids: List[List[int]], rng: random.Random, log, epochs: int) -> None:
    """Causal-LM pre-training of the whole base model on the train texts."""
    import torch

    from dist_eval.data.tokenize import right_pad

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    lengths = [len(ids) for ids in train_ids]
    batches_per_epoch = math.ceil(len(train_ids) / 32)
    total = epochs * batches_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    )
    model.train()
    for _ in range(epochs):
        total_loss, count = 0.0, 0
        for batch_rows in _length_batches(lengths, 32, rng):
            input_ids = right_pad([train_ids[i] for i in batch_rows], PAD_ID)
            labels = input_ids.masked_fill(input_ids == 0, -100)
            loss = model(input_ids=input_ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            total_loss += float(loss.detach())
            count += 1
    model.eval()
    log(f"  base model pre-trained (causal LM, {epochs} epochs): loss {total_loss / count:.3f}")


def _prompt_tune(clf, train_ids, train_labels, rng: random.Random, log, epochs: int) -> None:
    """Train only the prompt embeddings and the score head; the base model is frozen."""
    import torch

    from dist_eval.data.tokenize import right_pad

    for param in clf.parameters():
        param.requires_grad_(False)
    trainable = [clf.prompt_embeddings.weight, clf.hf_model.score.weight]
    for param in trainable:
        param.requires_grad_(True)
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    lengths = [len(ids) for ids in train_ids]
    total = epochs * math.ceil(len(train_ids) / 32)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    )
    labels_t = torch.tensor(train_labels, dtype=torch.long)
    clf.train()
    for _ in range(epochs):
        correct, total_loss, count = 0, 0.0, 0
        for batch_rows in _length_batches(lengths, 32, rng):
            input_ids = right_pad([train_ids[i] for i in batch_rows], PAD_ID)
            target = labels_t[batch_rows]
            logits = clf(input_ids)
            loss = torch.nn.functional.cross_entropy(logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total_loss += float(loss.detach()) * len(batch_rows)
            correct += int((logits.argmax(-1) == target).sum())
            count += len(batch_rows)
    clf.eval()
    log(
        f"  prompts + head tuned ({epochs} epochs): train loss {total_loss / count:.3f}, "
        f"train accuracy {correct / count:.3f}"
    )


def _accuracy(module, ids: List[List[int]], labels: List[int], batch_size: int = 64) -> float:
    import torch

    from dist_eval.data.tokenize import right_pad

    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    correct = 0
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            logits = module(right_pad([ids[i] for i in rows], PAD_ID))
            correct += int((logits.argmax(-1) == torch.tensor([labels[i] for i in rows])).sum())
    return correct / len(ids)


@contextlib.contextmanager
def _build_environment():
    """Fixed threads and seeds, no progress bars, quiet transformers; all restored afterwards."""
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    verbosity = hf_logging.get_verbosity()
    rng_state = torch.get_rng_state()
    bars_were_disabled = datasets.are_progress_bars_disabled()
    torch.set_num_threads(BUILD_THREADS)
    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        torch.set_rng_state(rng_state)
        if not bars_were_disabled:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                datasets.enable_progress_bars()


def _build_data(dataset, model_dir: str, log):
    """The tokenizer (saved in ``model_dir``) and the token ids of the demo's data:
    (tokenizer, (train ids, labels), (test ids, labels)).
    """
    tokenizer = _make_tokenizer()
    tokenizer.save_pretrained(model_dir)

    def encode(texts):
        return tokenizer(list(texts), add_special_tokens=True)["input_ids"]

    train_ids, test_ids = encode(dataset["train"]["text"]), encode(dataset["test"]["text"])
    for ids in train_ids + test_ids:
        if not ids or PAD_ID in ids or tokenizer.unk_token_id in ids:
            raise RuntimeError("demo tokenizer produced an empty, pad or unknown token for demo text")
    train_labels, test_labels = list(dataset["train"]["label"]), list(dataset["test"]["label"])
    log(
        f"  data: {len(train_ids)} train / {len(test_ids)} test sentences, {NUM_LABELS} topics, "
        f"vocabulary {len(tokenizer)}"
    )
    return tokenizer, (train_ids, train_labels), (test_ids, test_labels)


def _build_base_model(model_dir: str, tokenizer, train_ids, rng: random.Random, log, family: str,
                      epochs: int):
    """The causal LM, pre-trained on the train texts and saved: (its config, its class name)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dist_eval.backends.blocks import register
    from dist_eval.backends.families import FAMILIES

    register()  # the classes of the families newer than the pinned transformers
    config = AutoConfig.for_model(
        family,
        **dict(FAMILIES[family].small_config),
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=PAD_ID,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        id2label={i: name for i, name in enumerate(LABEL_NAMES)},
        label2id={name: i for i, name in enumerate(LABEL_NAMES)},
        torch_dtype="float32",
    )
    base = AutoModelForCausalLM.from_config(config)
    _pretrain_lm(base, train_ids, rng, log, epochs)
    base.save_pretrained(model_dir, safe_serialization=True)
    return config, type(base).__name__


def _build_checkpoint(
    model_dir: str, checkpoint: str, config, train_ids, train_labels, rng: random.Random, log, family_name: str,
    epochs: int,
) -> None:
    """Prompts + head, prompt-tuned on the frozen base model, saved as the checkpoint."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from dist_eval.backends.blocks import register
    from dist_eval.backends.checkpoint import save_checkpoint
    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.local import PromptTunedClassifier

    register()
    family = FAMILIES[family_name]
    torch.manual_seed(SEED + 1)
    hf = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=NUM_LABELS, torch_dtype=torch.float32
    )
    clf = PromptTunedClassifier(hf, "ptune", PRE_SEQ_LEN, family)
    with torch.no_grad():  # start the prompts from embeddings of random vocabulary words
        picks = torch.randint(4, config.vocab_size, (PRE_SEQ_LEN,))
        clf.prompt_embeddings.weight.copy_(family.get(hf, family.embeddings).weight[picks])
    _prompt_tune(clf, train_ids, train_labels, rng, log, epochs)
    save_checkpoint(
        checkpoint,
        "ptune",
        {"prompt_embeddings.weight": clf.prompt_embeddings.weight, "score.weight": family.get(hf, family.head).weight},
    )


if __name__ == "__main__":
    sys.exit(main())
