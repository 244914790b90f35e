"""The model-family table (dist_eval.backends.families): Llama's entry against transformers'
and petals' classes, the family chosen from config.json, an unknown family refused."""
from __future__ import annotations

import pytest
import torch

from dist_eval.backends.families import FAMILIES, checkpoint_prefixes, family_of


def test_llama_entry_names_real_classes_and_attributes():
    import transformers

    llama = FAMILIES["llama"]
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=2, pad_token_id=0, num_labels=3)
    model = getattr(transformers, llama.local_class)(config)
    assert isinstance(llama.get(model, llama.embeddings), torch.nn.Embedding)
    assert len(llama.get(model, llama.blocks)) == 2
    assert llama.get(model, llama.head).weight.shape == (3, 8)
    hidden = llama.final_hidden(model, torch.zeros(1, 4, 8))
    assert hidden.shape == (1, 4, 8)


def test_llama_petals_class_exists():
    from dist_eval.backends.compat import import_petals

    petals = import_petals()
    assert hasattr(petals, FAMILIES["llama"].petals_class)


def test_family_is_chosen_by_model_type_and_unknown_ones_are_refused():
    import types

    from dist_eval.errors import UsageError, flag_names

    assert family_of(types.SimpleNamespace(model_type="llama")) is FAMILIES["llama"]
    with pytest.raises(UsageError) as caught:
        family_of(types.SimpleNamespace(model_type="gpt2"), "/m")
    with flag_names():
        text = str(caught.value)
    assert "\n" not in text and text.startswith("--model /m: config.json has model_type 'gpt2'")
    assert "supported: llama" in text
    assert "model." in checkpoint_prefixes()


@pytest.mark.parametrize("rule", ["first_pad", "non_pad_count"])
def test_last_token_rules_agree_on_right_padded_rows(rule):
    import dataclasses

    family = dataclasses.replace(FAMILIES["llama"], last_token=rule)
    input_ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9], [5, 0, 0, 0, 0]])
    assert family.last_token_index(input_ids, 0).tolist() == [2, 4, 0]
