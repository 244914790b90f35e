"""The swarm audit (issue 49, dist_eval/backends/petals/audit.py) on real local swarms: an honest swarm's
replays agree bit for bit; a server whose block differs from its replicas' (another revision of
the weights, served under the same prefix) is found on its first request, outvoted by a third
server, named and left out, and so is one answering NaN, the run's logits the local backend's; a
row NaN on every route stops the run naming it; a server caught after answers of it were taken
has its batches evaluated again (the logits the local backend's, none of its rows stored). The CLI
against a swarm it did not start audits 3% of the rows by default (no setting: the default rule), each
server's first request replayed (a join probe), the rows drawn by content checked, each server's unseen
chances those of their formula; a block held by one server is a coverage gap of every replay."""
from __future__ import annotations

import os
import re
import shutil
import time
from unittest import mock

import numpy as np
import pytest
from conftest import REPO, forking_from, free_port, one_thread_swarm
from float_promises import assert_same_bits, assert_within_rounding
from inprocess_cli import one_thread, run_cli_in_process
from safetensors.torch import load_file, save_file

from dist_eval import evaluate
from dist_eval.backends import load_model
from dist_eval.backends.arguments import audit_share
from dist_eval.backends.petals.audit import NonFiniteAnswer, summary_line
from dist_eval.backends.tokenizer import load_tokenizer
from dist_eval.errors import UsageError
from dist_eval.rowstore import blamed_servers
from dist_eval.rowstore.upkeep import key_folders, survey
from dist_eval.swarm.wire import TEST_FAULT_ENV

pytestmark = pytest.mark.swarm


# The tests' odds (a faulty server met on its share of the requests) assume petals' random routes: its
# max_throughput mode picks among a block's servers alike, but gives a server whose ping timed out (2 s by
# default, per routing refresh) a weight of 1e-6 until the next refresh. On a loaded 2-core machine (the
# suite's other worker, nine servers) a ping of a one-handler server can take longer: that server then got
# almost no request for a while, so a shifted answer it gave could be its last one and escape the checks
# (most likely what a suite run once showed: 4 of 80 rows wrong, one batch of 2 and its 2 store copies).
# Pings given 30 s keep the routes random; the servers all answer, so no refresh waits that long.
PING_TIMEOUT = 30.0


def _petals(model_dir, checkpoint, swarm, share, servers=None):
    return load_model("petals", model_dir, checkpoint=checkpoint, initial_peers=swarm.initial_peers,
                      dht_prefix=swarm.dht_prefix, audit=share,
                      petals_client_options={"ping_timeout": PING_TIMEOUT,
                                             **({"allowed_servers": servers} if servers else {})})


def _rows(n):
    return {"text": [" ".join(f"w{(7 * i + j) % 60}" for j in range(3 + i % 5)) for i in range(n)],
            "label": [i % 3 for i in range(n)]}


def _local_and_audited(model_dir, checkpoint, swarm, share, rows, batch_size, servers=None, row_store=None):
    """(the local backend's result, the audited swarm client's, its audit) on ``rows`` rows
    (``servers``: the only ones the client may use; ``row_store``: the swarm run's)."""
    import datasets

    data = datasets.Dataset.from_dict(_rows(rows))
    tokenizer = load_tokenizer(model_dir)
    results = []
    with one_thread():
        for backend in ("local", "petals"):
            model = load_model("local", model_dir, checkpoint=checkpoint) if backend == "local" else \
                _petals(model_dir, checkpoint, swarm, share, servers)
            try:
                store = {"row_store": row_store, "save_interval": 0} if row_store and backend == "petals" else {}
                results.append(evaluate(model, data, tokenizer=tokenizer, batch_size=batch_size, return_logits=True,
                                        bootstrap_resamples=0, **store))
                audit = model.provenance() and model.provenance()["audit"]
            finally:
                model.close()
    return results[0], results[1], audit


