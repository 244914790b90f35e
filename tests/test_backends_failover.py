"""The petals client's failover as dist_eval patches it (dist_eval.backends.petals.failover), and how a
swarm failure is reported (dist_eval.backends), on an in-memory routing table: fast,
no servers. The same behaviour on a real swarm: tests/test_swarm_failover.py."""
import threading

import pytest

NUM_BLOCKS = 4
PLACEMENT = [(0, 2), (2, 4), (0, 4)]  # LocalSwarm's default for 3 servers and 4 blocks


class _NoPings:
    def to_dict(self):
        return {}


def make_manager(placement=PLACEMENT):
    """A RemoteSequenceManager whose routing table lists ``placement`` (no DHT, no thread)."""
    from dist_eval.backends.petals.shims import import_petals

    import_petals()  # every client patch, the failover's included
    from hivemind import PeerID
    from hivemind.dht.node import Blacklist
    from petals import ClientConfig
    from petals.client.routing.sequence_info import RemoteSequenceInfo
    from petals.client.routing.sequence_manager import (
        RemoteSequenceManager,
        SequenceManagerState,
        _SequenceManagerUpdateThread,
    )
    from petals.data_structures import RemoteModuleInfo, ServerInfo, ServerState

    from dist_eval.backends.petals.backend import DEFAULT_CLIENT_OPTIONS

    peers = [PeerID(f"server-{i}".encode()) for i in range(len(placement))]
    uids = [f"test.{b}" for b in range(NUM_BLOCKS)]

    def listing():
        return [RemoteModuleInfo(uids[b], {peers[i]: ServerInfo(ServerState.ONLINE, 1.0, start_block=s, end_block=e)
                                           for i, (s, e) in enumerate(placement) if s <= b < e})
                for b in range(NUM_BLOCKS)]

    info = RemoteSequenceInfo.make_empty(uids)
    info.update_(listing())
    manager = object.__new__(RemoteSequenceManager)
    options = {k: v for k, v in DEFAULT_CLIENT_OPTIONS.items() if k != "show_route"}
    manager.config = ClientConfig(initial_peers=["unused"], dht_prefix="test", **options)
    manager.state = SequenceManagerState(sequence_info=info, banned_peers=Blacklist(manager.config.ban_timeout, 2.0))
    manager.lock_changes = threading.Lock()
    manager._thread = _SequenceManagerUpdateThread(manager.config.update_period, lambda: None)  # never started
    manager._thread.ready.set()
    manager.ping_aggregator = _NoPings()
    return manager, peers, listing


def fail(manager, peer, error=None):
    """What petals does when a request to ``peer`` fails (inside its except block)."""
    try:
        raise error or ConnectionError("connection refused")
    except Exception:
        manager.on_request_failure(peer)


def routes(manager, n=200):
    return [[span.peer_id for span in manager._make_sequence_with_max_throughput(0, NUM_BLOCKS)] for _ in range(n)]


def test_a_failed_server_leaves_routing_at_once(capsys):
    manager, peers, _ = make_manager()
    assert any(peers[2] in route for route in routes(manager))
    fail(manager, peers[2])
    # petals 2.2.0 kept routing to it until its next refresh (update_period): a 63 s stall
    assert all(route == [peers[0], peers[1]] for route in routes(manager))
    # one line on stderr, once per failing streak, not once per retry
    fail(manager, peers[2])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dist_eval: warning:")]
    assert len(warnings) == 1 and "ConnectionError: connection refused" in warnings[0]


def test_unserved_blocks_are_those_whose_every_server_fails():
    from dist_eval.backends.petals.failover import unserved_blocks

    manager, peers, listing = make_manager()
    assert unserved_blocks(manager) == []
    fail(manager, peers[2])
    assert unserved_blocks(manager) == []  # blocks 0-3 still have servers 0 and 1
    fail(manager, peers[1])
    assert unserved_blocks(manager) == [2, 3]
    assert not manager.ready.is_set()  # petals asks for a refresh: a block lost its last server
    # the refresh lists the dead servers again (their DHT records outlive them; petals ignores
    # bans when every server of a block is banned): still unserved, they keep failing
    manager.state.sequence_info.update_(listing())
    assert unserved_blocks(manager) == [2, 3]
    manager.on_request_success(peers[1])  # server 1 is back
    assert unserved_blocks(manager) == []


def test_swarm_failure_is_one_line_naming_blocks_and_flag():
    from dist_eval.backends.petals.failover import swarm_failure
    from dist_eval.errors import UsageError, flag_names

    manager, peers, _ = make_manager()
    fail(manager, peers[1])
    fail(manager, peers[2])
    error = swarm_failure(manager, 10.0, 11.2, OSError("failed to dial:\n  * [/ip4/127.0.0.1/tcp/1] refused"))
    assert isinstance(error, UsageError)
    text = str(error)
    assert "\n" not in text
    # the Python API names the argument; the CLI (inside flag_names) the flag
    assert text.startswith("swarm_timeout=10.0: no working server for block(s) [2, 3] of 4") and "for 11 s" in text
    assert "OSError: failed to dial: * [/ip4/127.0.0.1/tcp/1] refused" in text
    with flag_names():
        cli_text = str(error)
    assert (
        cli_text.startswith("--swarm-timeout 10: no working server for block(s) [2, 3] of 4") and "for 11 s" in cli_text
    )


def test_swarm_failure_names_blocks_from_petals_missing_blocks_error():
    from petals.client.routing.sequence_manager import MissingBlocksError

    from dist_eval.backends.petals.failover import swarm_failure

    manager, _, _ = make_manager()  # no failure recorded: petals found no server listed at all
    text = str(swarm_failure(manager, 60.0, 60.5, MissingBlocksError([1, 2])))
    assert "no working server for block(s) [1, 2] of 4" in text
    text = str(swarm_failure(manager, 60.0, 60.5, MissingBlocksError(3)))
    assert "block(s) [3] of 4" in text


def test_bounded_remote_forward_retries_then_fails(monkeypatch):
    """A remote forward that keeps failing is retried for --swarm-timeout seconds, then
    raises the UsageError; one that recovers within it returns normally."""
    import types

    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.petals.backend import PetalsClassifier
    from dist_eval.errors import UsageError

    manager, peers, _ = make_manager()
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) < 3:
            fail(manager, peers[1])
            raise ConnectionError("refused")
        return "hidden"

    def classifier_over(remote_forward):
        import torch

        layers = types.SimpleNamespace(forward=remote_forward, sequence_manager=manager)
        model = types.SimpleNamespace(layers=layers, embed_tokens=types.SimpleNamespace(weight=torch.zeros(5, 2)))
        config = types.SimpleNamespace(tuning_mode=None, pre_seq_len=0)
        PetalsClassifier(types.SimpleNamespace(model=model, config=config), FAMILIES["llama"], swarm_timeout=30.0)
        return layers.forward  # now the bounded version

    monkeypatch.setattr("time.sleep", lambda s: None)
    assert classifier_over(flaky)() == "hidden" and len(calls) == 3

    clock = [0.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])

    def dead(*args, **kwargs):
        clock[0] += 4.0  # each petals call spends 4 s in its own attempts
        fail(manager, peers[1])
        fail(manager, peers[2])
        raise ConnectionError("refused")

    with pytest.raises(UsageError, match=r"swarm_timeout=30.0: no working server for block\(s\) \[2, 3\]"):
        classifier_over(dead)()
    assert 30.0 <= clock[0] <= 34.0  # gave up at the first check past the deadline
