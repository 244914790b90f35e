"""On a real private Petals swarm (server processes on 127.0.0.1): the petals backend
gives the same predictions for N=1 (one rank in this process) and N=2 (two ranks in a gloo group,
forked: conftest's run_ranks), and the same logits as the local backend, bitwise (fp32). Marked
`swarm`: run alone with `pytest -m swarm`."""
import json
import time
from pathlib import Path
from unittest import mock

import pytest
from conftest import build_checkpoint, forking_from, one_thread_swarm, read_jsonl, run_ranks, write_csv
from float_promises import assert_same_bits, assert_within_rounding
from inprocess_cli import run_cli_in_process

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def swarm(tiny_swarm):
    return tiny_swarm


def local_in_process(args):
    """One rank in this process (one thread: a torchrun rank's bits): the local backend's reference,
    or petals N=1."""
    assert run_cli_in_process(args, hide_modules=("matplotlib",)) == 0


@pytest.fixture(scope="module")
def data_csv(tmp_path_factory):
    return write_csv(str(tmp_path_factory.mktemp("petals") / "data.csv"), 41, seed=11)


def petals_args(swarm, model, checkpoint, data, out, *extra):
    return ["--model", model, "--data-files", data, "--checkpoint", checkpoint, "--output-dir", str(out),
            "--initial-peers", *swarm.initial_peers, "--dht-prefix", swarm.dht_prefix, "--batch-size", "8",
            "--save-logits", *extra]


@pytest.mark.multiproc
@pytest.mark.parametrize("tuning_mode", ["ptune", "deep_ptune"])
def test_petals_equals_local_and_is_exact_across_ranks(swarm, tiny_model, data_csv, tmp_path, tuning_mode,
                                                      no_figures, capfd, rank_zygote):
    """Petals N=2 on two forked ranks (conftest's run_ranks; the launch is not what is tested here:
    torchrun on a swarm is test_swarm_failover's, test_launch's, test_families_swarm's); petals N=1 and
    the local reference in this process (one rank, one thread: a torchrun rank's bits; a one-rank
    launch is not what is tested here, and cost a torchrun start: test_families_swarm.py and
    test_swarm_supervisor.py launch one rank on a swarm)."""
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode=tuning_mode, pre_seq_len=4)
    outs = {}
    for name, nproc, extra in (("petals1", 1, []), ("petals2", 2, []), ("local1", 1, ["--backend", "local"])):
        if tuning_mode == "deep_ptune" and name == "petals1":
            continue  # N=1 vs N=2 is covered with ptune; keep the suite short
        folder = tmp_path / name
        if name == "petals2":
            proc = run_ranks(rank_zygote, petals_args(swarm, tiny_model, checkpoint, data_csv, folder, *extra),
                             nproc=nproc, env=no_figures)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
        elif name == "petals1":
            capfd.readouterr()
            local_in_process(petals_args(swarm, tiny_model, checkpoint, data_csv, folder, *extra))
            stderr = capfd.readouterr().err
            assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
        else:
            local_in_process(["--model", tiny_model, "--data-files", data_csv, "--checkpoint", checkpoint,
                              "--output-dir", str(folder), "--batch-size", "8", "--save-logits", *extra])
        outs[name] = read_jsonl(folder / "predictions.jsonl")
    assert [r["index"] for r in outs["petals2"]] == list(range(41))
    # the JSON floats are the exact float32 values, and every row matches
    assert_same_bits(outs["petals2"], outs["local1"], "predictions.jsonl, petals N=2 against local N=1")
    if "petals1" in outs:
        assert_same_bits(outs["petals1"], outs["petals2"], "predictions.jsonl, petals N=1 against N=2")
    metrics = json.load(open(tmp_path / "petals2" / "metrics.json"))
    assert metrics["run"]["backend"] == "petals" and metrics["run"]["world_size"] == 2
    assert metrics["num_samples"] == 41
    # provenance: the servers as announced in the DHT, identical replicas (one local swarm)
    swarm_facts = metrics["run"]["swarm"]
    assert swarm_facts["identical_replicas"] and swarm_facts["mixed_blocks"] == []
    servers = swarm_facts["servers"]
    assert servers and all(s["peer_id"] and s["petals_version"] and s["torch_dtype"] for s in servers)
    assert min(s["blocks"][0] for s in servers) == 0
    assert "swarm" not in json.load(open(tmp_path / "local1" / "metrics.json"))["run"]


