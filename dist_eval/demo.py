"""The built-in demo: a tiny prompt-tuned causal LM and a synthetic topic task, built locally.

``torchrun -m dist_eval`` with no ``--model``/``--data-files`` evaluates these assets. They
are generated here, deterministically and without any download, on the first run
(well under a minute on two CPU cores) and cached in ``<cache>/demo-v{DEMO_VERSION}/``
(the embedded default family, :data:`dist_eval.backends.families.DEMO_FAMILY`) or
``<cache>/demo-v{DEMO_VERSION}-<family>/`` (``--demo-family``: the same task, data, sizes
and training on a model of another family petals serves):

- ``data/``: a ``DatasetDict`` (``train``, ``test``) of English-like word sentences,
  4 to 48 words long, labelled with one of four topics (a ``ClassLabel``). A sentence's
  topic shows in the topic words it contains, mixed with shared filler words and a few
  words of another topic; train and test are drawn independently.
- ``model/``: a word-level tokenizer (``<pad>`` = 0, never produced for real text, no
  special tokens added) and a 4-layer causal LM of the demo's family (hidden size 64) pre-trained
  on the train texts with the causal-LM loss. No classifier head in it: this is what
  the Petals servers serve.
- ``checkpoint.pt``: prompt embeddings + ``score`` head, prompt-tuned (``ptune``) with the
  base model frozen, through :class:`dist_eval.backends.local.PromptTunedClassifier`,
  i.e. exactly the computation a Petals client + swarm performs. Right-padded batches
  with pad id 0 and no attention mask, as the evaluator feeds them.
- ``manifest.json``: what was built, the test accuracy of the saved assets (re-loaded
  through ``load_model("local", ...)``) and the seconds taken. Written last: a folder
  with a manifest is complete.

Several processes (torchrun ranks) may call :func:`demo_assets` at once: one builds under
an ``fcntl`` lock into a temporary folder next to the final one and renames it into
place; the others wait on the lock and then read the finished folder.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

DEMO_VERSION = 1

SEED = 20240517
LABEL_NAMES: Tuple[str, ...] = ("sports", "science", "business", "food")
NUM_LABELS = len(LABEL_NAMES)
PRE_SEQ_LEN = 8
PAD_ID = 0  # the tokenizer's <pad>, never produced for real text
NUM_TRAIN = 3000
NUM_TEST = 800
MIN_WORDS, MAX_WORDS = 4, 48
TOPIC_SHARE = (0.2, 0.45)  # share of a sentence's words drawn from its own topic
OTHER_TOPIC_RATE = 0.1  # chance that a word is a distractor from another topic (at most as many as own-topic words)
# Fixed during the build, so the weights do not depend on the caller's thread setting. One
# thread: a little slower on idle cores, but two threads slow down far more than one when
# the cores are busy with other work (OpenMP spin-waits).
BUILD_THREADS = 1

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"

_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DemoAssets:
    model_dir: str  # save_pretrained folder: the causal LM (safetensors) + config + tokenizer
    data_dir: str  # DatasetDict.save_to_disk folder with splits "train" and "test"
    checkpoint: str  # prompts + head (dist_eval.backends.checkpoint format)
    split: str = "test"
    text_column: str = "text"
    label_column: str = "label"
    num_labels: int = NUM_LABELS
    label_names: tuple = LABEL_NAMES
    tuning_mode: str = "ptune"
    pre_seq_len: int = PRE_SEQ_LEN


def default_cache_dir() -> str:
    """``$DIST_EVAL_CACHE`` if set, else ``~/.cache/dist_eval``."""
    return os.environ.get("DIST_EVAL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dist_eval")


def demo_assets(
    cache_dir: Optional[str] = None, log: Callable[[str], None] = print, family: Optional[str] = None
) -> DemoAssets:
    """Return the cached demo assets of ``family`` (a model_type; None: the default), building
    them first if absent.

    Safe when several processes call it at once: the build holds an exclusive ``fcntl``
    lock, writes into a temporary folder in the same parent and ``os.rename``s it into
    place, so no reader ever sees a half-built folder.
    """
    from dist_eval.backends.families import DEMO_FAMILY

    family = family or DEMO_FAMILY
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    name = f"demo-v{DEMO_VERSION}" + ("" if family == DEMO_FAMILY else f"-{family}")
    final = os.path.join(cache_dir, name)
    assets = _read_assets(final)
    if assets is not None:
        return assets
    os.makedirs(cache_dir, exist_ok=True)
    lock_path = os.path.join(cache_dir, f"{name}.lock")
    with open(lock_path, "a+") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("waiting for another process building the built-in demo assets ...")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            assets = _read_assets(final)  # built by another process while we waited
            if assets is not None:
                return assets
            _remove_leftovers(cache_dir, final)
            tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir)
            try:
                os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the cache is not
                _build(tmp, log, family)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    assets = _read_assets(final)
    if assets is None:  # pragma: no cover - only if the folder was removed under us
        raise RuntimeError(f"built the demo assets in {final}, but cannot read them back")
    return assets


# ---------------------------------------------------------------------------- cache


def _paths(root: str) -> Dict[str, str]:
    return {
        "model_dir": os.path.join(root, "model"),
        "data_dir": os.path.join(root, "data"),
        "checkpoint": os.path.join(root, "checkpoint.pt"),
    }


def _read_assets(root: str) -> Optional[DemoAssets]:
    try:
        with open(os.path.join(root, _MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if manifest.get("demo_version") != DEMO_VERSION:
        return None
    paths = _paths(root)
    if not all(os.path.exists(p) for p in paths.values()):
        return None
    return DemoAssets(
        **paths,
        num_labels=int(manifest["num_labels"]),
        label_names=tuple(manifest["label_names"]),
        tuning_mode=manifest["tuning_mode"],
        pre_seq_len=int(manifest["pre_seq_len"]),
    )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove_leftovers(cache_dir: str, final: str) -> None:
    """Under the lock: temp folders of crashed builds, and an incomplete final folder."""
    prefix = f".{os.path.basename(final)}.tmp-"
    for name in os.listdir(cache_dir):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)
    if os.path.lexists(final):
        if os.path.isdir(final) and not os.path.islink(final):
            shutil.rmtree(final)
        else:
            os.remove(final)


# ---------------------------------------------------------------------------- data

# Words that carry each topic. Each sentence draws most of its topic words from its own list.
_TOPIC_WORDS = {
    "sports": """team match goal coach player season league score striker keeper referee stadium
        tournament champion medal race runner sprint marathon tennis football basketball cricket
        fans trophy penalty halftime defender athlete training victory""",
    "science": """experiment theory laboratory molecule physics chemistry biology telescope galaxy
        planet energy particle research hypothesis microscope cell genome evolution atom quantum
        data researcher vaccine climate fossil orbit neuron protein equation scientist""",
    "business": """market stock investor profit revenue company shares merger startup budget
        economy bank loan interest inflation customer sales quarter earnings contract executive
        trade tax price industry supplier dividend retail factory manager""",
    "food": """recipe kitchen chef bread cheese soup flavor spice garlic onion butter oven bake
        dessert chocolate salad pasta sauce restaurant dinner breakfast lunch menu vegetables
        fruit tomato pepper honey noodles delicious""",
}

# Shared filler: function words and topic-neutral content words, common to every class.
_FILLER = """the a an of and to in on for with at by from about after before during over
    this that these those it its they their we our he she his her you your
    is was are were be been has have had will would can could should may might
    very more most some many much few new old big small good great long short early late
    today yesterday week year day time people group city country world report story news
    said says told think know make made take took give gave find found show showed
    again also still just only even really often always never sometimes here there
    first last next other another same every each""".split()


def _topic_words() -> Dict[str, List[str]]:
    words = {name: _TOPIC_WORDS[name].split() for name in LABEL_NAMES}
    all_words = [w for name in LABEL_NAMES for w in words[name]] + _FILLER
    assert len(all_words) == len(set(all_words)), "a word is listed twice"
    return words


def _sentence(rng: random.Random, label: int, topic_words: Sequence[Sequence[str]]) -> str:
    """One sentence of ``label``: some of its topic words, a few distractors from other topics
    (never more than its own topic words; a tie with one other topic makes a short sentence
    ambiguous: the task's noise), the rest shared filler, in random order.
    """
    n = rng.randint(MIN_WORDS, MAX_WORDS)
    n_topic = max(2, round(n * rng.uniform(*TOPIC_SHARE)))
    n_other = sum(rng.random() < OTHER_TOPIC_RATE for _ in range(n))
    n_other = min(n_other, n_topic, n - n_topic)
    words = [rng.choice(topic_words[label]) for _ in range(n_topic)]
    for _ in range(n_other):
        other = rng.choice([k for k in range(len(topic_words)) if k != label])
        words.append(rng.choice(topic_words[other]))
    words += [rng.choice(_FILLER) for _ in range(n - len(words))]
    rng.shuffle(words)
    return " ".join(words)


def make_examples(num_rows: int, seed: int) -> Tuple[List[str], List[int]]:
    """``num_rows`` sentences with balanced, shuffled labels; a pure function of ``seed``."""
    rng = random.Random(seed)
    words = _topic_words()
    topic_words = [words[name] for name in LABEL_NAMES]
    labels = [i % NUM_LABELS for i in range(num_rows)]
    rng.shuffle(labels)
    texts = [_sentence(rng, label, topic_words) for label in labels]
    return texts, labels


def _make_dataset():
    import datasets

    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(LABEL_NAMES))}
    )
    splits = {}
    # Independent seeds: the test split is generated separately, not carved out of train.
    for name, num_rows, seed in (("train", NUM_TRAIN, SEED), ("test", NUM_TEST, SEED + 1)):
        texts, labels = make_examples(num_rows, seed)
        splits[name] = datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)
    return datasets.DatasetDict(splits)


# ---------------------------------------------------------------------------- tokenizer


def _make_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = _topic_words()
    vocab_words = [PAD, UNK, BOS, EOS] + _FILLER + [w for name in LABEL_NAMES for w in words[name]]
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


def _pretrain_lm(model, train_ids: List[List[int]], rng: random.Random, log, epochs: int = 6) -> None:
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


def _prompt_tune(clf, train_ids, train_labels, rng: random.Random, log, epochs: int = 4) -> None:
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


def _build(root: str, log, family: str) -> None:
    import torch
    import transformers

    from dist_eval.backends import load_model

    log(f"building built-in demo assets (first run only) in {os.path.dirname(root)} ...")
    started = time.perf_counter()
    paths = _paths(root)
    with _build_environment():
        tokenizer, (train_ids, train_labels), (test_ids, test_labels) = _build_data(paths, log)
        torch.manual_seed(SEED)
        rng = random.Random(SEED)
        config, architecture = _build_base_model(paths, tokenizer, train_ids, rng, log, family)
        _build_checkpoint(paths, config, train_ids, train_labels, rng, log, family)
        # Accuracy of what was saved, loaded back the way the evaluator loads it.
        loaded = load_model("local", paths["model_dir"], checkpoint=paths["checkpoint"])
        test_accuracy = _accuracy(loaded.module, test_ids, test_labels)
        train_accuracy = _accuracy(loaded.module, train_ids, train_labels)
    seconds = time.perf_counter() - started
    manifest = {
        "demo_version": DEMO_VERSION,
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
        "built_with": {"torch": torch.__version__, "transformers": transformers.__version__, "threads": BUILD_THREADS},
    }
    with open(os.path.join(root, _MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    log(f"  built-in demo ready: test accuracy {test_accuracy:.4f} (local model), built in {seconds:.1f} s")
    if test_accuracy <= 0.9:
        log(f"  warning: the demo model reached only {test_accuracy:.4f} test accuracy (expected > 0.90)")


def _build_data(paths: Dict[str, str], log):
    """The dataset (saved) and the tokenizer (saved): (tokenizer, (train ids, labels), (test ids, labels))."""
    dataset = _make_dataset()
    dataset.save_to_disk(paths["data_dir"])
    tokenizer = _make_tokenizer()
    tokenizer.save_pretrained(paths["model_dir"])

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


def _build_base_model(paths: Dict[str, str], tokenizer, train_ids, rng: random.Random, log, family: str):
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
    _pretrain_lm(base, train_ids, rng, log)
    base.save_pretrained(paths["model_dir"], safe_serialization=True)
    return config, type(base).__name__


def _build_checkpoint(
    paths: Dict[str, str], config, train_ids, train_labels, rng: random.Random, log, family_name: str
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
        paths["model_dir"], num_labels=NUM_LABELS, torch_dtype=torch.float32
    )
    clf = PromptTunedClassifier(hf, "ptune", PRE_SEQ_LEN, family)
    with torch.no_grad():  # start the prompts from embeddings of random vocabulary words
        picks = torch.randint(4, config.vocab_size, (PRE_SEQ_LEN,))
        clf.prompt_embeddings.weight.copy_(family.get(hf, family.embeddings).weight[picks])
    _prompt_tune(clf, train_ids, train_labels, rng, log)
    save_checkpoint(
        paths["checkpoint"],
        "ptune",
        {"prompt_embeddings.weight": clf.prompt_embeddings.weight, "score.weight": family.get(hf, family.head).weight},
    )
