"""dist_eval.backends.petals.wire: token ids in (a first server with the client's own token
embeddings looks them up), read positions out (the last server answers only the positions
the classifier head reads), and the logits stay those of the local backend, bit for bit;
a server of petals' own (which offers no table and ignores the positions) is sent hidden
states and answers every position, and the client takes the positions itself. The swarm
tests are marked `swarm`."""
import os
import sys
from unittest import mock

import pytest
import torch
from conftest import REPO, build_checkpoint, build_tiny_model, forking_from
from float_promises import assert_same_bits, assert_within_rounding

from dist_eval.backends.petals.wire import (
    POSITIONS_KEY,
    _check_answer,
    _PeerWire,
    _Request,
    _request_tensors,
    embed,
    embeddings_digest,
    read_positions,
)
from dist_eval.swarm.wire import _embed_on_server, _server

# ------------------------------------------------------------------ the protocol's checks


def test_read_positions_takes_one_position_per_row_exactly():
    hidden = torch.randn(3, 5, 4)
    read = read_positions(hidden, [4, 0, 2])
    assert read.shape == (3, 1, 4)
    for row, position in enumerate([4, 0, 2]):
        assert torch.equal(read[row, 0], hidden[row, position])


@pytest.mark.parametrize("positions", [[1, 2], [1, 2, 5], [1, -1, 2], [1, 2.0, 3], "1,2,3", None])
def test_read_positions_refuses_positions_that_do_not_fit(positions):
    with pytest.raises(ValueError, match=rf"{POSITIONS_KEY}: expected 3 positions in \[0, 5\), one per row"):
        read_positions(torch.zeros(3, 5, 4), positions)


def test_an_answer_of_every_position_is_read_here_and_a_read_answer_is_kept():
    sent = (2, 6, 4)
    full = torch.randn(*sent)
    read = _check_answer(full, sent, [5, 1])  # a server of petals' own: every position
    assert read.shape == (2, 1, 4) and torch.equal(read[:, 0], full[[0, 1], [5, 1]])
    trimmed = torch.randn(2, 1, 4)
    assert _check_answer(trimmed, sent, [5, 1]) is trimmed  # a dist_eval server: the positions
    assert _check_answer(full, sent, None) is full  # a server before the last: every position


@pytest.mark.parametrize("answer", [torch.zeros(2, 1, 4), torch.zeros(2, 6, 3), torch.zeros(3, 6, 4), "x"])
def test_an_answer_of_another_shape_fails_the_request(answer):
    with pytest.raises(RuntimeError, match="a server answered a forward with"):
        _check_answer(answer, (2, 6, 4), None if isinstance(answer, torch.Tensor) and answer.shape[1] == 1 else [0, 1])


def test_embed_puts_the_prompt_vectors_before_each_rows_looked_up_tokens():
    table, prompts = torch.randn(10, 4), torch.randn(1, 2, 4)
    ids = torch.tensor([[3, 0, 9], [1, 1, 2]])
    built = embed(table, ids, prompts)
    assert built.shape == (2, 5, 4)
    for row in range(2):
        assert torch.equal(built[row, :2], prompts[0]) and torch.equal(built[row, 2:], table[ids[row]])
    assert torch.equal(embed(table, ids, None), table[ids])
    for saved in (torch.float16, torch.bfloat16):  # a server keeps the table as saved; the client reads it in fp32
        assert torch.equal(embed(table.to(saved), ids, prompts), embed(table.to(saved).to(torch.float32), ids, prompts))


def test_the_digest_is_of_the_float32_values_and_the_shape():
    table = torch.randn(10, 4).to(torch.float16)
    assert embeddings_digest(table) == embeddings_digest(table.to(torch.float32))  # the client reads fp32
    changed = table.to(torch.float32).clone()
    changed[7, 1] += 1e-3
    assert embeddings_digest(changed) != embeddings_digest(table)
    assert embeddings_digest(table.reshape(20, 2)) != embeddings_digest(table)


