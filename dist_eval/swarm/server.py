"""Entry point of one swarm server process: ``python -m dist_eval.swarm.server <run_server args>``.

It exists so that server processes import petals through dist_eval.backends.compat (the
hivemind re-exports) exactly like the evaluator ranks do, with dist_eval's server patches
applied in their order (:func:`apply_server_patches`), and so that a server can be
started before the swarm it joins has an address: ``--initial_peers_file PATH`` (ours,
not petals') makes it import petals and torch first (the bulk of a server's start-up),
then wait for PATH to appear, and join the peers listed there (one per line). A local
swarm thus imports all its servers at once instead of one after another. ``--state_file PATH`` (ours
too) is where it reports its state to the swarm that started it (:mod:`dist_eval.swarm.state_file`):
its addresses, then that it serves, or why its start failed.

SIGTERM (a preemption notice) drains the server as SIGINT does: petals' run_server handles only
KeyboardInterrupt gracefully (it announces the blocks OFFLINE, waits until the DHT stored it,
shuts its handlers down, exits 0); without this a SIGTERM killed the server unannounced. Before
the handlers go, the requests in flight finish (:mod:`dist_eval.swarm.drain`).
"""
import os
import signal
import sys
import time
from typing import Optional

from dist_eval.swarm import state_file
from dist_eval.swarm.forks import FORK_SERVER_FLAG

# Ours, not petals': this module waits for this file, then joins the peers in it.
PEERS_FILE_FLAG = "--initial_peers_file"
# How long a server waits for its peers file; its swarm's start timeout ends it sooner.
_PEERS_FILE_WAIT_SECONDS = 600.0


def _wait_for_peers(path: str) -> list:
    """The peers listed in ``path``, once it exists (its writer renames it into place whole)."""
    deadline = time.monotonic() + _PEERS_FILE_WAIT_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"dist_eval.swarm.server: {path} did not appear within {_PEERS_FILE_WAIT_SECONDS:.0f} s; "
                     "the swarm that this server was to join never printed its address.")
        time.sleep(0.05)
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def take_state_file(argv: list) -> list:
    """``argv`` without ``--state_file PATH``, this process reporting its state there from now on."""
    if state_file.FLAG not in argv:
        return argv
    at = argv.index(state_file.FLAG)
    state_file.use(argv[at + 1])
    return [*argv[:at], *argv[at + 2:]]


def server_argv(argv: list) -> list:
    """``argv`` with ``--initial_peers_file PATH`` replaced by ``--initial_peers PEER ...``."""
    if PEERS_FILE_FLAG not in argv:
        return argv
    at = argv.index(PEERS_FILE_FLAG)
    peers = _wait_for_peers(argv[at + 1])
    return [*argv[:at], "--initial_peers", *peers, *argv[at + 2:]]


def _model_and_first_block(argv: list) -> tuple:
    """(the model folder, the first block of ``--block_indices A:B``) of run_server arguments;
    (folder, None) without ``--block_indices`` (petals then picks the blocks at run time).
    """
    first = None
    if "--block_indices" in argv:
        first = int(argv[argv.index("--block_indices") + 1].split(":")[0])
    return argv[0], first


def drain_on_sigterm() -> None:
    """SIGTERM to this process -> KeyboardInterrupt (petals' graceful shutdown). Only here: the
    processes the server forks inherit the handler, and a SIGTERM there (their parent stopping
    them) keeps its default action.
    """
    main_pid = os.getpid()

    def on_sigterm(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the shutdown is under way
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)


# What a forked child of this server inherited in shared memory, kept until it exits
_INHERITED_SHARED_MEMORY: list = []


