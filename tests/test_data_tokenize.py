"""tokenize_rows (dist_eval.data.tokenize): the ids of exactly the rows asked for, in their
order, as the tokenizer gives them for the same texts (and pairs, and a template), on a
real ``datasets.Dataset``, on a ``select()`` view of one (what --limit gives), on formatted
ones and one with a transform."""
import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from dist_eval.data.labels import TaskColumns
from dist_eval.data.tokenize import cyclic_gc_paused, tokenize_rows


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _data(n=50):
    rng = np.random.default_rng(0)
    words = ["good", "bad", "film", "plot", "very", "not", "a", "the"]
    return datasets.Dataset.from_dict({
        "text": [" ".join(rng.choice(words, size=int(rng.integers(1, 30)))) for _ in range(n)],
        "other": [" ".join(rng.choice(words, size=3)) for _ in range(n)],
        "label": [int(x) for x in rng.integers(0, 2, size=n)],
        "extra": [[float(i)] * 4 for i in range(n)],  # a column no text is read from
    })


@pytest.mark.parametrize("view", ["whole", "selected"])
@pytest.mark.parametrize("pair", [False, True])
def test_ids_of_the_rows_asked_for_in_their_order(tokenizer, view, pair):
    data = _data()
    if view == "selected":  # an indices mapping, as a --limit sample has
        data = data.select(list(range(49, -1, -2)))
    rows = np.array([7, 0, 3, 24, 11, 5], dtype=np.int64)  # unsorted, not contiguous
    columns = TaskColumns("text", "label", "other" if pair else None)
    ids, truncated = tokenize_rows(tokenizer, data, rows, columns, max_length=512, pad_token_id=-1)
    texts = [data[int(r)]["text"] for r in rows]
    pairs = [data[int(r)]["other"] for r in rows] if pair else None
    assert ids == tokenizer(texts, pairs)["input_ids"]
    assert truncated == 0


def test_template_truncation_and_no_rows(tokenizer):
    data = _data()
    rows = np.array([3, 1], dtype=np.int64)
    columns = TaskColumns("text", "label", "other", template="A: {text} B: {text_pair}")
    ids, truncated = tokenize_rows(tokenizer, data, rows, columns, max_length=4, pad_token_id=-1)
    full = tokenizer([f"A: {data[r]['text']} B: {data[r]['other']}" for r in (3, 1)])["input_ids"]
    assert ids == [x[:4] for x in full]
    assert truncated == sum(len(x) > 4 for x in full) == 2
    assert tokenize_rows(tokenizer, data, np.zeros(0, np.int64), columns, 4, -1) == ([], 0)


@pytest.mark.parametrize("fmt", ["numpy", "pandas", "torch", "transform"])
def test_formatted_datasets_and_a_transform(tokenizer, fmt):
    data = _data()
    if fmt == "transform":  # a transform that reads another column than the text
        data = data.with_transform(lambda b: {"text": [f"{t} {o}" for t, o in zip(b["text"], b["other"])],
                                              "label": b["label"]})
        want_texts = [f"{_data()[r]['text']} {_data()[r]['other']}" for r in (4, 2, 9)]
    else:
        data = data.with_format(fmt)
        want_texts = [_data()[r]["text"] for r in (4, 2, 9)]
    rows = np.array([4, 2, 9], dtype=np.int64)
    for pair in (None, "text"):  # the same column as text and pair
        columns = TaskColumns("text", "label", pair)
        ids, _ = tokenize_rows(tokenizer, data, rows, columns, max_length=512, pad_token_id=-1)
        assert ids == tokenizer(want_texts, want_texts if pair else None)["input_ids"]