def test_a_server_refuses_token_ids_for_another_table_or_outside_its_own(monkeypatch):
    from dist_eval.backends.petals.shims import import_petals

    import_petals()  # petals' own import needs dist_eval's hivemind compatibility first
    table = torch.randn(10, 4)
    monkeypatch.setitem(_server, "table", table)
    monkeypatch.setitem(_server, "digest", embeddings_digest(table))
    own = torch.tensor(list(bytes.fromhex(_server["digest"])), dtype=torch.uint8)
    ids, prompts, vectors = torch.tensor([[1, 2]]), torch.zeros(0), torch.randn(1, 3, 4)
    hidden, deep = _embed_on_server(ids, prompts, vectors, own)
    assert torch.equal(hidden, embed(table, ids, vectors)) and deep is prompts
    with pytest.raises(ValueError, match="not this server's"):
        _embed_on_server(ids, prompts, vectors, torch.zeros(32, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"token ids \[rows, tokens\] in \[0, 10\)"):
        _embed_on_server(torch.tensor([[1, 10]]), prompts, vectors, own)


def test_the_first_request_is_token_ids_to_a_server_with_the_clients_table_else_hidden_states_in_its_dtype():
    from hivemind.utils.tensor_descr import BatchTensorDescriptor
    from petals.utils.misc import DUMMY

    def info(dtype, digest=None):
        schema = ((BatchTensorDescriptor((64,), dtype=dtype),), {})
        return {"forward_schema": schema, **({"dist_eval_token_ids": digest} if digest else {})}

    table = torch.randn(10, 4)
    digest = embeddings_digest(table)
    computed = []

    def own_digest():  # the client's, computed only when a server offers a table
        computed.append(1)
        return digest

    def never():
        raise AssertionError("the client's digest computed with no table offered")

    ids, vectors = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.randn(1, 2, 4)
    hidden = embed(table, ids, vectors)
    request = _Request(hidden, DUMMY, ids, 2, torch.tensor([4, 3]))
    sent = _request_tensors(request, DUMMY, _PeerWire(info(torch.float32, digest), own_digest))
    assert torch.equal(sent[0], ids) and sent[1] is DUMMY and torch.equal(sent[2], vectors)
    assert bytes(sent[3].tolist()).hex() == digest and computed == [1]
    for peer in (_PeerWire(info(torch.float32), never), _PeerWire(info(torch.float32, "0" * 64), own_digest),
                 _PeerWire(info(torch.float32, digest), None)):
        assert [t.dtype for t in _request_tensors(request, DUMMY, peer)] == [torch.float32, torch.float32]
    deep = torch.randn(4, 1, 2, 4)
    to_half = _request_tensors(request, deep, _PeerWire(info(torch.bfloat16), never))
    assert torch.equal(to_half[0], hidden.to(torch.bfloat16)) and torch.equal(to_half[1], deep.to(torch.bfloat16))
    ids_to_half = _request_tensors(request, deep, _PeerWire(info(torch.bfloat16, digest), own_digest))
    assert torch.equal(ids_to_half[0], ids) and torch.equal(ids_to_half[2], vectors.to(torch.bfloat16))
    # what the server then builds, converted to its dtype, is what the hidden states converted are
    built = embed(table, ids, ids_to_half[2]).to(torch.bfloat16)
    assert torch.equal(built, hidden.to(torch.bfloat16)) and torch.equal(ids_to_half[1], deep.to(torch.bfloat16))


def test_every_family_that_embeds_on_servers_finds_its_table_in_the_folder_servers_read(tmp_path):
    from dist_eval.backends.blocks import family_class
    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.petals_folder import petals_model_folder, read_tensor

    embedding = [name for name, family in FAMILIES.items() if family.embeds_on_server]
    # the newer ones: Llama's layout
    assert embedding == ["llama", "falcon", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "mixtral",
                         "deepseek_v3", "kimi_k2", "kimi_k25", "llama4_text", "qwen3_5",
                         "qwen3_5_moe", "qwen3_next", "minimax_m2", "gpt_oss", "glm_moe_dsa", "deepseek_v32"]
    for name in embedding:
        for layout in ("causal_lm", "base", "seq_cls"):
            folder = build_tiny_model(str(tmp_path / f"{name}-{layout}"), family=name, layout=layout)
            served = petals_model_folder(folder, cache_dir=str(tmp_path / "cache"))
            table = read_tensor(served, FAMILIES[name].served_embeddings_key)
            # dist_eval's causal LM of the family (AutoModelForCausalLM's on the pinned stack; 5.x's is its own class
            # of a family it has: Kimi K2.5's is a vision-language model, which reads no text model from this folder)
            model = family_class(FAMILIES[name].local_lm_class, in_petals=False).from_pretrained(folder)
            assert torch.equal(table, model.get_input_embeddings().weight)


# ------------------------------------------------------------------ on real swarms


def _right_padded_rows(lengths, seed=0):
    """Rows of random word ids (never the pad id 0) of these lengths, right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(2, 60, (length,), generator=g)
    return ids


def _recording_forwards():
    """(patch, calls): each remote forward's (blocks, [(shape, dtype) sent], metadata, shape answered),
    through dist_eval's readout and through petals' own forward alike."""
    import contextlib

    from hivemind.utils import MSGPackSerializer

    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    from petals.client import remote_forward_backward, sequential_autograd

    calls = []
    real = remote_forward_backward.run_remote_forward

    async def recording(uid, stub, rpc_info, *inputs, metadata=None, **kwargs):
        (answer,) = await real(uid, stub, rpc_info, *inputs, metadata=metadata, **kwargs)
        sent = [(tuple(t.shape), t.dtype) for t in inputs]
        calls.append((uid, sent, MSGPackSerializer.loads(metadata), tuple(answer.shape)))
        return (answer,)

    @contextlib.contextmanager
    def patch():
        with mock.patch.object(remote_forward_backward, "run_remote_forward", recording), \
                mock.patch.object(sequential_autograd, "run_remote_forward", recording):
            yield

    return patch(), calls


def _remote_and_local(swarm, model, checkpoint, batches):
    """Each batch's logits from the petals backend (with every request recorded) and from the
    local backend, computed with one thread; and the hidden states of the first batch."""
    from inprocess_cli import one_thread

    from dist_eval.backends import load_model
    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    patch, calls = _recording_forwards()
    petals = load_model("petals", model, checkpoint=checkpoint, initial_peers=swarm.initial_peers,
                        dht_prefix=swarm.dht_prefix)
    local = load_model("local", model, checkpoint=checkpoint)
    try:
        with one_thread(), torch.no_grad(), patch:
            remote = [petals.module(ids) for ids in batches]
            remote_hidden = petals.module.hidden_states(batches[0])
        with one_thread(), torch.no_grad():
            expected = [local.module(ids) for ids in batches]
            local_hidden = local.module.hidden_states(batches[0])
    finally:
        petals.close()
    return remote, expected, calls, (remote_hidden, local_hidden)


@pytest.fixture(scope="module")
def two_span_swarm(split_swarm):
    """dist_eval's servers, holding blocks 0:2 and 2:4: every forward crosses both (conftest's
    split_swarm, shared with test_swarm_merged_forward.py)."""
    assert split_swarm.placement == [(0, 2), (2, 4)]
    return split_swarm


@pytest.fixture(scope="module")
def stock_swarm(tiny_model):
    """One server of petals' own (tests/stock_petals_server.py) holding every block, one thread, on the stack
    petals 2.2 pins (its own Python where this one's transformers is another: conftest.stack_python), as the
    servers of a swarm others run."""
    from conftest import stack_python

    from dist_eval.swarm import LocalSwarm

    swarm = LocalSwarm(tiny_model, num_servers=1, dht_prefix="wire-stock")
    tests = os.path.join(REPO, "tests")
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    try:
        with mock.patch("dist_eval.swarm.local.SERVER_MODULE", "stock_petals_server"), \
                mock.patch.object(sys, "executable", stack_python("pinned")), \
                mock.patch.dict(os.environ, {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}):
            swarm.start()  # only this swarm's servers are petals' own
        yield swarm
    finally:
        swarm.stop()


def _ids_sent(sent, rows, tokens, prompt_tokens=3, hidden=32):
    """Whether a first request sent (token ids, deep prompts, prompt vectors, table digest)."""
    return (len(sent) == 4 and sent[0] == ((rows, tokens), torch.int64) and sent[2] == ((1, prompt_tokens, hidden),
            torch.float32) and sent[3] == ((32,), torch.uint8))


@pytest.mark.swarm
@pytest.mark.parametrize("tuning_mode", ["ptune", "deep_ptune"])
def test_token_ids_go_in_the_read_positions_come_out_and_the_logits_are_unchanged(two_span_swarm, tiny_model,
                                                                                  tmp_path, tuning_mode):
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode=tuning_mode, pre_seq_len=3)
    batches = [_right_padded_rows([9, 4, 1, 9, 6]), _right_padded_rows([3], seed=1), _right_padded_rows([17, 2], 2)]
    remote, expected, calls, (remote_hidden, local_hidden) = _remote_and_local(
        two_span_swarm, tiny_model, checkpoint, batches)
    assert_same_bits(remote, expected, "the logits of each batch, the swarm against local")
    assert_same_bits(remote_hidden, local_hidden, "hidden_states(): petals' own requests, against local")
    forwards = calls[:2 * len(batches)]  # the logits' forwards; then hidden_states()'
    assert len(calls) == 2 * len(batches) + 2
    for (first, last), ids in zip(zip(forwards[::2], forwards[1::2]), batches):
        rows, tokens = ids.shape
        assert _ids_sent(first[1], rows, tokens), first[1]  # the server at block 0 looks them up
        assert first[3] == (rows, tokens + 3, 32) and POSITIONS_KEY not in first[2]  # it feeds the next server
        assert last[1][0] == ((rows, tokens + 3, 32), torch.float32)
        lengths = (ids != 0).sum(1)
        assert last[2][POSITIONS_KEY] == (lengths - 1 + 3).tolist()  # each row's last token, after the prompts
        assert last[3] == (rows, 1, 32)  # what came back: one position per row
    for _, sent, metadata, answer in calls[-2:]:  # petals' own: hidden states in, every position out
        assert POSITIONS_KEY not in metadata and len(sent) == 2 and answer[1] == batches[0].shape[1] + 3


@pytest.mark.swarm
def test_a_batch_split_into_requests_reads_each_requests_positions(two_span_swarm, tiny_model, tmp_path):
    from inprocess_cli import one_thread

    from dist_eval.backends import load_model
    from dist_eval.backends.petals.requests import RequestTooLarge, learn_server_limit

    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), pre_seq_len=3)
    ids = _right_padded_rows([9, 4, 1, 9, 6, 2, 7])
    patch, calls = _recording_forwards()
    petals = load_model("petals", tiny_model, checkpoint=checkpoint, initial_peers=two_span_swarm.initial_peers,
                        dht_prefix=two_span_swarm.dht_prefix)
    try:
        with one_thread(), torch.no_grad(), patch:
            learn_server_limit(petals.module.sequence_manager, RequestTooLarge(3 * (9 + 3)), row_tokens=9 + 3)
            split = petals.module(ids)  # requests of 3, 3 and 1 rows
    finally:
        petals.close()
    with one_thread(), torch.no_grad():
        local = load_model("local", tiny_model, checkpoint=checkpoint).module(ids)
    assert_within_rounding(split, local, "the logits of a batch split in three requests, against local",
                           why="the server's limit cuts the batch into requests of fewer rows")
    assert sorted(len(sent) == 4 and sent[0][0] for _, sent, metadata, _ in calls if POSITIONS_KEY not in metadata) \
        == [(1, 9), (3, 9), (3, 9)]
    assert sorted(positions for _, _, metadata, _ in calls if (positions := metadata.get(POSITIONS_KEY))) == \
        sorted([[8 + 3, 3 + 3, 0 + 3], [8 + 3, 5 + 3, 1 + 3], [6 + 3]])
    assert sorted(answer for _, _, metadata, answer in calls if POSITIONS_KEY in metadata) == \
        [(1, 1, 32), (3, 1, 32), (3, 1, 32)]


@pytest.mark.swarm
def test_a_client_whose_token_embeddings_differ_sends_hidden_states(two_span_swarm, tiny_model, tmp_path):
    """The same blocks, other token embeddings (one value changed): the servers' table is
    not the client's, so the client embeds, and its logits are those of its own model."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = str(tmp_path / "other")
    shutil.copytree(tiny_model, other)
    weights = load_file(os.path.join(other, "model.safetensors"))
    weights["model.embed_tokens.weight"][7, 3] += 0.5
    save_file(weights, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), pre_seq_len=3)
    batches = [_right_padded_rows([9, 4, 1]), _right_padded_rows([5, 11], seed=3)]
    remote, expected, calls, _ = _remote_and_local(two_span_swarm, other, checkpoint, batches)
    assert_same_bits(remote, expected, "the logits of each batch, the swarm against local")
    firsts = [sent for _, sent, metadata, _ in calls[:2 * len(batches)] if POSITIONS_KEY not in metadata]
    assert firsts == [[((ids.shape[0], ids.shape[1] + 3, 32), torch.float32), ((0,), torch.float32)]
                      for ids in batches]  # hidden states (and no deep prompts), not token ids