@pytest.fixture(scope="module")
def swarm_with_a_changed_replica(tiny_model, tmp_path_factory):
    """Five servers of every block of the tiny Llama under one prefix; the third serves a copy
    whose block 2 differs by 1e-3 in one weight (another revision, say); the fourth answers row 0
    of every request all NaN; the fifth shifts every row of 3 in 4 of its answers after its first
    two (one connection handler, the draws of Random(0): 1st, 2nd right, 3rd to 6th shifted, 7th
    right, ...) (the test-only fault hook, swarm.wire.TEST_FAULT_ENV, each for its own copy of the
    folder); then two servers of part of the model, an honest one of blocks 0:2 and one of blocks
    2:4 that shifts row 0 of every answer; then two more of every block: one in bfloat16 that
    nudges every answer after its first 40 by 16 of its ulps (within the prior tolerance between
    other numerics, beyond a calibrated one; one connection handler) and an honest one computing
    with AVX2 kernels (ATEN_CPU_CAPABILITY: the same announced numerics as the honest two, other
    last bits; spawned first, alone in that environment). The seven join the honest two at once; the six
    but the AVX2 one are forked from the honest swarm's fork server (dist_eval/swarm/forks.py: their imports
    once), each its own process, session and p2pd as any server.
    Yields (the nine servers' peer ids, honest first, then the changed, the NaN, the shifting one,
    the half, the faulty half, the nudging and the AVX2 one; and the first swarm, whose peers the
    client joins)."""

    from dist_eval.swarm import LocalSwarm

    folder = tmp_path_factory.mktemp("faulty")
    changed, nan, shift, half_shift, nudge = (str(folder / name) for name in ("changed", "nan", "shift", "half_shift",
                                                                             "nudge"))
    for copy in (changed, nan, shift, half_shift, nudge):
        shutil.copytree(tiny_model, copy)
    weights = load_file(os.path.join(changed, "model.safetensors"))
    name = next(k for k in sorted(weights) if ".layers.2." in k and k.endswith("q_proj.weight"))
    weights[name] = weights[name] + 1e-3
    save_file(weights, os.path.join(changed, "model.safetensors"), metadata={"format": "pt"})
    faults = {TEST_FAULT_ENV: f"{nan}=nan;{shift}=shift_all:0.75;{half_shift}=shift;{nudge}=nudge:40"}
    honest = one_thread_swarm(tiny_model, num_servers=2, dht_prefix="audit-test")
    with mock.patch.dict(os.environ, faults):  # its fork server's environment: the six forked from it read it
        first = next(honest)
    # each swarm's port from the OS, held from its start (procs.reserve_ports): ports picked here and let go before
    # the swarms bound them could be taken meanwhile by another test process's p2pd (listening on port 0)
    others = [LocalSwarm(copy, num_servers=1, dht_prefix="audit-test", join_peers=first.initial_peers,
                         extra_server_args=["--num_handlers", "1"] if copy in (shift, nudge) else (),
                         block_range=blocks, torch_dtype=dtype)
              for copy, blocks, dtype in zip((changed, nan, shift, tiny_model, half_shift, nudge, tiny_model),
                                             (None, None, None, (0, 2), (2, 4), None, None),
                                             (None,) * 5 + ("bfloat16", None))]
    try:
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2"}):
            others[-1].start_in_background()  # its environment is read as its process is spawned: alone
            deadline = time.monotonic() + 60
            while not others[-1].pgids and getattr(others[-1], "starting_in_background", True) and \
                    time.monotonic() < deadline:
                time.sleep(0.02)
        # the six others forked from the honest swarm's fork server (conftest.forking_from: their imports once),
        # with its environment: one thread, the faults keyed by folder
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", **faults}), forking_from(first):
            for other in others[:-1]:
                other.start_in_background()
            for other in others:
                other.wait_started()
        assert [type(o.servers[0].proc).__name__ for o in others] == ["ForkedProcess"] * 6 + ["Popen"], others
        yield [p.rsplit("/", 1)[1] for p in first.initial_peers + [o.initial_peers[0] for o in others]], first
    finally:  # the servers stopped at once, each in its own thread (one after another: 1-2 s each)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(others)) as pool:
            list(pool.map(lambda other: other.stop(), others))
        honest.close()


def test_a_server_that_computes_other_numbers_or_nan_is_found_named_and_left_out(tiny_model, tiny_checkpoint,
                                                                                swarm_with_a_changed_replica):
    """The changed server's first request is replayed (the join probe), outvoted by a third route;
    the NaN server's answer is retried on another route; each is left out of every route after: the
    run finishes on the two honest servers, its logits the local backend's bit for bit. Each of the
    60 requests takes a random route: all 60 miss one of the faulty servers as main route with
    probability below (3/4)^60 (4e-8)."""
    peers, swarm = swarm_with_a_changed_replica
    odd, nan = peers[2:4]
    expected, got, audit = _local_and_audited(tiny_model, tiny_checkpoint, swarm, 0.5, 60, 1, servers=peers[:4])
    assert_same_bits(got.predictions.logits, expected.predictions.logits, "the logits, the faulty servers left out")
    assert sorted(audit["excluded"]) == sorted([odd, nan]), audit
    assert set(audit["excluded"][odd]["outvoted_by"]) == set(peers[:2]) and audit["excluded"][odd]["difference"] > 0
    assert audit["excluded"][nan]["non_finite"] and audit["excluded"][nan]["difference"] == "inf", audit
    assert audit["max_difference"] == 0.0, audit  # the honest agree bit for bit
    assert audit["max_tolerance"] == 0.0, audit  # compared bit for bit: the four announce the same kernels
    # outvoted on each of its requests in flight before it was left out; none of its answers taken
    for faulty in (odd, nan):
        assert audit["servers"][faulty]["mismatches"] >= 1 and not audit["servers"][faulty]["unchecked"], audit
    assert not any(audit["servers"].get(p, {}).get("mismatches") for p in peers[:2]), audit
    line = summary_line({"swarm": {"audit": audit}})
    assert f"2 server(s) outvoted and left out: {', '.join(sorted([odd, nan]))} (metrics" in line, line


