"""The built-in demo: a tiny prompt-tuned causal LM and a synthetic topic task, shipped with the package.

``torchrun -m dist_eval`` with no ``--model``/``--data-files`` evaluates these assets. The
trained parts are made once by :mod:`dist_eval.demo_build` (``python -m dist_eval.demo_build``)
and shipped in ``dist_eval/demo_assets/<family>/``, so the demo is the same bytes on every
machine: training on the CPU gives other bits on each instruction set (torch's kernels sum in
another order), so a demo trained on the user's machine would be another model there. The
first run copies them into ``<cache>/demo-v{DEMO_VERSION}/`` (the embedded default family,
:data:`dist_eval.backends.families.DEMO_FAMILY`) or ``<cache>/demo-v{DEMO_VERSION}-<family>/``
(``--demo-family``: the same task, data, sizes and training on a model of another family) and
writes the data beside them:

- ``data/``: a ``DatasetDict`` (``train``, ``test``) of English-like word sentences,
  4 to 48 words long, labelled with one of four topics (a ``ClassLabel``), generated here by
  :func:`make_examples` (pure Python, seeded: the same rows everywhere, checked against the
  digest the assets were trained on). A sentence's topic shows in the topic words it
  contains, mixed with shared filler words and a few words of another topic; train and test
  are drawn independently.
- ``model/``: a word-level tokenizer (``<pad>`` = 0, never produced for real text, no
  special tokens added) and a 4-layer causal LM of the demo's family (hidden size 64) pre-trained
  on the train texts with the causal-LM loss. No classifier head in it: this is what
  the Petals servers serve.
- ``checkpoint.pt``: prompt embeddings + ``score`` head, prompt-tuned (``ptune``) with the
  base model frozen.
- ``manifest.json``: the shipped manifest (what was built, from which build code and data, its
  test accuracy, each file's digest). Written last: a folder with the shipped manifest is complete.

Several processes (torchrun ranks) may call :func:`demo_assets` at once: one copies under
an ``fcntl`` lock into a temporary folder next to the final one and renames it into
place; the others wait on the lock and then read the finished folder.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dist_eval.atomic import cache_folder, file_sha256, umask  # demo_build reads file_sha256 from here

DEMO_VERSION = 2  # 2: shipped assets (1 was trained on the user's CPU)

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

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"

MANIFEST = "manifest.json"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_assets")


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


def shipped_families() -> List[str]:
    """The families whose demo assets ship with the package (``--demo-family``'s choices)."""
    try:
        names = os.listdir(SHIPPED_DIR)
    except OSError:
        return []
    return sorted(name for name in names if os.path.isfile(os.path.join(SHIPPED_DIR, name, MANIFEST)))


def shipped_manifest(family: str) -> dict:
    """The manifest of ``family``'s shipped assets (what :mod:`dist_eval.demo_build` wrote)."""
    with open(os.path.join(SHIPPED_DIR, family, MANIFEST)) as f:
        return json.load(f)


def demo_assets(
    cache_dir: Optional[str] = None, log: Callable[[str], None] = print, family: Optional[str] = None
) -> DemoAssets:
    """Return the demo assets of ``family`` (a model_type; None: the default) in the cache,
    copying the shipped ones there first (and generating the data) if absent or outdated.

    Safe when several processes call it at once: the copy holds an exclusive ``fcntl``
    lock, writes into a temporary folder in the same parent and ``os.rename``s it into
    place, so no reader ever sees a half-written folder.
    """
    from dist_eval.backends.families import DEMO_FAMILY

    family = family or DEMO_FAMILY
    if family not in shipped_families():
        raise ValueError(f"no built-in demo of the family {family!r}: the package ships "
                         f"{', '.join(shipped_families()) or 'none'} (python -m dist_eval.demo_build {family} "
                         "makes one)")
    shipped = shipped_manifest(family)
    cache_dir = os.path.abspath(cache_dir or cache_folder())
    name = f"demo-v{DEMO_VERSION}" + ("" if family == DEMO_FAMILY else f"-{family}")
    final = os.path.join(cache_dir, name)
    assets = _read_assets(final, shipped)
    if assets is not None:
        return assets
    os.makedirs(cache_dir, exist_ok=True)
    lock_path = os.path.join(cache_dir, f"{name}.lock")
    with open(lock_path, "a+") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("waiting for another process writing the built-in demo's files ...")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            assets = _read_assets(final, shipped)  # written by another process while we waited
            if assets is not None:
                return assets
            _remove_leftovers(cache_dir, final)
            tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir)
            try:
                os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it private; the cache is not
                _install(tmp, family, shipped, log)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    assets = _read_assets(final, shipped)
    if assets is None:  # pragma: no cover - only if the folder was removed under us
        raise RuntimeError(f"wrote the demo assets in {final}, but cannot read them back")
    return assets