@pytest.mark.swarm
def test_a_server_of_petals_own_is_sent_hidden_states_and_answers_every_position(stock_swarm, tiny_model, tmp_path):
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode="deep_ptune", pre_seq_len=3)
    batches = [_right_padded_rows([9, 4, 1, 9, 6]), _right_padded_rows([5, 11], seed=3)]
    remote, expected, calls, _ = _remote_and_local(stock_swarm, tiny_model, checkpoint, batches)
    assert len(remote) == len(expected) == len(batches)
    assert_same_bits(remote, expected, "the logits of each batch, the swarm against local")
    assert len(calls) >= len(batches), calls  # every batch's forward was recorded: the checks below see each
    for (_, sent, metadata, answer), ids in zip(calls[:len(batches)], batches):
        shape = (ids.shape[0], ids.shape[1] + 3, 32)
        assert len(sent) == 2 and sent[0] == (shape, torch.float32)  # no table offered: hidden states
        assert POSITIONS_KEY in metadata and answer == shape  # asked, and ignored: every position came back


@pytest.mark.swarm
@pytest.mark.parametrize("family", ["bloom", "llama"])
def test_what_goes_to_a_bf16_server_goes_in_its_dtype_and_the_logits_equal_petals_own_requests(tmp_path, family,
                                                                                                 split_swarm):
    """A bfloat16 server: BLOOM's client (it keeps its embedding step) sends hidden states,
    Llama's the token ids and prompt vectors, each in bfloat16 before they leave; the
    logits equal those of petals' own requests (float32 sent, converted by the server) bit
    for bit. (The server forked from split_swarm's fork server: its imports once.)"""
    from inprocess_cli import one_thread

    from dist_eval.backends import load_model
    from dist_eval.swarm import LocalSwarm

    folder = build_tiny_model(str(tmp_path / family), family=family)
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode="deep_ptune", pre_seq_len=3)
    batches = [_right_padded_rows([9, 4, 1, 9, 6]), _right_padded_rows([5, 11], seed=3)]
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}), forking_from(split_swarm), \
            LocalSwarm(folder, num_servers=1, dht_prefix=f"wire-{family}-bf16", torch_dtype="bfloat16") as swarm:
        patch, calls = _recording_forwards()
        petals = load_model("petals", folder, checkpoint=checkpoint, initial_peers=swarm.initial_peers,
                            dht_prefix=swarm.dht_prefix)
        try:
            with one_thread(), patch:
                with torch.no_grad():
                    wire = [petals.module(ids) for ids in batches]
                with torch.enable_grad():  # a training step: petals' own requests
                    own = [petals.module(ids).detach() for ids in batches]
        finally:
            petals.close()
    assert len(wire) == len(own) == len(batches)
    assert_same_bits(wire, own, "the logits of each batch, dist_eval's wire against petals' own requests")
    # one request per batch on each path, both recorded: the comparison above is of two paths, not one
    assert len(calls) == 2 * len(batches), calls
    for (_, sent, _, answer), ids in zip(calls[:len(batches)], batches):
        rows, tokens = ids.shape
        if family == "llama":
            assert [dtype for _, dtype in sent] == [torch.int64, torch.bfloat16, torch.bfloat16, torch.uint8]
            assert sent[2][0] == (1, 3, 32)
        else:
            assert sent == [((rows, tokens + 3, 32), torch.bfloat16), ((4, 1, 3, 32), torch.bfloat16)]
        assert answer == (rows, 1, 32)
    assert all(sent[0][1] == torch.float32 for _, sent, _, _ in calls[len(batches):])  # petals' own: float32


