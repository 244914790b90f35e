"""Zero-shot label words on a real private Petals swarm (server processes on 127.0.0.1):
petals' causal-LM client (blocks on the swarm, LM head here) gives the local backend's
logits bit for bit in fp32, without prompts and with a ptune checkpoint's, for Llama (untied
LM head) and BLOOM (tied to the embeddings). One swarm per family, conftest's (shared). Marked `swarm`."""
import os
from unittest import mock

import pytest
import torch
from conftest import build_checkpoint
from inprocess_cli import one_thread
from test_backends_zeroshot import TEXTS, WORDS, padded

from dist_eval.backends import load_model

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module", params=["llama", "bloom"])
def family_swarm(request):
    """conftest's swarms (issue 46: this module started its own of the same models): tiny_swarm (the
    tiny Llama, two servers of every block) and bloom_swarm (shared with test_families_swarm.py,
    its converted copy in its own cache); one thread on both sides: a CPU matmul's last bits depend
    on the thread count."""
    if request.param == "llama":
        yield request.getfixturevalue("tiny_model"), request.getfixturevalue("tiny_swarm")
        return
    model, cache, swarm = request.getfixturevalue("bloom_swarm")
    with mock.patch.dict(os.environ, {"DIST_EVAL_CACHE": cache}):  # the client reads the converted copy too
        yield model, swarm


@pytest.fixture
def single_thread():
    with one_thread():
        yield


@pytest.mark.parametrize("tuning_mode", [None, "ptune"])
def test_petals_equals_local_bitwise(family_swarm, tmp_path, tuning_mode, single_thread):
    model_dir, swarm = family_swarm
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode=tuning_mode) if tuning_mode else None
    batch = padded(model_dir, TEXTS)
    local = load_model("local", model_dir, checkpoint=checkpoint, label_words=WORDS)
    petals = load_model("petals", model_dir, checkpoint=checkpoint, label_words=WORDS,
                        initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix)
    try:
        with torch.no_grad():
            expected, got = local.module(batch), petals.module(batch)
        assert got.dtype == torch.float32 and torch.equal(got, expected)
        servers = petals.module.provenance()["servers"]  # the scorer hands on the client's provenance
        assert servers and min(s["blocks"][0] for s in servers) == 0
    finally:
        petals.close()