def _inherited_shared_memory_kept() -> list:
    """Every process a server forks keeps the shared-memory storages it inherits until it exits.

    hivemind shares tensors by name (torch's ``file_system`` strategy), and torch counts a named
    storage's holders in the shared file itself; a fork copies a holder without counting it. A
    child that released an inherited storage (hivemind replaces its per-process buffer of future
    states in each child, and the child's copies of the parent's futures die) brought the count to
    zero and unlinked the file while the parent still used it; a release that reached zero again
    then found no file and aborted its process ("could not unlink the shared memory file", in a
    destructor: terminate). A connection handler died that way while its server started, and the
    server waited for it for good.

    ``UntypedStorage.share_memory_`` notes each storage it names in torch's own cache of shared
    storages (``reductions.shared_cache``: weak references, pruned by torch, where a storage sent or
    received already is); a forked child takes strong references to the live ones, so it releases
    nothing it did not count; the system unmaps its copies when it exits.
    """
    import torch
    from torch.multiprocessing import reductions

    original = torch.UntypedStorage.share_memory_

    def share_memory_(self, *args, **kwargs):
        shared = original(self, *args, **kwargs)
        if self.device.type == "cpu" and torch.multiprocessing.get_sharing_strategy() == "file_system":
            reductions.shared_cache[self._share_filename_cpu_()[1]] = reductions.StorageWeakRef(self)
        return shared

    def keep() -> None:
        live = (torch.UntypedStorage._new_with_weak_ptr(ref.cdata) for ref in dict.values(reductions.shared_cache))
        _INHERITED_SHARED_MEMORY[:] = [storage for storage in live if storage is not None]

    os.register_at_fork(after_in_child=keep)
    share_memory_.__wrapped__ = original
    return [(torch.UntypedStorage, "share_memory_", share_memory_)]


# petals' module of LoRA adapters: it imports bitsandbytes (0.6 s of a server's start on this
# CPU) only to offer using_adapter, which a server without adapters needs as a no-op
_PEFT = "petals.utils.peft"


def _peft_on_demand() -> list:
    """``TransformerBackend.__init__`` without importing petals.utils.peft when nothing loaded it:
    a server with adapters loads it first (its blocks get them before any backend is built) and
    keeps petals' own; one without gets a ``using_adapter`` that defers to petals' once anything
    imports it, else changes nothing (no LoRA layer reads it; the handler refuses an adapter the
    server lacks before the forward).
    """
    import contextlib
    import types

    from petals.server.backend import TransformerBackend

    original = TransformerBackend.__init__
    no_adapters = types.ModuleType(_PEFT, "petals.utils.peft's using_adapter, for a server without adapters")

    def using_adapter(active_adapter):
        real = sys.modules.get(_PEFT)
        return real.using_adapter(active_adapter) if real not in (None, no_adapters) else contextlib.nullcontext()

    no_adapters.using_adapter = using_adapter

    def __init__(self, *args, **kwargs):
        if _PEFT in sys.modules:
            return original(self, *args, **kwargs)
        sys.modules[_PEFT] = no_adapters  # what petals' `import petals.utils.peft` inside it finds
        try:
            return original(self, *args, **kwargs)
        finally:
            if sys.modules.get(_PEFT) is no_adapters:
                del sys.modules[_PEFT]

    __init__.__wrapped__ = original
    return [(TransformerBackend, "__init__", __init__)]


def _own_identity_unchecked() -> list:
    """``P2P.create`` without hivemind's check that no other peer uses the identity file: a server
    dist_eval starts has a file of its own swarm's folder, made for it (and kept over its restarts,
    which begin once the old process group is gone), and the check started a second p2pd and a DHT
    client to ask the swarm (half a second and a process for each server that joins).
    """
    from hivemind.p2p.p2p_daemon import P2P

    original = P2P.create.__func__

    async def create(cls, *args, check_if_identity_free: bool = False, **kwargs):
        return await original(cls, *args, check_if_identity_free=check_if_identity_free, **kwargs)

    create.__wrapped__ = original
    return [(P2P, "create", classmethod(create))]


def _loopback_is_direct() -> list:
    """A server listening on loopback only is reachable directly, by local processes only: petals
    asked the swarm to dial it back (a DHT node with a p2pd of its own, for each server that joins)
    to choose between direct and relayed, and kept a probe (another p2pd) to dial others back for
    them. ``Server.__init__`` then takes it as direct, with no probe: a peer that asks it to check
    a third gets no answer, which petals reads as "unknown" and runs directly. A server on any other
    address is checked, and probes, as petals does.
    """
    import petals.server.server as server_module

    original = server_module.Server.__init__
    protocol = server_module.ReachabilityProtocol
    loopback_only = []  # set by this process's one server, before petals reads it

    def __init__(self, *args, reachable_via_relay=None, **kwargs):
        addresses = [str(address) for address in kwargs.get("host_maddrs") or ()]
        if addresses and all(a.startswith("/ip4/127.") for a in addresses):
            loopback_only.append(True)
            if reachable_via_relay is None:
                reachable_via_relay = False
        return original(self, *args, reachable_via_relay=reachable_via_relay, **kwargs)

    class NoProbeOnLoopback(protocol):
        @classmethod
        def attach_to_dht(cls, dht, *args, **kwargs):
            return None if loopback_only else protocol.attach_to_dht(dht, *args, **kwargs)

    __init__.__wrapped__ = original
    return [(server_module.Server, "__init__", __init__),
            (server_module, "ReachabilityProtocol", NoProbeOnLoopback)]