@pytest.mark.swarm
def test_a_table_saved_in_float16_is_looked_up_as_the_client_reads_it(tiny_model, tmp_path, split_swarm):
    """The server keeps the table as saved (float16, half the memory) and widens the rows it
    looks up; the client reads the same table in float32: same digest, token ids sent, the
    logits those of the local backend bitwise. (The server forked from split_swarm's fork server.)"""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from dist_eval.swarm import LocalSwarm

    half = str(tmp_path / "half")
    shutil.copytree(tiny_model, half)
    weights = {k: v.to(torch.float16) for k, v in load_file(os.path.join(half, "model.safetensors")).items()}
    save_file(weights, os.path.join(half, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(half, "config.json")))
    json.dump({**config, "torch_dtype": "float16"}, open(os.path.join(half, "config.json"), "w"))
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), pre_seq_len=3)
    batches = [_right_padded_rows([9, 4, 1, 9, 6]), _right_padded_rows([5, 11], seed=3)]
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}), forking_from(split_swarm), \
            LocalSwarm(half, num_servers=1, dht_prefix="wire-half", torch_dtype="float32") as swarm:
        remote, expected, calls, _ = _remote_and_local(swarm, half, checkpoint, batches)
    assert len(remote) == len(expected) == len(batches)
    assert_same_bits(remote, expected, "the logits of each batch, the swarm against local")
    assert len(calls) >= len(batches), calls  # every batch's forward was recorded: the checks below see each
    for (_, sent, _, answer), ids in zip(calls[:len(batches)], batches):
        assert _ids_sent(sent, *ids.shape) and answer == (ids.shape[0], 1, 32)