def test_a_server_found_wrong_after_its_answers_were_taken_is_left_out_and_its_batches_evaluated_again(
        tiny_model, tiny_checkpoint, swarm_with_a_changed_replica, tmp_path):
    """The shifting server passes its join probe (its first answers are right), then shifts every row
    of most of its answers, of which the run takes those the share does not check; once a check
    catches one (a row check of the rows drawn, then the request replayed whole, outvoted by the third
    server), it is left out and every batch it answered is evaluated again on the honest two: the
    logits are the local backend's bit for bit, the run goes on. 40 requests of 2 rows: it answers
    about 13, 3 in 4 of them shifted after its 2nd, each seen where one of its 2 rows is drawn (3 in
    4 at share 0.5): all escape with probability about 1e-4."""
    peers, swarm = swarm_with_a_changed_replica
    shifting = peers[4]
    expected, got, audit = _local_and_audited(tiny_model, tiny_checkpoint, swarm, 0.5, 80, 2,
                                              servers=[*peers[:2], shifting], row_store=str(tmp_path))
    assert audit["row_checks"] + audit["escalated"] > 0, audit  # requests of 2 rows, one drawn: row checks
    # caught first (else its answers stand, as the report's odds say): then no row of it may be left
    assert list(audit["excluded"]) == [shifting] and audit["excluded"][shifting]["difference"] > 0, audit
    wrong = np.flatnonzero((got.predictions.logits != expected.predictions.logits).any(axis=1)).tolist()
    assert_same_bits(got.predictions.logits, expected.predictions.logits,
                     f"the logits, its batches evaluated again (rows {wrong} differ; the audit: {audit})")
    assert audit["excluded"][shifting]["outvoted_by"] == sorted(peers[:2]), audit
    assert not any(audit["servers"].get(p, {}).get("mismatches") for p in peers[:2]), audit
    # the row store (written after every batch) serves no row of it, each row recording its servers
    [(folder, key)] = key_folders(str(tmp_path))
    assert blamed_servers(folder) == {shifting} and len(survey(folder, key).rows) == 60  # distinct: _rows repeats
    assert all(servers and shifting not in servers for _, _, servers in survey(folder, key).rows.values())
    redone = audit["redone_batches"]
    assert audit["excluded"][shifting]["blamed_by_ranks"] == [0], audit
    assert (f"1 server(s) outvoted and left out: {shifting}" + (f" ({redone} batch(es) they answered evaluated again"
                                                                if redone else " (metrics")) in summary_line(
        {"swarm": {"audit": audit}})