@pytest.mark.parametrize("pair", [False, True])
def test_only_the_ids_are_asked_of_the_tokenizer(tokenizer, pair):
    """Issue 29: no attention masks or token type ids are built (they cost more than the
    tokenization of short rows); the ids are those of a default call."""
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return tokenizer(*args, **kwargs)

    data = _data()
    rows = np.arange(50, dtype=np.int64)
    columns = TaskColumns("text", "label", "other" if pair else None)
    ids, _ = tokenize_rows(recording, data, rows, columns, max_length=512, pad_token_id=-1)
    assert calls and all(not c["return_attention_mask"] and not c["return_token_type_ids"] for c in calls)
    assert ids == tokenizer(list(data["text"]), list(data["other"]) if pair else None)["input_ids"]


def _bpe_backend(texts):
    """A small byte-level BPE trained on ``texts``, with BOS/EOS added by a post-processor
    (as Llama's and BLOOM's tokenizer.json have), so special tokens and pairs show."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<pad>", "<unk>", "<s>", "</s>"]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=special))
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 2), ("</s>", 3)])
    return bpe


# what each class overrides of the batch's call: GPT-2's 4.x class (its override only checks too, and is in no
# family's entry) and a class of the test's own, overriding the step that encodes the batch on either transformers
OVERRIDING = ("GPT2TokenizerFast", "BatchStepOverridden")
CALLING_THE_BASE = ("BloomTokenizerFast",)  # 4.x's Bloom class: overrides the step, in the family table


def _family_tokenizers(texts):
    """The families' tokenizer classes this transformers has (Falcon's is the base class; 5.x has no Bloom class,
    its folders read as the base class), GPT-2's, and a class overriding the step that encodes a batch (4.x:
    _batch_encode_plus, 5.x: _encode_plus), as a tokenizer outside the table may; by their classes' names."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    step = "_batch_encode_plus" if hasattr(PreTrainedTokenizerFast, "_batch_encode_plus") else "_encode_plus"

    def overridden(self, *args, **kwargs):
        return getattr(PreTrainedTokenizerFast, step)(self, *args, **kwargs)

    own = type("BatchStepOverridden", (PreTrainedTokenizerFast,), {step: overridden})
    names = ("PreTrainedTokenizerFast", "BloomTokenizerFast", "GPT2TokenizerFast", "LlamaTokenizerFast")
    made = {}
    for cls in [getattr(transformers, n) for n in names if hasattr(transformers, n)] + [own]:
        kwargs = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
        made[cls.__name__] = cls(tokenizer_object=_bpe_backend(texts), **kwargs)
    # 5.x: TokenizersBackend (PreTrainedTokenizerFast), GPT2Tokenizer and LlamaTokenizer (the *Fast names its aliases)
    assert len(made) == (5 if hasattr(transformers, "BloomTokenizerFast") else 4), sorted(made)
    return made


@pytest.mark.parametrize("pair", [False, True])
def test_the_backend_called_directly_gives_the_tokenizers_own_ids(pair):
    """Issue 29: a plain fast tokenizer's Rust backend is called without transformers' per-row
    conversion; the ids (special tokens, pairs, truncation) equal the tokenizer's own call,
    for the tokenizer classes of the families dist_eval serves (a class outside the family
    table that overrides the call's steps goes through its own call, with the same ids)."""
    from dist_eval.backends.families import tokenizers_calling_the_base
    from dist_eval.data.tokenize import _backend_gives_the_same_ids

    data = _data(200)
    columns = TaskColumns("text", "label", "other" if pair else None)
    rows = np.arange(199, -1, -3, dtype=np.int64)
    texts = [data[int(r)]["text"] for r in rows]
    pairs = [data[int(r)]["other"] for r in rows] if pair else None
    for name, tokenizer in _family_tokenizers(list(data["text"])).items():
        trusted = tokenizers_calling_the_base()  # the model table's, as the evaluation passes them
        direct = _backend_gives_the_same_ids(tokenizer, tokenizer._tokenizer, trusted)
        assert direct == (name not in OVERRIDING), name
        # without the table, only a class that overrides none of the call's steps is called directly
        alone = _backend_gives_the_same_ids(tokenizer, tokenizer._tokenizer)
        assert alone == (name not in OVERRIDING + CALLING_THE_BASE), name
        ids, truncated = tokenize_rows(tokenizer, data, rows, columns, max_length=9, pad_token_id=0,
                                       calling_the_base=trusted)
        assert ids == tokenize_rows(tokenizer, data, rows, columns, max_length=9, pad_token_id=0)[0], name
        full = tokenizer(texts, pairs)["input_ids"]
        assert ids == [x[:9] for x in full], name
        assert truncated == sum(len(x) > 9 for x in full) > 0, name
        assert any(x[0] == tokenizer.bos_token_id for x in ids) or name == "PreTrainedTokenizerFast", name