def _saved_by_transformers_5(model: str, folder: str, rope_theta: float) -> str:
    """A copy of ``model`` whose config.json is in transformers 5.x's form: RoPE in rope_parameters."""
    import json
    import shutil

    shutil.copytree(model, folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_theta": rope_theta, "rope_type": "default"}
    config.pop("rope_theta", None)  # the 4.x form (the pinned stack saved tiny_model so)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


@pytest.mark.swarm
def test_a_folder_saved_by_transformers_5_is_refused_on_stock_servers_that_would_read_it_wrong(stock_swarm, tiny_model,
                                                                                                   tmp_path):
    """petals 2.2's own servers read config.json's top level only: a 5.x folder whose RoPE is the default they
    take is exact on them; one whose rope_theta they would miss is refused in one line naming the field and the
    flag, unless the user says the servers read a copy in the 4.x form."""
    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError

    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), pre_seq_len=3)
    batches = [_right_padded_rows([9, 4, 1, 9, 6])]
    default = _saved_by_transformers_5(tiny_model, str(tmp_path / "default"), 10000.0)
    remote, expected, _, _ = _remote_and_local(stock_swarm, default, checkpoint, batches)
    assert_same_bits(remote, expected, "a 5.x folder of the default RoPE on stock servers, against local")
    other = _saved_by_transformers_5(tiny_model, str(tmp_path / "other"), 500000.0)
    swarm = dict(initial_peers=stock_swarm.initial_peers, dht_prefix=stock_swarm.dht_prefix)
    with pytest.raises(UsageError) as refused:
        load_model("petals", other, checkpoint=checkpoint, **swarm)
    message = str(refused.value)
    assert "are stock petals servers, which compute this llama model without its config.json's rope_theta 500000.0 " \
           "(saved in transformers 5.x's form, rope_parameters" in message, message
    assert "say so with servers_started_from_4x_config (docs" in message and "\n" not in message  # CLI: the flag
    load_model("petals", other, checkpoint=checkpoint, servers_started_from_4x_config=True, **swarm).close()