@pytest.mark.multiproc
def test_a_server_blamed_on_one_rank_has_its_batches_on_every_rank_evaluated_again(tiny_model, tiny_checkpoint,
                                                                                  swarm_with_a_changed_replica,
                                                                                  tmp_path):
    """Two ranks in one gloo group (rank 0 this process, rank 1 a process of its own), each allowed the
    honest two and the changed server (wrong in every answer); rank 0 audits, rank 1 checks nothing
    (tests/audit_ranks_worker.py): rank 0 blames the changed server on its first request through it,
    rank 1 takes its answers unchecked. After the loop the ranks share their blames
    (predict.redo_blamed_on_other_ranks): rank 1 leaves it out and evaluates its batches again, so the
    logits are the local backend's bit for bit, every row once, and the report says who blamed it and
    how many batches each rank redid. 30 batches a rank: each misses the changed server with
    probability (2/3)^30 (5e-6)."""
    import datetime
    import json
    import subprocess
    import sys

    import audit_ranks_worker
    import torch.distributed as dist

    peers, swarm = swarm_with_a_changed_replica
    odd, out, port = peers[2], str(tmp_path / "ranks"), free_port()
    args = [tiny_model, tiny_checkpoint, swarm.initial_peers[0], swarm.dht_prefix, ",".join(peers[:3]), out, "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RANK": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    with open(tmp_path / "rank1.log", "w") as log:
        rank1 = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "audit_ranks_worker.py"), *args],
                                 stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        with one_thread():
            audit_ranks_worker.main(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        code = rank1.wait(timeout=120)
    assert code == 0, open(tmp_path / "rank1.log").read()[-3000:]
    got, audit = np.load(out + ".npz"), json.load(open(out + ".json"))
    assert list(got["indices"]) == list(range(60))  # every row once
    assert_same_bits(got["logits"], _local_logits(tiny_model, tiny_checkpoint, 60),
                     "the logits, rank 1's batches evaluated again")
    assert list(audit["excluded"]) == [odd] and audit["excluded"][odd]["blamed_by_ranks"] == [0], audit
    redone = audit["redone_batches_by_rank"]
    assert redone[1] > 0, audit  # rank 1's batches of it, evaluated again after rank 0's blame
    assert f"({sum(redone)} batch(es) they answered evaluated again" in summary_line({"swarm": {"audit": audit}})
    assert_unseen_chances_follow_their_formula(audit)  # of the counts the ranks' reports add up


def _local_logits(model_dir, checkpoint, rows):
    """The local backend's logits of ``rows`` (datasets_of that many, or a dataset), a row a batch."""
    with one_thread():
        model = load_model("local", model_dir, checkpoint=checkpoint)
        data = datasets_of(rows) if isinstance(rows, int) else rows
        return evaluate(model, data, tokenizer=load_tokenizer(model_dir), batch_size=1,
                        return_logits=True, bootstrap_resamples=0).predictions.logits


def datasets_of(rows):
    import datasets

    return datasets.Dataset.from_dict(_rows(rows))


def _checking_from(model, rows: int, share: float):
    """An on_batch_done that turns the client's audit on (``share``) once ``rows`` rows are done: the
    answers before are taken unchecked (the checks a run makes may miss a server; a later one catches it)."""
    from dist_eval.backends.petals import audit

    ledger, done = audit.ledger_of(model.module.sequence_manager), [0]
    ledger.share = 0.0

    def after(num_rows):
        done[0] += num_rows
        if done[0] >= rows:
            ledger.share = share
    return after


def test_a_server_blamed_in_a_resumed_run_has_its_batches_from_the_resume_folder_evaluated_again(
        tiny_model, tiny_checkpoint, swarm_with_a_changed_replica, tmp_path):
    """A run allowed only the changed server (no other holder: its answers taken unchecked) stores 60
    batches in a resume folder, each with its servers; the newest 30 files removed (as by a kill), a
    run allowed the honest two as well resumes the other 30, blames the changed server on its first
    new request through it and evaluates the 30 stored batches again: the logits are the local
    backend's, every row once; the folder then names the blamed server and serves none of its
    batches (resume.load). 30 new batches: none through it with probability (2/3)^30 (5e-6)."""
    from dist_eval.resume import load

    peers, swarm = swarm_with_a_changed_replica
    odd, folder = peers[2], str(tmp_path / "partial")
    got = []
    for allowed in ([odd], peers[:3]):
        model = _petals(tiny_model, tiny_checkpoint, swarm, 0.5, allowed)
        try:
            with one_thread():
                got.append(evaluate(model, datasets_of(60), tokenizer=load_tokenizer(tiny_model), batch_size=1,
                                    return_logits=True, bootstrap_resamples=0, resume_folder=folder,
                                    save_interval=0))
            audit = model.provenance()["audit"]
        finally:
            model.close()
        if len(got) == 1:
            for name in sorted(os.listdir(folder))[30:]:  # one batch a file (save_interval 0)
                os.remove(os.path.join(folder, name))
    expected = _local_logits(tiny_model, tiny_checkpoint, 60)
    assert not np.array_equal(got[0].predictions.logits, expected)  # the changed server's numbers
    assert list(got[1].predictions.indices) == list(range(60))
    assert_same_bits(got[1].predictions.logits, expected, "the logits, the stored batches evaluated again")
    assert list(audit["excluded"]) == [odd] and audit["redone_batches"] >= 30, audit
    stored, blamed = load(folder, range(60))
    assert list(blamed) == [odd] and len(stored) == 60 and not any(odd in servers for *_, servers in stored.values())


def test_a_server_blamed_has_the_rows_the_row_store_served_this_run_of_it_evaluated_again(
        tiny_model, tiny_checkpoint, swarm_with_a_changed_replica, tmp_path):
    """A run with the audit off (--audit 0), allowed only the changed server, fills a row store with 10
    rows, each recording it; a run of 40 rows allowed the honest two as well is served those 10 at its
    start, then blames the changed server on its first request through it and evaluates the 10 again
    (tokenized then): the logits are the local backend's, every row once, and the report counts them
    evaluated, not served. 30 new batches: none through it with probability (2/3)^30 (5e-6)."""
    peers, swarm = swarm_with_a_changed_replica
    odd, store = peers[2], str(tmp_path / "store")
    model = _petals(tiny_model, tiny_checkpoint, swarm, 0, [odd])
    try:
        with one_thread():
            evaluate(model, datasets_of(10), tokenizer=load_tokenizer(tiny_model), batch_size=1,
                     bootstrap_resamples=0, row_store=store, save_interval=0)
    finally:
        model.close()
    [(folder, key)] = key_folders(store)
    assert len(survey(folder, key).rows) == 10
    assert all(odd in servers for _, _, servers in survey(folder, key).rows.values())
    expected, got, audit = _local_and_audited(tiny_model, tiny_checkpoint, swarm, 0.5, 40, 1, servers=peers[:3],
                                              row_store=store)
    assert list(got.predictions.indices) == list(range(40))
    assert_same_bits(got.predictions.logits, expected.predictions.logits, "the logits, the stored rows evaluated again")
    assert list(audit["excluded"]) == [odd], audit
    facts = got.metrics["run"]["row_store"]
    assert facts["rows_from_store"] == 0 and facts["rows_evaluated"] == 40, facts
    assert blamed_servers(folder) == {odd} and len(survey(folder, key).rows) == 40
    assert not any(odd in servers for _, _, servers in survey(folder, key).rows.values())


def test_a_server_blamed_in_a_later_round_has_its_earlier_rounds_rows_evaluated_again(
        tiny_model, tiny_checkpoint, swarm_with_a_changed_replica):
    """Stopping early in rounds of 30 rows: the first round's answers taken unchecked (the audit turned
    on after it), some from the changed server; the second round blames it, and the first round's
    batches of it are evaluated again and put in place of the rows merged then: the logits are the
    local backend's, the sequence taken again on them, and the report names the decision taken on the
    numbers redone since. 30 batches a round: one misses the changed server with probability 5e-6."""
    peers, swarm = swarm_with_a_changed_replica
    odd = peers[2]
    model = _petals(tiny_model, tiny_checkpoint, swarm, 0.5, peers[:3])
    try:
        with one_thread():
            result = evaluate(model, datasets_of(60), tokenizer=load_tokenizer(tiny_model), batch_size=1,
                              return_logits=True, bootstrap_resamples=0, stop_at_width=0.001, stop_round_rows=30,
                              on_batch_done=_checking_from(model, 30, 0.5))
        audit = model.provenance()["audit"]
    finally:
        model.close()
    assert list(result.predictions.indices) == list(range(60))
    assert_same_bits(result.predictions.logits, _local_logits(tiny_model, tiny_checkpoint, 60),
                     "the logits, the first round's rows evaluated again")
    assert list(audit["excluded"]) == [odd] and audit["redone_batches"] > 0, audit
    stopping = result.metrics["stopping"]
    assert stopping["rounds"] == 2 and stopping["decisions_on_numbers_redone_since"] == [1], stopping


def test_the_calibrated_tolerance_catches_a_server_a_little_off_and_blames_no_honest_one_of_other_numerics(
        tiny_model, tiny_checkpoint, swarm_with_a_changed_replica, tmp_path):
    """Every request replayed (--audit 1), one at a time. First on an honest server in float32 and the
    one in bfloat16, honest for its first 40 answers: each request is answered by one and replayed on
    the other, so 40 requests compare the two numerics and calibrate their tolerance from 64 ulps of
    bfloat16 to max(4, 8 x the largest honest difference, about 0.1 ulp). Then the client's routing
    admits the other honest float32 server and one with AVX2 kernels (the same announced numerics,
    other announced kernels, other last bits: compared within 4 ulps; bit for bit, it was blamed), as servers
    joining the swarm mid-run, while the bfloat16 one turns 16 of its ulps off: it is caught on its
    next request (compared with a float32 replay: replays go to the finest numerics; the prior 64
    ulps would have let it pass), named and left out; no honest server is blamed, every row counts
    once. 60 requests after: none through it with probability (3/4)^60 (3e-8). Each row's logits are those
    of the server whose answer was taken (the row store records it): a float32 server on this machine's
    kernels gives the local backend's bits; the AVX2 one its own last bits; the bfloat16 one (its answers
    before it turned, each agreeing with a float32 replay within the tolerance) bfloat16's numbers, which
    the row store drops once it is blamed; none of its answers after it turned was taken."""
    import datasets

    from dist_eval.rowstore import row_keys

    peers, swarm = swarm_with_a_changed_replica
    nudging, avx2 = peers[7:9]
    # 100 rows of distinct texts (datasets_of repeats every 60): the row store keeps each row's servers
    data = datasets.Dataset.from_dict({"text": [f"w{i // 60} " + _rows(100)["text"][i] for i in range(100)],
                                       "label": _rows(100)["label"]})
    model = _petals(tiny_model, tiny_checkpoint, swarm, 1.0, [peers[0], nudging])
    manager, done = model.module.sequence_manager, [0]

    def after(num_rows):  # as servers joining mid-run: the client's next routing refresh sees them
        done[0] += num_rows
        if done[0] == 40:
            manager.allowed_servers = manager._peer_ids_to_set([*peers[:2], avx2, nudging])
            manager.update(wait=True)
    try:
        with one_thread():
            got = evaluate(model, data, tokenizer=load_tokenizer(tiny_model), batch_size=1, return_logits=True,
                           bootstrap_resamples=0, on_batch_done=after, in_flight=1, row_store=str(tmp_path),
                           save_interval=0)
        audit = model.provenance()["audit"]
    finally:
        model.close()
    assert list(audit["excluded"]) == [nudging], audit
    assert audit["tolerance"]["calibrated"] and audit["tolerance"]["ulps"] < 16, audit["tolerance"]
    for honest in (*peers[:2], avx2):
        assert audit["servers"][honest]["batches"] > 0 and not audit["servers"][honest]["mismatches"], audit
    assert list(got.predictions.indices) == list(range(100))
    [(folder, key)] = key_folders(str(tmp_path))  # its rows but those of the blamed server
    servers_of = {row: set(servers) for row, (_, _, servers) in survey(folder, key).rows.items()}
    taken = [servers_of.get(row.tobytes()) for row in row_keys(data["text"], None)]
    assert all(row < 40 for row, servers in enumerate(taken) if servers is None), taken  # the bfloat16's
    same_kernels = [row for row, servers in enumerate(taken) if servers and servers <= set(peers[:2])]
    other_kernels = [row for row, servers in enumerate(taken) if servers and avx2 in servers]
    assert len(same_kernels) >= 40 and all(servers is None or servers <= {*peers[:2], avx2} for servers in taken)
    local = _local_logits(tiny_model, tiny_checkpoint, data)
    assert_same_bits(got.predictions.logits[same_kernels], local[same_kernels],
                     "the logits of the rows the float32 servers of this machine's kernels answered")
    assert_within_rounding(got.predictions.logits[other_kernels], local[other_kernels],
                           "the logits of the rows the AVX2 server answered",
                           why="its kernels (ATEN_CPU_CAPABILITY=avx2) sum in another order than this machine's best")


def test_a_server_at_fault_on_a_route_of_several_is_found_span_by_span_and_left_out(tiny_model, tiny_checkpoint,
                                                                                      swarm_with_a_changed_replica):
    """A route of two servers (blocks 0:2, then 2:4, whose server shifts row 0 of every answer) is
    outvoted by the two honest servers of every block; its spans are then replayed one at a time on
    them, each given the inputs the route gave it: the first span's answer is confirmed, the second's
    contradicted by one and the other agrees, so its server alone is blamed and left out, the run goes
    on, its logits the local backend's (before, the run stopped: "one of ... is at fault"). The
    client's route is pinned through the two halves (petals draws routes by span length: 1 in 25)."""
    import dataclasses

    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    from petals.client.routing.sequence_manager import RemoteSequenceManager

    peers, swarm = swarm_with_a_changed_replica
    half, faulty = peers[5:7]

    def pinned(manager, start=0, end=None, **kwargs):  # petals' spans of the two halves
        spans, block, end = [], start, len(manager) if end is None else end
        while block < end:
            span = next(s for s in manager.state.sequence_info.spans_containing_block[block]
                        if str(s.peer_id) in (half, faulty))
            spans.append(dataclasses.replace(span, start=block))
            block = span.end
        return spans

    with mock.patch.object(RemoteSequenceManager, "make_sequence", pinned):
        expected, got, audit = _local_and_audited(tiny_model, tiny_checkpoint, swarm, 0.5, 6, 2,
                                                  servers=[*peers[:2], half, faulty])
    assert_same_bits(got.predictions.logits, expected.predictions.logits, "the logits, the faulty half left out")
    assert list(audit["excluded"]) == [faulty], audit
    evidence = audit["excluded"][faulty]
    assert evidence["blocks"] == "2:4" and evidence["route"] == [half, faulty], evidence
    assert evidence["outvoted_by"] == sorted(peers[:2]), evidence
    assert not any(audit["servers"].get(p, {}).get("mismatches") for p in [*peers[:2], half]), audit


def test_a_block_held_by_one_server_is_a_coverage_gap_of_every_replay(tiny_model, tiny_checkpoint,
                                                                     swarm_with_a_changed_replica):
    """A client allowed an honest server of every block and the honest one of blocks 0:2: blocks 2 and 3 have
    one server, which no other can check. No replay can be made, so every request is a join probe (no whole
    replay agrees with either server) whose replay finds no route: each counts blocks 2 and 3 in the report's
    coverage_gaps, and blocks 0 and 1 where its route went through the half too (then no other server of
    them is left either); the servers stay unchecked, unseen with certainty whatever their fault; the summary
    says how many blocks no other server could check. The logits are the local backend's (nothing blamed)."""
    peers, swarm = swarm_with_a_changed_replica
    whole, half = peers[0], peers[5]
    expected, got, audit = _local_and_audited(tiny_model, tiny_checkpoint, swarm, 0.5, 6, 1, servers=[whole, half])
    assert_same_bits(got.predictions.logits, expected.predictions.logits, "the logits, no server checked")
    gaps, servers = audit["coverage_gaps"], audit["servers"]
    assert gaps["2"] == gaps["3"] == audit["requests"] == audit["join_probes"] == 6, audit
    assert gaps.get("0", 0) == gaps.get("1", 0) == servers.get(half, {}).get("computed", 0), audit
    assert not audit["replayed"] and not audit["replays_failed"] and not audit["excluded"], audit
    assert all(s["unchecked"] == s["computed"] and s["unseen_if_always_wrong"] == 1.0 for s in servers.values())
    assert_unseen_chances_follow_their_formula(audit)
    assert (f"0 of {len(servers)} servers checked, {len(gaps)} block(s) with no other server to check them"
            in summary_line({"swarm": {"audit": audit}})), audit


def test_a_row_nan_on_every_route_fails_the_run_in_one_line_naming_its_rows_and_servers(tiny_model, tiny_checkpoint,
                                                                                      swarm_with_a_changed_replica):
    """A client that may use only the NaN server (petals' allowed_servers), audit off: the batch's row
    that comes back NaN has no other route; the run stops naming the dataset's row and the server."""
    import datasets

    peers, swarm = swarm_with_a_changed_replica
    model = load_model("petals", tiny_model, checkpoint=tiny_checkpoint, initial_peers=swarm.initial_peers,
                       dht_prefix=swarm.dht_prefix, audit=0.0, petals_client_options={"allowed_servers": [peers[3]]})
    try:
        with one_thread(), pytest.raises(Exception, match=NonFiniteAnswer.__name__) as caught:
            evaluate(model, datasets.Dataset.from_dict(_rows(4)), tokenizer=load_tokenizer(tiny_model), batch_size=4,
                     bootstrap_resamples=0)
    finally:
        model.close()
    said = str(caught.value)
    assert re.fullmatch(r".*NonFiniteAnswer: the swarm returned NaN or inf hidden states for 1 row\(s\) "
                        rf"\(batch 0, rows [0-3]\) on every route tried: servers {peers[3]}; none of them is counted "
                        r"or stored\. .*", said), said


def test_a_server_blamed_after_answers_of_it_were_taken_stops_the_run_in_one_line():
    """Its earlier answers, unchecked, cannot be told from its good ones: where the caller does not
    evaluate them again (not the forward loop: audit.Redo), the run stops, naming it."""
    from types import SimpleNamespace

    from dist_eval.backends.petals.audit import AuditLedger, ServerAudit, exclude_if_unused, mismatch

    span = lambda peer: SimpleNamespace(peer_id=peer, start=0, end=4)  # noqa: E731
    ledger = AuditLedger(share=0.1, servers={"odd": ServerAudit(computed=5, unchecked=3)})
    args = (ledger, 2, [span("odd")], [span("a")], 0.5, [span("b")], "second")
    assert exclude_if_unused(*args) is None and not ledger.excluded
    error = str(mismatch(*args))
    assert "server odd computes other numbers than its replicas" in error and "taken before this one" in error
    assert len(error.splitlines()) == 1 and ledger.servers["odd"].mismatches == 1
    ledger.servers["fresh"] = ServerAudit(computed=2)  # each of its answers replayed: left out, the run goes on
    assert exclude_if_unused(ledger, 2, [span("fresh")], [span("a")], 0.5, [span("b")], "second") == "second"
    assert list(ledger.excluded) == ["fresh"]
    assert exclude_if_unused(*args, redo=True) == "second" and ledger.excluded["odd"]["answers_taken_unchecked"] == 3


def test_every_batch_a_blamed_server_answered_is_evaluated_again_once_also_one_in_flight_at_the_blame():
    """audit.Redo, the forward loop's: a batch taken before the blame, and one whose forward was in flight
    when it came (consumed after), are each due once; a redo that met the blamed server again stops the run."""
    from dist_eval.backends.petals.audit import AuditLedger, AuditMismatch, Redo, Taken

    ledger, redo = AuditLedger(share=0.1), Redo()
    redo.watch(0, "batch 0", Taken(ledger, frozenset({"x", "a"})))
    redo.watch(1, "batch 1", Taken(ledger, frozenset({"a"})))
    assert redo.due() == []
    ledger.excluded["x"] = {"rows": 1}
    assert redo.due() == [(0, "batch 0")] and redo.due() == []
    redo.redone(0, "batch 0", Taken(ledger, frozenset({"a"})), 1)
    assert redo.due() == []
    redo.watch(2, "batch 2", Taken(ledger, frozenset({"x"})))  # in flight at the blame
    assert redo.due() == [(2, "batch 2")] and redo.due() == []
    with pytest.raises(AuditMismatch, match="x were outvoted .* found no route of other servers"):
        redo.redone(2, "batch 2", Taken(ledger, frozenset({"x"})), 4)


def test_the_rows_drawn_for_a_check_are_the_same_in_any_batch_and_the_share_of_them():
    """A row is drawn by its content up to the position the head reads (right padding, the batch
    around it: no part), so every N and every batch size check the same rows; about the share of them."""
    import torch

    from dist_eval.backends.petals.audit import AuditLedger, ServerAudit, row_digests

    ids = torch.randint(1, 50, (400, 9), generator=torch.Generator().manual_seed(0))
    positions = [3 + i % 6 for i in range(400)]
    ledger = AuditLedger(share=0.25, seed=3, servers={"a": ServerAudit(batches=1)})
    _, drawn = ledger.pick(row_digests(ids, torch.zeros(0), positions), ["a"])
    again = []
    for start in range(0, 400, 7):  # batches of 7, each padded (after its rows' tokens) to its longest
        length = max(positions[start:start + 7]) + 1
        batch = torch.where(torch.arange(9) <= torch.tensor(positions[start:start + 7])[:, None], ids[start:start + 7],
                            0)[:, :length]
        reason, rows = ledger.pick(row_digests(batch, torch.zeros(0), positions[start:start + 7]), ["a"])
        # "share": every row of the batch drawn (the last batch holds one row)
        again += [start + r for r in (rows if reason == "rows" else range(len(batch)) if reason else [])]
    assert again == drawn and 70 <= len(drawn) <= 130, len(drawn)


def test_the_tolerance_between_other_numerics_is_calibrated_on_the_runs_honest_agreement():
    """64 ulps of the coarsest dtype until 32 honest agreements, then 8 times the largest difference
    they showed: an answer 10 ulps off passes before, is caught after; the report says which."""
    from types import SimpleNamespace

    import torch

    from dist_eval.backends.petals import audit

    def span(dtype, kernels=None):
        info = SimpleNamespace(version="2.2.0", torch_dtype=dtype, quant_type="none", adapters=(),
                               **{audit.KERNELS_KEY: kernels})
        return SimpleNamespace(peer_id=dtype, start=0, end=4, server_info=info)

    mixed, answer, ledger = [span("float32"), span("bfloat16")], torch.full((2, 1, 8), 3.0), audit.AuditLedger(0.1)
    ulp = audit.unit(mixed, answer)
    assert ulp == torch.finfo(torch.bfloat16).eps * 3.0  # the same announced numerics, no kernels: 4 ulps
    eps32 = torch.finfo(torch.float32).eps
    assert audit.tolerance(mixed[:1] * 2, answer, ledger) == 4 * torch.finfo(torch.float32).eps * 3.0
    avx2, avx512 = span("float32", "cpu AVX2"), span("float32", "cpu AVX512")  # kernels announced: the same only
    assert audit.tolerance([avx2, avx2], answer) == 0 and audit.tolerance([avx2, avx512], answer) == 4 * 3.0 * eps32
    off = answer + 10 * ulp
    assert audit.tolerance(mixed, answer, ledger) == 64 * ulp and audit.agree(answer, off, 64 * ulp)
    for _ in range(audit.CALIBRATE_AFTER):  # honest replicas half an ulp apart
        ledger.record(["a"], 2, 0.5 * ulp, audit.tolerance(mixed, answer, ledger), ulp)
    assert audit.tolerance(mixed, answer, ledger) == 4 * ulp and not audit.agree(answer, off, 4 * ulp)
    facts = ledger.facts()
    assert facts["tolerance"]["calibrated"] and facts["tolerance"]["ulps"] == 4 and facts["max_tolerance"] == 64 * ulp
    facts["servers"] = {"a": {"batches": 32}}
    assert "tolerance 4 ulps, calibrated on 32 honest agreements (largest 0.5 ulps)" in audit.summary_line(
        {"swarm": {"audit": facts}})


def assert_unseen_chances_follow_their_formula(audit: dict) -> None:
    """Each server's unseen chances in the report are, computed here, (1 - f) ** (its answers checked: replayed
    whole or in their drawn rows elsewhere, and equal) for f = 1 (wrong in every answer) and f = 0.1 (in one in
    ten): docs/cluster.md's "a server wrong in a share f of its answers goes unseen with probability (1 - f)
    to the power of its answers checked"."""
    for peer, server in audit["servers"].items():
        checked = server["batches"] + server["row_checks"]
        assert_same_bits({f: server[key] for f, key in ((1.0, "unseen_if_always_wrong"),
                                                        (0.1, "unseen_if_one_in_ten_wrong"))},
                         {f: (1 - f) ** checked for f in (1.0, 0.1)}, f"server {peer}'s unseen chances, {server}")


def drawn_rows(model_dir, texts, share: float, prompt_tokens: int, seed: int = 0) -> list:
    """The rows the audit draws at ``share``, computed here from docs/cluster.md's rule: each row by a hash
    of its content (its token ids up to the position the head reads, and that position) keyed with the seed,
    drawn where the keyed hash falls below ``share`` of its range: the same rows in any batch."""
    import hashlib

    tokenizer, drawn = load_tokenizer(model_dir), []
    for row, text in enumerate(texts):
        ids = np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)
        content = hashlib.blake2b(ids.tobytes() + repr(prompt_tokens + len(ids) - 1).encode(), digest_size=16)
        keyed = hashlib.blake2b(content.digest(), digest_size=8, key=seed.to_bytes(8, "little")).digest()
        if int.from_bytes(keyed, "little") < share * 2 ** 64:
            drawn.append(row)
    return drawn