# ---------------------------------------------------------------------------- cache


def _paths(root: str) -> Dict[str, str]:
    return {
        "model_dir": os.path.join(root, "model"),
        "data_dir": os.path.join(root, "data"),
        "checkpoint": os.path.join(root, "checkpoint.pt"),
    }


def _read_assets(root: str, shipped: dict) -> Optional[DemoAssets]:
    """The assets in ``root`` when they are complete and a copy of the ``shipped`` ones, else None
    (a folder of an earlier release, or a copy that did not finish, is written again).
    """
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if manifest != shipped:
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


def _install(root: str, family: str, shipped: dict, log) -> None:
    """The shipped files of ``family`` copied into ``root`` (each checked against its digest),
    the data generated beside them (checked against the digest the model was trained on),
    the manifest last.
    """
    log(f"writing the built-in demo's files (first run only) in {os.path.dirname(root)} ...")
    source = os.path.join(SHIPPED_DIR, family)
    for relative, digest in sorted(shipped["files"].items()):
        target = os.path.join(root, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(source, relative), target)
        if file_sha256(target) != digest:
            raise RuntimeError(f"the shipped demo file {os.path.join(source, relative)} does not match its digest "
                               "in manifest.json: reinstall dist_eval (or run python -m dist_eval.demo_build)")
    dataset = make_dataset()
    if data_sha256(dataset) != shipped["data_sha256"]:
        raise RuntimeError("the demo's data generated here differs from the data its shipped model was trained on "
                           "(dist_eval/demo.py changed without python -m dist_eval.demo_build, or another Python's "
                           "random): rebuild the assets with python -m dist_eval.demo_build")
    dataset.save_to_disk(_paths(root)["data_dir"])
    with open(os.path.join(root, MANIFEST), "w") as f:
        json.dump(shipped, f, indent=2, sort_keys=True)


def _remove_leftovers(cache_dir: str, final: str) -> None:
    """Under the lock: temp folders of crashed copies, and an incomplete or outdated final folder."""
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
FILLER = """the a an of and to in on for with at by from about after before during over
    this that these those it its they their we our he she his her you your
    is was are were be been has have had will would can could should may might
    very more most some many much few new old big small good great long short early late
    today yesterday week year day time people group city country world report story news
    said says told think know make made take took give gave find found show showed
    again also still just only even really often always never sometimes here there
    first last next other another same every each""".split()


def topic_words() -> Dict[str, List[str]]:
    """Each topic's words (no word in two lists, none among the filler)."""
    words = {name: _TOPIC_WORDS[name].split() for name in LABEL_NAMES}
    all_words = [w for name in LABEL_NAMES for w in words[name]] + FILLER
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
    words += [rng.choice(FILLER) for _ in range(n - len(words))]
    rng.shuffle(words)
    return " ".join(words)


def make_examples(num_rows: int, seed: int) -> Tuple[List[str], List[int]]:
    """``num_rows`` sentences with balanced, shuffled labels; a pure function of ``seed``."""
    rng = random.Random(seed)
    words = topic_words()
    lists = [words[name] for name in LABEL_NAMES]
    labels = [i % NUM_LABELS for i in range(num_rows)]
    rng.shuffle(labels)
    texts = [_sentence(rng, label, lists) for label in labels]
    return texts, labels


def make_dataset():
    """The demo's ``DatasetDict`` (``train``, ``test``): a pure function of the constants above."""
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


def data_sha256(dataset) -> str:
    """A digest of the rows of the demo's ``DatasetDict`` (texts and labels of each split, in order)."""
    digest = hashlib.sha256()
    for split in sorted(dataset):
        rows = {"split": split, "text": list(dataset[split]["text"]), "label": list(dataset[split]["label"])}
        digest.update(json.dumps(rows, sort_keys=True).encode())
    return digest.hexdigest()