def state_reporting() -> list:
    """``ModuleContainer.create`` telling the swarm that started this server where it stands
    (:mod:`dist_eval.swarm.state_file`, nothing without ``--state_file``): its addresses as it begins
    (its DHT runs; the servers that join it wait for them), then "up" once it returns (petals creates
    the container started and ready: its blocks served). Again when petals creates another.
    """
    from petals.server.server import ModuleContainer

    original = ModuleContainer.create.__func__

    def create(cls, *args, **kwargs):
        dht = kwargs.get("dht")
        addresses = [str(a) for a in dht.get_visible_maddrs()] if dht is not None else []
        state_file.report(state_file.JOINING, addresses=addresses)
        container = original(cls, *args, **kwargs)
        state_file.report(state_file.UP)
        return container

    create.__wrapped__ = original
    return [(ModuleContainer, "create", classmethod(create))]


def kernels_of(device) -> str:
    """The kernels a server computes with on ``device`` (a torch.device), as it announces them
    (:data:`dist_eval.backends.petals.audit.KERNELS_KEY`): torch's version and, on a CPU, the vector instructions
    torch dispatches to and the threads (another order of sums), on a GPU its name and compute capability.
    """
    import torch

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return (f"torch {torch.__version__} cuda {torch.version.cuda} {torch.cuda.get_device_name(device)} "
                f"sm_{major}{minor}")
    if device.type == "cpu":
        return (f"torch {torch.__version__} cpu {torch.backends.cpu.get_cpu_capability()} "
                f"threads {torch.get_num_threads()}")
    return f"torch {torch.__version__} {device.type}"


def served_rope(model_name_or_path: str, revision=None, token=None) -> Optional[dict]:
    """The RoPE settings of the config.json a server serves (:func:`dist_eval.backends.config_json.rope_settings`),
    a folder's or a hub id's at the server's ``revision`` (petals read it into the cache before); None where it
    cannot be read (then unchecked).
    """
    from dist_eval.backends.config_json import read_config_json, rope_settings

    try:
        if not os.path.isdir(model_name_or_path):
            from transformers.utils import cached_file

            path = cached_file(model_name_or_path, "config.json", revision=revision, token=token)
            model_name_or_path = os.path.dirname(path)
        return rope_settings(read_config_json(model_name_or_path))
    except Exception:  # noqa: BLE001 - the server runs as petals' would; its clients cannot check its RoPE
        return None


def announcing_numerics() -> list:
    """The server's announcement (petals' ServerInfo.to_tuple) names its kernels (:func:`kernels_of` its
    device, set as the server is made), so that the swarm audit compares servers of the same ones bit for bit, and
    the RoPE of the config.json it serves (:func:`served_rope`), which a client compares with its own
    (:func:`dist_eval.backends.petals.failover.leave_out_other_rope`).
    """
    from petals.data_structures import ServerInfo
    from petals.server.server import Server

    from dist_eval.backends.config_json import ROPE_KEY
    from dist_eval.backends.petals.audit import KERNELS_KEY

    init, to_tuple = Server.__init__, ServerInfo.to_tuple

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        object.__setattr__(self.server_info, KERNELS_KEY, kernels_of(self.device))
        object.__setattr__(self.server_info, ROPE_KEY, served_rope(self.converted_model_name_or_path,
                                                                   getattr(self, "revision", None),
                                                                   getattr(self, "token", None)))

    def announced(self):
        state, throughput, extra = to_tuple(self)
        for key in (KERNELS_KEY, ROPE_KEY):
            if getattr(self, key, None) is not None:
                extra[key] = getattr(self, key)
        return state, throughput, extra

    return [(Server, "__init__", __init__), (ServerInfo, "to_tuple", announced)]