def test_the_cli_audits_3_percent_of_the_rows_of_a_swarm_it_did_not_start_by_default(
        tiny_model, tiny_checkpoint, tiny_swarm, tmp_path, capsys, monkeypatch):
    """No --audit and no $DIST_EVAL_AUDIT (the suite's 0 unset: the pipeline's default rule runs), against a
    swarm the run did not start: the report's audit has the share 3%; each server's first request is replayed
    whole on the other (a join probe: one a server, one batch in flight) and agrees, bit for bit; the rows
    drawn at 3% by their content (computed here: 5 of these 100, none in the first request, a probe) are
    checked, in row checks or a whole replay where both rows of a request were drawn, but those that fell in
    the other probe's request (replayed whole anyway); each server's unseen chances follow their formula.
    (The run's own swarm audits nothing: tests/test_cli_default_run.py.)"""
    import csv
    import json

    from conftest import write_csv

    monkeypatch.delenv("DIST_EVAL_AUDIT")
    rows = 100
    data = write_csv(str(tmp_path / "rows.csv"), rows, seed=33)
    with open(data) as f:
        drawn = drawn_rows(tiny_model, [row["text"] for row in csv.DictReader(f)], 0.03, prompt_tokens=3)
    assert drawn == [37, 39, 48, 49, 95], f"the set's drawn rows are not those this test was written for: {drawn}"
    out = str(tmp_path / "out")
    code = run_cli_in_process(["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--data-files", data,
                               "--initial-peers", *tiny_swarm.initial_peers, "--dht-prefix", tiny_swarm.dht_prefix,
                               "--batch-size", "2", "--no-length-buckets", "--in-flight", "1", "--output-dir", out,
                               "--progress", "none"], hide_modules=("matplotlib",))
    said = capsys.readouterr().out
    assert code == 0, said
    audit = json.load(open(os.path.join(out, "metrics.json")))["run"]["swarm"]["audit"]
    assert audit["share"] == 0.03 and audit["requests"] == rows // 2 and audit["request_rows"] == rows, audit
    # the join probes: one a server that computed (both, unless one's pings kept timing out), its first request
    # replayed whole on the other, equal
    servers = audit["servers"]
    assert sum(s["computed"] for s in servers.values()) == audit["requests"], audit
    assert audit["join_probes"] == len(servers) and audit["join_probe_rows"] == 2 * len(servers), audit
    assert all(s["batches"] >= 1 and not s["mismatches"] for s in servers.values()), audit
    assert audit["max_difference"] == 0.0 and audit["max_tolerance"] == 0.0 and not audit["escalated"], audit
    assert sum(s["batches"] for s in servers.values()) == audit["replayed"], audit  # one server a route
    assert sum(s["row_checks"] for s in servers.values()) == audit["row_checks"], audit
    # the drawn rows checked: rows 37, 39 and 95 in row checks, 48 and 49 (one request) replayed whole; but
    # those of the second server's probe (not the first request's: rows 0 and 1, none drawn)
    checked = audit["row_checked_rows"] + audit["replayed_rows"] - audit["join_probe_rows"]
    assert len(drawn) - (audit["join_probe_rows"] - 2) <= checked <= len(drawn), (checked, audit)
    assert not audit["coverage_gaps"] and not audit["replays_failed"] and not audit["excluded"], audit
    assert_unseen_chances_follow_their_formula(audit)
    assert re.search(rf"swarm audit: {audit['replayed']} of {rows // 2} requests \({audit['replayed_rows']} rows\) "
                     rf"replayed on other servers, all equal bit for bit; {audit['row_checks']} more checked in "
                     rf"{audit['row_checked_rows']} drawn rows, .*; (\d) of \1 servers checked \(metrics", said), said


def test_a_share_outside_0_to_1_or_on_the_local_backend_is_refused_in_one_line(tiny_model, monkeypatch):
    assert audit_share(None) == 0.0  # the suite's default (conftest.py)
    monkeypatch.delenv("DIST_EVAL_AUDIT")
    assert audit_share(None) == 0.03
    for wrong in (1.5, -0.1, "x", float("nan")):
        with pytest.raises(UsageError, match="audit.*from 0 .no audit. to 1"):
            audit_share(wrong)
    monkeypatch.setenv("DIST_EVAL_AUDIT", "7")
    with pytest.raises(UsageError, match="DIST_EVAL_AUDIT"):
        audit_share(None)
    from dist_eval.cli import checked_config

    with pytest.raises(UsageError, match="only a swarm's servers are audited"):
        checked_config(model=tiny_model, data_files=["x.csv"], backend="local", audit=0.1)
    assert np.isclose(checked_config(model=tiny_model, data_files=["x.csv"], audit=0.5).audit, 0.5)
