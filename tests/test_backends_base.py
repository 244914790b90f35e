"""dist_eval.backends.base: the backend contract. A minimal backend a reader can copy runs
through ``evaluate`` like any other; the local, zero-shot and petals backends (and the
adapters of a user's model object) are :class:`Backend` instances whose methods a run calls
directly. The petals test starts a real one-server swarm (marked `swarm`)."""
import pytest
import torch
from float_promises import assert_within_rounding
from sklearn import metrics as skm
from torch import nn

from dist_eval import evaluate
from dist_eval.backends import Backend, LoadedModel, load_model
from dist_eval.errors import UsageError

WORDS = ["w1", "w2 w5", "w3"]  # zero-shot label words in the tiny model's vocabulary (tests/conftest.py)


class MeanEmbeddingClassifier(Backend):
    """The minimal backend of the base module's docstring: a linear layer over the mean token embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, num_labels: int, pad_token_id: int):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.head = nn.Linear(hidden_size, num_labels)
        self.pad_token_id = pad_token_id

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        real = input_ids.ne(self.pad_token_id).unsqueeze(-1).float()
        mean = (self.embeddings(input_ids) * real).sum(1) / real.sum(1).clamp(min=1)
        return self.head(mean)


class ClosingBackend(MeanEmbeddingClassifier):
    """A backend that holds something to release: counts its close() calls."""

    closed = 0

    def close(self) -> None:
        self.closed += 1


def tokenizer_of(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_a_minimal_backend_is_evaluated_like_any_other(tiny_model):
    import datasets

    torch.manual_seed(3)
    tokenizer = tokenizer_of(tiny_model)
    texts = [" ".join(f"w{(7 * i + j) % 60}" for j in range(1 + i % 6)) for i in range(29)]
    labels = [i % 3 for i in range(29)]
    data = datasets.Dataset.from_dict({"text": texts, "label": labels})
    backend = MeanEmbeddingClassifier(len(tokenizer), 8, 3, tokenizer.pad_token_id)
    model = LoadedModel(backend, num_labels=3, pad_token_id=tokenizer.pad_token_id, backend="mean-embedding")
    result = evaluate(model, data, tokenizer=tokenizer, batch_size=4, return_logits=True, bootstrap_resamples=0)
    with torch.no_grad():  # each row alone, unpadded: the reference logits
        expected = torch.cat([backend(torch.tensor([tokenizer(t)["input_ids"]])) for t in texts]).numpy()
    assert result.predictions.indices.tolist() == list(range(29))
    assert_within_rounding(result.predictions.logits, expected, "the logits, against each row alone",
                           why="the run pads rows into batches of 4; the reference runs each row alone, unpadded")
    preds = expected.argmax(1)
    assert result.predictions.preds.tolist() == preds.tolist() and len(set(preds)) > 1
    m = result.metrics
    assert m["num_samples"] == 29
    assert m["accuracy"] == pytest.approx(skm.accuracy_score(labels, preds), abs=1e-12)
    assert m["f1_macro"] == pytest.approx(skm.f1_score(labels, preds, average="macro", zero_division=0), abs=1e-12)
    assert m["confusion_matrix"] == skm.confusion_matrix(labels, preds, labels=[0, 1, 2]).tolist()
    assert "swarm" not in m["run"]


def test_the_contracts_defaults_and_what_a_loaded_model_calls():
    backend = ClosingBackend(10, 4, 2, 0)
    model = LoadedModel(backend, 2, 0, "closing")
    assert model.provenance() is None  # no swarm
    model.close()
    assert backend.closed == 1  # LoadedModel.close is the backend's
    plain = MeanEmbeddingClassifier(10, 4, 2, 0)
    plain.close()  # nothing held: nothing to do
    with pytest.raises(NotImplementedError, match="MeanEmbeddingClassifier computes no hidden states"):
        plain.hidden_states(torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="holds no trained prompts or head to swap"):
        plain.load_trainable(None)
    from dist_eval.backends.classifier import swap_checkpoint

    # a model load_model did not make: how to read another checkpoint for it is not known
    with pytest.raises(UsageError, match=r"^model='ClosingBackend': this model was not made by load_model.* "
                                         r"Load it with dist_eval\.load_model\(\.\.\., checkpoint=\.\.\.\) instead"):
        swap_checkpoint(model, "other.pt")


def test_what_breaks_the_contract_is_refused_when_built():
    class NoForward(Backend):
        pass

    with pytest.raises(TypeError, match="abstract method forward"):
        NoForward()
    with pytest.raises(UsageError, match=r"^module: expected a dist_eval.backends.base.Backend .* got Linear\. "
                                         r"Derive its class from Backend"):
        LoadedModel(nn.Linear(4, 2), 2, 0, "linear")


def test_local_zero_shot_and_object_backends_implement_the_contract(tiny_model, tiny_checkpoint, tmp_path):
    import transformers
    from conftest import build_tiny_model

    from dist_eval.backends.local import PromptTunedClassifier
    from dist_eval.backends.objects import as_loaded_model
    from dist_eval.backends.zeroshot import ZeroShotScorer

    local = load_model("local", tiny_model, checkpoint=tiny_checkpoint)
    zero_shot = load_model("local", tiny_model, checkpoint=tiny_checkpoint, label_words=WORDS)
    folder = build_tiny_model(str(tmp_path / "seq_cls"), layout="seq_cls")
    adapted = as_loaded_model(transformers.LlamaForSequenceClassification.from_pretrained(folder))
    assert isinstance(local.module, PromptTunedClassifier) and isinstance(zero_shot.module, ZeroShotScorer)
    for model in (local, zero_shot, adapted):
        assert isinstance(model.module, Backend)
        assert model.provenance() is None  # computed here: no swarm
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    with torch.no_grad():  # the scorer's hidden states are its base model's, prompts removed
        assert torch.equal(zero_shot.module.hidden_states(ids), zero_shot.module.base.hidden_states(ids))
        assert zero_shot.module.hidden_states(ids).shape == (2, 4, 32)
    for model in (local, zero_shot, adapted):
        model.close()


@pytest.mark.swarm
def test_petals_backends_implement_the_contract(tiny_model, tiny_checkpoint, tiny_swarm):
    from dist_eval.backends.petals.backend import PetalsClassifier

    swarm = tiny_swarm
    loaded = []
    try:
        peers = dict(initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix)
        loaded.append(load_model("petals", tiny_model, checkpoint=tiny_checkpoint, **peers))
        loaded.append(load_model("petals", tiny_model, checkpoint=tiny_checkpoint, label_words=WORDS, **peers))
        classifier, zero_shot = loaded
        assert isinstance(classifier.module, PetalsClassifier) and isinstance(zero_shot.module.base, PetalsClassifier)
        for model in loaded:
            assert isinstance(model.module, Backend)
            servers = model.provenance()["servers"]  # the swarm's servers, through the scorer too
            assert len(servers) == 2 and all(server["blocks"][0] == 0 for server in servers)
    finally:
        for model in loaded:
            model.close()