def test_the_tokenizers_own_call_when_the_backend_differs_from_it():
    """A backend set to truncate or pad (transformers' call switches that off), or a class that
    overrides the call: the tokenizer's own call is used, so the ids are still its own."""
    from transformers import PreTrainedTokenizerFast

    from dist_eval.data.tokenize import _backend_gives_the_same_ids

    data = _data(40)
    columns = TaskColumns("text", "label")
    rows = np.arange(40, dtype=np.int64)
    texts = list(data["text"])

    truncating = PreTrainedTokenizerFast(tokenizer_object=_bpe_backend(texts), pad_token="<pad>")
    truncating._tokenizer.enable_truncation(max_length=3)
    assert not _backend_gives_the_same_ids(truncating, truncating._tokenizer)
    ids, _ = tokenize_rows(truncating, data, rows, columns, max_length=512, pad_token_id=0)
    assert max(map(len, ids)) > 3  # not the backend's truncation: transformers' call turned it off
    assert ids == truncating(texts)["input_ids"]

    class Lowering(PreTrainedTokenizerFast):  # a subclass that changes the texts in its call
        def __call__(self, text, *args, **kwargs):
            return super().__call__([t.upper() for t in text], *args, **kwargs)

    lowering = Lowering(tokenizer_object=_bpe_backend(texts), pad_token="<pad>")
    assert not _backend_gives_the_same_ids(lowering, lowering._tokenizer)
    ids, _ = tokenize_rows(lowering, data, rows, columns, max_length=512, pad_token_id=0)
    assert ids == lowering(texts)["input_ids"] != PreTrainedTokenizerFast(
        tokenizer_object=_bpe_backend(texts))(texts)["input_ids"]


def test_the_first_bad_row_in_row_order_is_named(tokenizer):
    """An empty row and a row with the pad id: the error names whichever comes first."""
    from dist_eval.errors import UsageError

    data = datasets.Dataset.from_dict({"text": ["good film", "<pad> film", "", "bad"], "label": [0, 1, 0, 1]})
    pad = tokenizer.convert_tokens_to_ids("<pad>")
    columns = TaskColumns("text", "label")
    with pytest.raises(UsageError, match="row 1 contains the pad token id"):
        tokenize_rows(tokenizer, data, np.arange(4, dtype=np.int64), columns, 512, pad)
    with pytest.raises(UsageError, match="row 2 is empty"):
        tokenize_rows(tokenizer, data, np.array([0, 2, 1], dtype=np.int64), columns, 512, pad)


def test_right_pad_places_every_id_and_pads_the_rest():
    import torch

    from dist_eval.data.tokenize import right_pad

    rng = np.random.default_rng(3)
    for lengths in ([1], [5, 1, 3], [7] * 4, rng.integers(1, 40, 33).tolist()):
        rows = [rng.integers(1, 2**40, n).tolist() for n in lengths]  # ids beyond int32 stay exact
        batch = right_pad(rows, pad_token_id=-7)
        assert batch.dtype == torch.long and batch.shape == (len(rows), max(lengths))
        for row, ids in zip(batch.tolist(), rows):
            assert row == ids + [-7] * (max(lengths) - len(ids))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_inside_and_left_as_it_was(enabled):
    import gc

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(KeyError), cyclic_gc_paused():
            raise KeyError("inside")
        assert gc.isenabled() is enabled  # also when the block raised
    finally:
        (gc.enable if was else gc.disable)()
