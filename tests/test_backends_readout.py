"""dist_eval.backends.readout: the last server of a forward answers only the positions the
classifier head reads, and the logits stay those of the local backend, bit for bit; a
server of petals' own (which ignores the request) answers every position, and the client
takes the positions itself. The swarm tests are marked `swarm`."""
import os
from unittest import mock

import pytest
import torch
from conftest import REPO, build_checkpoint

from dist_eval.backends.readout import POSITIONS_KEY, _check_answer, read_positions

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


# ------------------------------------------------------------------ on real swarms


def _right_padded_rows(lengths, seed=0):
    """Rows of random word ids (never the pad id 0) of these lengths, right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(2, 60, (length,), generator=g)
    return ids


def _recording_forwards():
    """(patch, calls): each remote forward's (blocks, shape sent, metadata, shape answered),
    through dist_eval's readout and through petals' own forward alike."""
    import contextlib

    from hivemind import MSGPackSerializer
    from petals.client import remote_forward_backward, sequential_autograd

    calls = []
    real = remote_forward_backward.run_remote_forward

    async def recording(uid, stub, rpc_info, *inputs, metadata=None, **kwargs):
        (answer,) = await real(uid, stub, rpc_info, *inputs, metadata=metadata, **kwargs)
        calls.append((uid, tuple(inputs[0].shape), MSGPackSerializer.loads(metadata), tuple(answer.shape)))
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
    from dist_eval.backends.compat import import_petals

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
def two_span_swarm(tiny_model):
    """dist_eval's servers, holding blocks 0:2 and 2:4: every forward crosses both."""
    from test_backends_petals import one_thread_swarm

    yield from one_thread_swarm(tiny_model, num_servers=2, blocks_per_server=2, dht_prefix="readout")


@pytest.fixture(scope="module")
def stock_swarm(tiny_model):
    """One server of petals' own (tests/stock_petals_server.py) holding every block."""
    from test_backends_petals import one_thread_swarm

    tests = os.path.join(REPO, "tests")
    with mock.patch("dist_eval.swarm.local.SERVER_MODULE", "stock_petals_server"), \
            mock.patch.dict(os.environ, {"PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH"))
                                                                       if p)}):
        yield from one_thread_swarm(tiny_model, num_servers=1, dht_prefix="readout-stock")


@pytest.mark.swarm
@pytest.mark.parametrize("tuning_mode", ["ptune", "deep_ptune"])
def test_the_last_server_answers_the_read_positions_and_the_logits_are_unchanged(two_span_swarm, tiny_model,
                                                                                 tmp_path, tuning_mode):
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode=tuning_mode, pre_seq_len=3)
    batches = [_right_padded_rows([9, 4, 1, 9, 6]), _right_padded_rows([3], seed=1), _right_padded_rows([17, 2], 2)]
    remote, expected, calls, (remote_hidden, local_hidden) = _remote_and_local(
        two_span_swarm, tiny_model, checkpoint, batches)
    for got, want in zip(remote, expected):
        assert torch.equal(got, want)
    assert torch.equal(remote_hidden, local_hidden)  # hidden_states(): every position, as before
    forwards = calls[:2 * len(batches)]  # the logits' forwards; then hidden_states()' (unread)
    assert len(calls) == 2 * len(batches) + 2
    for (first, last), ids in zip(zip(forwards[::2], forwards[1::2]), batches):
        rows, length = ids.shape[0], ids.shape[1] + 3
        assert first[3] == first[1] == (rows, length, 32) and POSITIONS_KEY not in first[2]  # feeds the next server
        lengths = (ids != 0).sum(1)
        assert last[2][POSITIONS_KEY] == (lengths - 1 + 3).tolist()  # each row's last token, after the prompts
        assert last[3] == (rows, 1, 32)  # what crossed the wire: one position per row
    assert all(POSITIONS_KEY not in metadata and answer[1] > 1 for _, _, metadata, answer in calls[-2:])


@pytest.mark.swarm
def test_a_batch_split_into_requests_reads_each_requests_positions(two_span_swarm, tiny_model, tmp_path):
    from inprocess_cli import one_thread

    from dist_eval.backends import load_model
    from dist_eval.backends.requests import RequestTooLarge, learn_server_limit

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
    assert torch.allclose(split, local, rtol=1e-5, atol=1e-6)  # rows cut differently: float rounding at most
    assert sorted(positions for _, _, metadata, _ in calls if (positions := metadata.get(POSITIONS_KEY))) == \
        sorted([[8 + 3, 3 + 3, 0 + 3], [8 + 3, 5 + 3, 1 + 3], [6 + 3]])
    assert sorted(answer for _, _, metadata, answer in calls if POSITIONS_KEY in metadata) == \
        [(1, 1, 32), (3, 1, 32), (3, 1, 32)]


@pytest.mark.swarm
def test_a_server_of_petals_own_answers_every_position_and_the_client_reads_them(stock_swarm, tiny_model, tmp_path):
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode="deep_ptune", pre_seq_len=3)
    batches = [_right_padded_rows([9, 4, 1, 9, 6]), _right_padded_rows([5, 11], seed=3)]
    remote, expected, calls, _ = _remote_and_local(stock_swarm, tiny_model, checkpoint, batches)
    for got, want in zip(remote, expected):
        assert torch.equal(got, want)
    forwards = calls[:len(batches)]
    for (_, sent, metadata, answer), ids in zip(forwards, batches):
        assert POSITIONS_KEY in metadata  # asked, and ignored: every position came back
        assert answer == sent == (ids.shape[0], ids.shape[1] + 3, 32)