@pytest.mark.multiproc
def test_wrong_dht_prefix_names_missing_blocks_in_bounded_time(swarm, tiny_model, tiny_checkpoint, data_csv, tmp_path,
                                                              rank_zygote):
    started = time.monotonic()
    args = petals_args(swarm, tiny_model, tiny_checkpoint, data_csv, tmp_path, "--swarm-timeout", "5")
    args[args.index("--dht-prefix") + 1] = "not-this-model"
    proc = run_ranks(rank_zygote, args, nproc=2, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dist_eval: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "no server in the swarm holds block(s) [0, 1, 2, 3]" in errors[0] and "--dht-prefix" in errors[0]
    assert time.monotonic() - started < 60


@pytest.fixture(scope="module")
def small_request_swarm(tiny_model, tiny_swarm):
    """One server that accepts requests of at most 96 tokens (--max_batch_size 96), one thread; forked
    from tiny_swarm's fork server (conftest.forking_from: its imports once)."""
    with forking_from(tiny_swarm):
        swarm = one_thread_swarm(tiny_model, num_servers=1, dht_prefix="dist-eval-small",
                                 extra_server_args=["--max_batch_size", "96"])
        started = next(swarm)
    yield started
    swarm.close()


@pytest.mark.multiproc
def test_a_batch_over_the_servers_max_batch_size_is_split_not_failed(small_request_swarm, tiny_model, tiny_checkpoint,
                                                                     data_csv, tmp_path, no_figures, rank_zygote):
    # batches of 8 rows x (8 prompt vectors + up to ~30 tokens) are well over 96 tokens:
    # the server refuses each such request, each rank learns 96 and resends the batch split
    # (two ranks forked: conftest's run_ranks; the local reference in this process, one thread: a rank's bits)
    outs, stderr = {}, {}
    for name, extra in (("petals", []), ("local", ["--backend", "local"])):
        args = petals_args(small_request_swarm, tiny_model, tiny_checkpoint, data_csv, tmp_path / name, *extra)
        if name == "local":
            local_in_process(args[:args.index("--initial-peers")] + args[args.index("--batch-size"):])
        else:
            proc = run_ranks(rank_zygote, args, nproc=2, timeout=240, env=no_figures)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
            stderr[name] = proc.stderr
        outs[name] = read_jsonl(tmp_path / name / "predictions.jsonl")
    learned = [line for line in stderr["petals"].splitlines() if "sending requests of at most 96 tokens" in line]
    assert 1 <= len(learned) <= 2, stderr["petals"][-3000:]  # once per rank that met a big batch
    assert "failed a request" not in stderr["petals"]  # the server was not taken for a failed one
    assert [r["index"] for r in outs["petals"]] == list(range(41))
    assert [r["pred"] for r in outs["petals"]] == [r["pred"] for r in outs["local"]]
    assert_within_rounding([r["logits"] for r in outs["petals"]], [r["logits"] for r in outs["local"]],
                           "the logits, batches split to the server's limit against local",
                           why="the server's limit cuts each batch into requests of fewer rows")


def test_a_row_longer_than_the_servers_max_batch_size_is_one_clear_error(small_request_swarm, tiny_model,
                                                                          tiny_checkpoint, tmp_path, capfd):
    """One rank, the CLI's code in this process (the refusal is the client's, not the launch's)."""
    data = write_csv(str(tmp_path / "long.csv"), 6, seed=3, max_words=200)
    capfd.readouterr()
    code = run_cli_in_process(petals_args(small_request_swarm, tiny_model, tiny_checkpoint, data, tmp_path / "out",
                                          "--swarm-timeout", "20"))
    stderr = capfd.readouterr().err
    assert code != 0
    errors = [line for line in stderr.splitlines() if line.startswith("dist_eval: error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "96 tokens, its --max_batch_size" in errors[0] and "--max-length" in errors[0], errors[0]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_deep_prompts_travel_once_per_request(swarm, tiny_model, tmp_path):
    """The client dist_eval drives sends deep prompts for one row ([blocks, 1, P, hidden]),
    not one copy per row of the batch; the servers add them to every row, so the logits
    equal the local backend's bit for bit. Also when a batch is split into requests."""
    import torch
    from inprocess_cli import one_thread

    from dist_eval.backends import load_model
    from dist_eval.backends.petals.requests import RequestTooLarge, learn_server_limit
    from dist_eval.backends.petals.shims import import_petals

    import_petals()  # petals' own import needs dist_eval's hivemind compatibility first
    from petals.client import remote_forward_backward, sequential_autograd

    checkpoint = build_checkpoint(str(tmp_path / "deep.pt"), tuning_mode="deep_ptune", pre_seq_len=4)
    input_ids = torch.randint(5, 40, (6, 9), generator=torch.Generator().manual_seed(0))  # no pad (0) inside
    sent = []
    real_forward = sequential_autograd.run_remote_forward

    async def recording_forward(uid, stub, rpc_info, *inputs, **kwargs):
        sent.append([tuple(t.shape) for t in inputs])
        return await real_forward(uid, stub, rpc_info, *inputs, **kwargs)

    petals = load_model("petals", tiny_model, checkpoint=checkpoint, initial_peers=swarm.initial_peers,
                        dht_prefix=swarm.dht_prefix)
    try:
        # no-grad forwards go through dist_eval's wire protocol (which calls petals' function from its
        # module), forwards with gradients through petals' own sequential_forward
        with one_thread(), torch.no_grad(), \
                mock.patch.object(remote_forward_backward, "run_remote_forward", recording_forward), \
                mock.patch.object(sequential_autograd, "run_remote_forward", recording_forward):
            whole = petals.module(input_ids)
            learn_server_limit(petals.module.sequence_manager, RequestTooLarge(3 * (9 + 4)), row_tokens=9 + 4)
            split = petals.module(input_ids)  # two requests of 3 rows each
            compact_sent = list(sent)
            with torch.enable_grad():  # petals' backward needs one prompt per row: none compacted then
                petals.module(input_ids)
    finally:
        petals.module.close()
    with one_thread(), torch.no_grad():
        local = load_model("local", tiny_model, checkpoint=checkpoint).module(input_ids)
    assert_same_bits(whole, local, "the logits of one request, against local")
    assert_within_rounding(split, local, "the logits of a batch split in two requests, against local",
                           why="the server's limit cuts the batch into requests of fewer rows")
    # hidden states (or, to a first server holding the client's token embeddings, token ids:
    # backends.petals.wire) and deep prompts, then what comes with token ids
    assert sent and all(len(shapes) in (2, 4) for shapes in sent)
    with_grad = sent[len(compact_sent):]
    assert with_grad and all(len(shapes) == 2 and shapes[1][1] == shapes[0][0] == 3 for shapes in with_grad)
    rows = [shapes[0][0] for shapes in compact_sent]
    assert sorted(set(rows)) == [3, 6]
    for inputs, prompts, *with_ids in compact_sent:
        assert inputs == ((inputs[0], 9) if with_ids else (inputs[0], 9 + 4, 32))
        assert prompts[1:] == (1, 4, 32) and 1 <= prompts[0] <= 4  # one row of prompts per block of the span


def _with_config(model, folder, **fields):
    """A copy of ``model`` whose config.json has ``fields`` set (None: removed)."""
    import shutil

    shutil.copytree(model, folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=2))
    return str(folder)


def test_a_client_whose_config_json_says_other_rope_than_its_servers_is_refused(swarm, tiny_model, tiny_checkpoint,
                                                                              tmp_path):
    """A release's config.json edited on the client only (its model card's yarn or a linear factor for long
    context) is another model on every block, which the servers compute from their own file: with no other
    server, refused at the load in one line naming the servers and the setting each side has (the servers
    announce theirs: swarm.server.announcing_numerics). The same settings in transformers 4.x's form are the same
    RoPE: served."""
    import torch

    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError

    peers = dict(initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix, checkpoint=tiny_checkpoint)
    theta = json.loads((Path(tiny_model) / "config.json").read_text())["rope_parameters"]["rope_theta"]  # 5.x's save
    scaled = _with_config(tiny_model, tmp_path / "scaled",
                          rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": theta})
    with pytest.raises(UsageError) as refused:
        load_model("petals", scaled, **peers)
    message = str(refused.value)
    assert "\n" not in message and "other RoPE settings" in message, message
    assert 'rope_scaling {"rope_type": "linear", "factor": 2.0} here, null there' in message, message
    assert "no other server serves block(s) [0, 1, 2, 3] of 4" in message, message
    assert message.startswith(f"model_dir={scaled!r}: "), message
    assert any(address.rsplit("/p2p/", 1)[-1][:16] in message for address in swarm.initial_peers), message

    old_form = _with_config(tiny_model, tmp_path / "old_form", rope_parameters=None, rope_theta=theta)
    petals = load_model("petals", old_form, **peers)
    try:
        input_ids = torch.randint(5, 40, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert petals.module(input_ids).shape[0] == 2
        assert "rope_left_out" not in petals.provenance()
    finally:
        petals.module.close()


def test_a_server_of_other_rope_is_left_out_where_others_serve_its_blocks(tiny_swarm, tiny_model, tiny_checkpoint,
                                                                          tmp_path, capsys):
    """One server per config.json, each of every block, under one prefix: the client computes on the server of
    its own file's RoPE and leaves the other out of every route, dist_eval's wire's and petals' own forward's (one
    warning line naming it, no failure or ban; the report's ``rope_left_out``; petals' blocked_servers keep it out
    of later refreshes), whether that server was there at the load or joined later (met at the next routing
    refresh): the logits as without it, bit for bit. A file neither server has is refused."""
    import numpy as np
    import torch

    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError

    theta = json.loads((Path(tiny_model) / "config.json").read_text())["rope_parameters"]["rope_theta"]
    scaled = _with_config(tiny_model, tmp_path / "scaled",
                          rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": theta})
    input_ids = torch.randint(5, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    with forking_from(tiny_swarm):
        plain = one_thread_swarm(tiny_model, num_servers=1, dht_prefix="dist-eval-rope")
        plain_swarm = next(plain)
        try:
            peers = dict(initial_peers=plain_swarm.initial_peers, dht_prefix="dist-eval-rope",
                         checkpoint=tiny_checkpoint)
            client = load_model("petals", tiny_model, **peers)
            try:
                with torch.no_grad():
                    alone, alone_states = client.module(input_ids), client.module.hidden_states(input_ids)
                capsys.readouterr()
                other = one_thread_swarm(scaled, num_servers=1, dht_prefix="dist-eval-rope",
                                         join_peers=plain_swarm.initial_peers)
                next(other)
                try:
                    manager = client.module.sequence_manager
                    manager.update(wait=True)
                    np.random.seed(0)  # petals' own route picks either server at random: without the leave-out, one
                    with torch.no_grad():  # of these eight would be the other's (petals' path: hidden_states)
                        own_path = [client.module.hidden_states(input_ids) for _ in range(8)]
                        beside = client.module(input_ids)
                    left_out = client.provenance()["rope_left_out"]
                    manager.update(wait=True)  # a refresh of the routing table: petals' blocked_servers keep it out
                    listed = {str(peer) for block in manager.state.sequence_info.block_infos for peer in block.servers}
                    err = capsys.readouterr().err
                    said = [line for line in err.splitlines() if "left out of every route" in line]

                    scaled_client = load_model("petals", scaled, **peers)  # the other way round: the plain one out
                    try:
                        with torch.no_grad():
                            scaled_logits = scaled_client.module(input_ids)
                        scaled_left_out = scaled_client.provenance()["rope_left_out"]
                    finally:
                        scaled_client.module.close()
                    tripled = _with_config(tiny_model, tmp_path / "tripled",
                                           rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": theta})
                    with pytest.raises(UsageError, match=r"no other server serves block\(s\) \[0, 1, 2, 3\] of 4"):
                        load_model("petals", tripled, **peers)
                finally:
                    other.close()
            finally:
                client.module.close()
        finally:
            plain.close()
    plain_peer = plain_swarm.initial_peers[0].rsplit("/p2p/", 1)[-1]
    assert list(left_out.values()) == [{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}], left_out
    assert plain_peer not in left_out and list(scaled_left_out) == [plain_peer], (left_out, scaled_left_out)
    assert len(said) == 1 and list(left_out)[0][:16] in said[0], said
    assert "failed a request" not in err, err  # no failure of the server's, no ban
    assert plain_peer in listed and not set(left_out) & listed, (listed, left_out)
    assert_same_bits(beside, alone, "the logits with a server of other RoPE beside, against without it")
    for states in own_path:
        assert_same_bits(states, alone_states, "petals' own forward with a server of other RoPE beside")
    assert not torch.equal(scaled_logits, alone), "the other server computed the same numbers: the test shows nothing"