def apply_server_patches(model_dir: Optional[str] = None, first_block: Optional[int] = None) -> None:
    """Apply every server patch, in the one order that works, after petals' import and the
    patches every petals process gets (:func:`dist_eval.backends.petals.shims.import_petals`) and, on
    transformers 5.x, the bridges of petals' server blocks
    (:func:`~dist_eval.backends.petals.shims.apply_server_bridges`):

    1. :mod:`dist_eval.swarm.merged_forward`: each forward request one task through all its blocks;
    2. :mod:`dist_eval.swarm.wire` (the wire's server half): token ids in, read positions out. It wraps
       the ``run_rpc_forward`` that 1 set; applied first, 1 would replace it, and a request of
       token ids would reach the blocks as hidden states. :func:`dist_eval.backends.petals.shims.apply`
       refuses that order;
    3. :mod:`dist_eval.swarm.drain`: a shutdown waits for the requests in flight (it counts them
       in each request handler, around whatever the others changed inside them);
    4. :func:`dist_eval.swarm.blocks.server_block_replacements`: a block is built knowing its
       index (a mixture-of-experts family's blocks differ by index);
    5. :func:`_peft_on_demand`: a server without adapters does not import bitsandbytes;
    6. :func:`_own_identity_unchecked`: its own identity file is not checked against the swarm;
    7. :func:`_loopback_is_direct`: a server on loopback is not dialled back to learn it is direct,
       and keeps no probe to dial others back;
    8. :func:`_inherited_shared_memory_kept`: a forked child never unlinks its parent's shared memory;
    9. :func:`state_reporting`: the server's state told to the swarm that started it;
    10. :func:`announcing_numerics`: its announcement names its kernels (the swarm audit's bit-for-bit rule) and
        the RoPE of the config.json it serves (a client's check of its own).

    Before the server starts (its connection handlers, forked later, share what these set).
    Idempotent. ``model_dir``/``first_block``: the served folder and its first block (the table
    a server of block 0 looks token ids up in).
    """
    from dist_eval.backends.blocks import register
    from dist_eval.backends.compat import quiet_third_party_output
    from dist_eval.backends.petals.shims import apply, apply_server_bridges, import_petals
    from dist_eval.swarm import blocks, drain, merged_forward, wire

    quiet_third_party_output()  # a server is a process of ours (the caller's is left alone)
    import_petals()
    apply_server_bridges()  # transformers 5.x: petals' server blocks (none on the pinned stack)
    apply("merged_forward", "server", merged_forward.replacements)
    apply("wire_server", "server", lambda: wire.server_replacements(model_dir, first_block), after=("merged_forward",))
    register()  # the blocks and classes of the families petals 2.2.0 lacks, in petals' registry
    apply("server_version", "server", blocks.server_version_replacements)  # says it computes them
    apply("drain", "server", drain.replacements)
    apply("block_index", "server", blocks.server_block_replacements)
    apply("peft_on_demand", "server", _peft_on_demand)
    apply("own_identity", "server", _own_identity_unchecked)
    apply("loopback_direct", "server", _loopback_is_direct)
    apply("inherited_shared_memory", "server", _inherited_shared_memory_kept)
    apply("state_file", "server", state_reporting)
    apply("announced_numerics_server", "server", announcing_numerics)


def main(argv: list) -> None:
    """Run petals' server on ``argv`` (run_server's flags, ours taken off) with every server patch."""
    from dist_eval.backends.compat import no_random_init_of_meta_tensors

    # petals, torch and the patches first (the bulk of a start-up), then the wait for the peers
    apply_server_patches(*_model_and_first_block(argv))
    argv = server_argv(argv)
    from petals.cli import run_server

    sys.argv = ["petals.cli.run_server", *argv]
    drain_on_sigterm()
    with no_random_init_of_meta_tensors():  # the blocks are built on meta, then loaded
        run_server.main()


if __name__ == "__main__":
    if sys.argv[1:] == [FORK_SERVER_FLAG]:  # a swarm's fork server (forks.py): returns in each server it forks
        from dist_eval.swarm.forks import serve

        forked_argv = serve()
        if forked_argv is None:
            sys.exit(0)
        sys.argv = [sys.argv[0], *forked_argv]
    arguments = take_state_file(sys.argv[1:])
    try:
        main(arguments)
    except Exception as e:  # the swarm says why (e.g. no swarm answered at --initial_peers); the log has the rest
        state_file.report(state_file.FAILED, error=f"{type(e).__name__}: {e}")
        raise
