"""The swarm audit's cost and power (issue 49), on a local swarm of a random tiny Llama.

    .venv/bin/python benchmarks/bench_audit.py [--rows 10000] [--catch-rows 640] [--catch-runs 20]
        [--honest-rows 640] [--honest-runs 100] [--share 0.03] [--only NAME ...] [--out FILE]

The swarm: three honest servers of every block, and faulty ones under the same prefix, made by
the test-only fault hook (``$DIST_EVAL_TEST_FAULT``, dist_eval.backends.petals.wire): one shifts row 0 of
every answer by 1e-2; one every row of a random 10% of its answers; one a random 10% of the rows
of every answer; (``--only one_row_in_one_in_ten``) one row 0 of a random 10% of its answers
(each server one thread, one connection handler). The model: bench_gpu's "tiny" Llama (random,
float32) and a random p-tuning checkpoint, on the demo's sentences cut to long-tailed lengths
(bench_big_set's data), so that the runs fit a 2-core machine; the audit's figures depend on the
requests, not the model's size.
A client (the API, batch size 64: the CLI's default; ``--share``: the default 3%) sees only the
servers petals' ``allowed_servers`` gives it; each run gets a new audit whose hash is seeded with
the run's number (independent draws of the replayed requests).

1. **cost**: the honest three, one run of ``--rows`` rows: the rows the audit sent to servers
   (``extra_rows``: join probes, row checks, whole replays, third routes; ``extra_positions``: those
   rows times their positions) against the run's rows. Goal: at most 5% of them, plus one batch
   per server (the join probes).
2. **power**: the honest three and one faulty server, ``--catch-runs`` runs (of ``--catch-rows``
   rows for the server wrong in every answer, of ``--rows`` for the others): the share of runs in
   which the faulty server is blamed (left out, its batches evaluated again; or the run stopped
   naming it). Goals over a 10,000-row run: 100% (every answer wrong), at least 90% (one in ten).
3. **false blame**: the honest three, ``--honest-runs`` runs of ``--honest-rows`` rows: runs with
   any server blamed or any mismatch. Goal: none in 100.
4. **numerics** (``--only numerics``): the honest three with two more honest servers, one in
   bfloat16 and one computing with AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``: the same announced
   numerics as the three, other last bits), every request replayed whole (share 1), ``--numerics-runs``
   runs of ``--honest-rows`` rows, under today's rule (4 ulps between servers announcing the same
   numerics) and, side by side, under the rule before it (bit for bit between them): runs with a
   server blamed, which, and the largest honest difference between other numerics. Goal: none blamed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("DIST_EVAL_ROW_STORE", "off")  # every run evaluates every row
os.environ.setdefault("OMP_NUM_THREADS", "1")  # the servers' threads: the machine's two cores are shared

BATCH_SIZE = 64  # the CLI's default (dist_eval.config.DEFAULT_BATCH_SIZE)
PREFIX = "bench-audit"
# scenario -> (the faulty server's fault, the share of the rows it gets wrong: its rows' or its answers')
FAULTS = {"always_wrong": ("shift", 1.0), "one_in_ten_wrong": ("shift_all:0.1", 0.1),
          "one_in_ten_rows_wrong": ("shift_rows:0.1", 0.1), "one_row_in_one_in_ten": ("shift:0.1", 0.1)}
SCENARIOS = ["cost", "always_wrong", "one_in_ten_wrong", "one_in_ten_rows_wrong", "one_row_in_one_in_ten",
             "false_blame", "numerics"]
DEFAULT_SCENARIOS = ["cost", "always_wrong", "one_in_ten_wrong", "one_in_ten_rows_wrong", "false_blame"]


def start_swarm(model_dir: str, faulty: list):
    """(the swarms, started: honest three first, then one server for each scenario of ``faulty``; their peer ids)."""
    from dist_eval.swarm import LocalSwarm
    from dist_eval.swarm.wire import TEST_FAULT_ENV

    one_handler = ["--num_handlers", "1"]
    honest = LocalSwarm(model_dir, num_servers=3, dht_prefix=PREFIX, extra_server_args=one_handler).start()
    swarms = [honest]
    for name in faulty:
        with mock.patch.dict(os.environ, {TEST_FAULT_ENV: FAULTS[name][0]}):
            swarms.append(LocalSwarm(model_dir, num_servers=1, dht_prefix=PREFIX, join_peers=honest.initial_peers,
                                     extra_server_args=one_handler).start())
    peers = [p.rsplit("/", 1)[1] for swarm in swarms for p in swarm.initial_peers]
    return swarms, peers


def client(assets: dict, swarm, servers: list, share: float):
    from dist_eval.backends import load_model

    return load_model("petals", assets["model"], checkpoint=assets["checkpoint"], initial_peers=swarm.initial_peers,
                      dht_prefix=PREFIX, audit=share, petals_client_options={"allowed_servers": servers})


def audited_run(model, data, tokenizer, share: float, seed: int) -> dict:
    """One evaluation with a new audit (its hash seeded with ``seed``): its audit facts, and ``stopped``
    (the AuditMismatch's line where the run stopped)."""
    from dist_eval import evaluate
    from dist_eval.backends.petals import audit

    ledger = audit.attach(model.module.sequence_manager, share, seed=seed)
    stopped = None
    try:
        evaluate(model, data, tokenizer=tokenizer, batch_size=BATCH_SIZE, bootstrap_resamples=0)
    except Exception as error:  # noqa: BLE001 - the audit's stop is a result here (wrapped by the ranks' phase)
        if "swarm audit" not in str(error):
            raise
        stopped = str(error)
    return {**ledger.facts(), "stopped": stopped}


def caught(facts: dict, peer: str) -> bool:
    return peer in facts["excluded"] or (facts["stopped"] is not None and peer in facts["stopped"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--catch-rows", type=int, default=640)
    parser.add_argument("--catch-runs", type=int, default=20)
    parser.add_argument("--honest-rows", type=int, default=640)
    parser.add_argument("--honest-runs", type=int, default=100)
    parser.add_argument("--share", type=float, default=0.03)
    parser.add_argument("--numerics-runs", type=int, default=10)
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=DEFAULT_SCENARIOS,
                        help="the figures to measure")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    import bench_big_set

    from dist_eval.backends.tokenizer import load_tokenizer
    from dist_eval.data.load import load_split

    workdir = tempfile.mkdtemp(prefix="bench-audit-")
    cli = bench_big_set.make_assets(workdir, max(args.rows, args.catch_rows, args.honest_rows), seed=0)
    assets = {"model": cli[cli.index("--model") + 1], "checkpoint": cli[cli.index("--checkpoint") + 1]}
    data = load_split(cli[cli.index("--data-files") + 1])
    tokenizer = load_tokenizer(assets["model"])
    started = time.time()
    faulty = [name for name in FAULTS if name in args.only]
    swarms, peers = start_swarm(assets["model"], faulty)
    honest = peers[:3]
    figures = {"share": args.share, "batch_size": BATCH_SIZE,
               "servers": {"honest": honest, **{name: peer for name, peer in zip(faulty, peers[3:])}}}
    try:
        if "cost" in args.only:
            figures["cost"] = cost(assets, swarms[0], honest, data.select(range(args.rows)), tokenizer, args.share)
            print(json.dumps({"cost": figures["cost"]}), flush=True)
        for name, peer in zip(faulty, peers[3:]):
            rows = args.catch_rows if name == "always_wrong" else args.rows
            figures[name] = power(assets, swarms[0], honest, peer, data.select(range(rows)), tokenizer, args,
                                  FAULTS[name][1])
            print(json.dumps({name: figures[name]}), flush=True)
        if "false_blame" in args.only:
            figures["false_blame"] = false_blame(assets, swarms[0], honest, data.select(range(args.honest_rows)),
                                                 tokenizer, args)
            print(json.dumps({"false_blame": figures["false_blame"]}), flush=True)
        if "numerics" in args.only:
            figures["numerics"] = numerics(assets, swarms, honest, data.select(range(args.honest_rows)), tokenizer,
                                           args.numerics_runs)
            print(json.dumps({"numerics": figures["numerics"]}), flush=True)
    finally:
        for swarm in reversed(swarms):
            swarm.stop()
    figures["seconds"] = round(time.time() - started, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    print(json.dumps(figures, indent=1))
    return 0


def cost(assets, swarm, honest, data, tokenizer, share) -> dict:
    model = client(assets, swarm, honest, share)
    try:
        started = time.time()
        facts = audited_run(model, data, tokenizer, share, seed=0)
        seconds = time.time() - started
    finally:
        model.close()
    servers = len([p for p, s in facts["servers"].items() if s["computed"]])
    rows, extra, probes = facts["request_rows"], facts["extra_rows"], facts["join_probe_rows"]
    return {"rows": rows, "requests": facts["requests"], "extra_rows": extra, "join_probe_rows": probes,
            "join_probes": facts["join_probes"], "row_checks": facts["row_checks"],
            "row_checked_rows": facts["row_checked_rows"], "whole_replays": facts["replayed"],
            "escalated": facts["escalated"], "replays_failed": facts["replays_failed"],
            "extra_share_of_rows": round(extra / rows, 4),
            "extra_beyond_probes_share": round((extra - probes) / rows, 4),
            "extra_positions": facts["extra_positions"], "request_positions": facts["request_positions"],
            "extra_share_of_positions": round(facts["extra_positions"] / facts["request_positions"], 4),
            "join_probe_positions": facts["join_probe_positions"],
            "extra_beyond_probes_share_of_positions": round(
                (facts["extra_positions"] - facts["join_probe_positions"]) / facts["request_positions"], 4),
            "servers": servers,
            "goal_rows": round(0.05 * rows + probes, 1), "blamed": sorted(facts["excluded"]),
            "seconds": round(seconds, 1)}


def power(assets, swarm, honest, faulty, data, tokenizer, args, wrong: float) -> dict:
    model = client(assets, swarm, [*honest, faulty], args.share)
    runs, answered, at = [], [], []
    try:
        for seed in range(args.catch_runs):
            facts = audited_run(model, data, tokenizer, args.share, seed=1000 + seed)
            runs.append(caught(facts, faulty))
            answered.append(facts["servers"].get(faulty, {}).get("computed", 0))
            at.append(facts["requests"])
            if any(p in facts["excluded"] for p in honest):
                raise AssertionError(f"an honest server blamed: {facts['excluded']}")
    finally:
        model.close()
    return {"rows": len(data), "runs": len(runs), "caught": sum(runs), "share_caught": sum(runs) / len(runs),
            "faulty_requests_mean": round(sum(answered) / len(answered), 1),
            "requests_mean": round(sum(at) / len(at), 1), "wrong": wrong}


def false_blame(assets, swarm, honest, data, tokenizer, args) -> dict:
    model = client(assets, swarm, honest, args.share)
    blamed, replayed, checks, escalated = 0, 0, 0, 0
    try:
        for seed in range(args.honest_runs):
            facts = audited_run(model, data, tokenizer, args.share, seed=2000 + seed)
            blamed += bool(facts["excluded"] or facts["stopped"] or any(s["mismatches"]
                                                                        for s in facts["servers"].values()))
            replayed, checks, escalated = (replayed + facts["replayed"], checks + facts["row_checks"],
                                           escalated + facts["escalated"])
    finally:
        model.close()
    return {"rows": len(data), "runs": args.honest_runs, "runs_with_blame": blamed, "replays_compared": replayed,
            "row_checks_compared": checks, "escalated": escalated}


def numerics(assets, swarms, honest, data, tokenizer, runs: int) -> dict:
    """Honest servers of other numerics and kernels joined to the honest three (``swarms`` gets them, to
    stop): each rule's runs with a server blamed, who, and the largest honest differences."""
    from dist_eval.backends.petals import audit
    from dist_eval.swarm import LocalSwarm

    join = dict(num_servers=1, dht_prefix=PREFIX, join_peers=swarms[0].initial_peers,
                extra_server_args=["--num_handlers", "1"])
    swarms.append(LocalSwarm(assets["model"], torch_dtype="bfloat16", **join).start())
    with mock.patch.dict(os.environ, {"ATEN_CPU_CAPABILITY": "avx2"}):  # read by its process at its start
        swarms.append(LocalSwarm(assets["model"], **join).start())
    names = {**{p: "honest" for p in honest}, swarms[-2].initial_peers[0].rsplit("/", 1)[1]: "bfloat16",
             swarms[-1].initial_peers[0].rsplit("/", 1)[1]: "avx2"}
    out = {}
    for rule, same in (("4 ulps between the same announced numerics (now)", audit.SAME_NUMERICS_ULPS),
                       ("bit for bit between them (before)", 0.0)):
        model = client(assets, swarms[0], list(names), 1.0)
        blamed, replayed, largest, honest_ulps = [], 0, 0.0, 0.0
        try:
            with mock.patch.object(audit, "SAME_NUMERICS_ULPS", same):
                for seed in range(runs):
                    facts = audited_run(model, data, tokenizer, 1.0, seed=3000 + seed)
                    blamed.append(sorted(names[p] for p in facts["excluded"]) + (["stopped"] if facts["stopped"]
                                                                                  else []))
                    replayed += facts["replayed"]
                    largest = max(largest, facts["max_difference"])
                    honest_ulps = max(honest_ulps, facts["tolerance"]["largest_honest_ulps"])
        finally:
            model.close()
        out[rule] = {"runs": runs, "runs_with_blame": sum(bool(b) for b in blamed),
                     "blamed": {name: sum(name in b for b in blamed) for name in ("honest", "bfloat16", "avx2",
                                                                                   "stopped")},
                     "replays_compared": replayed, "max_difference": largest,
                     "largest_honest_ulps_between_other_numerics": honest_ulps}
    return out


if __name__ == "__main__":
    sys.exit(main())
