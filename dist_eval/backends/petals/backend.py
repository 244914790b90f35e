"""The petals backend: transformer blocks run on a swarm; embeddings, prompts and head run here."""
from __future__ import annotations

import functools
import json
import threading
import time
from typing import Optional

import torch

from dist_eval.backends.arguments import DEFAULT_SWARM_TIMEOUT
from dist_eval.backends.base import Backend
from dist_eval.backends.checkpoint import TrainableState
from dist_eval.backends.compat import heads_read_after, no_quantizer_for_remote_blocks, no_random_init_of_meta_tensors
from dist_eval.backends.families import Family
from dist_eval.backends.petals import audit, failover
from dist_eval.backends.petals.failover import server_failure, swarm_failure
from dist_eval.backends.petals.helpers import HelperWatch, quiet_hivemind_logs, shutdown_petals_client
from dist_eval.backends.petals.requests import (
    RequestTooLarge,
    learn_server_limit,
    restore_petals_split,
    send_batches_whole,
)
from dist_eval.backends.petals.shims import import_petals
from dist_eval.backends.petals.wire import embeddings_digest, forward_over_wire
from dist_eval.backends.zeroshot import LabelWords, ZeroShotScorer, read_saved_lm_head
from dist_eval.errors import UsageError, one_line, printable
from dist_eval.procs import remove_dead_hivemind_sockets


class PetalsClassifier(Backend):
    """Adapter: petals' ``Distributed*ForSequenceClassification`` of a family -> logits.

    The remote part of each forward (the blocks on the swarm) is retried for at most
    ``swarm_timeout`` seconds from the start of its first failing attempt; then a
    UsageError names the blocks whose every server kept failing (see
    :func:`dist_eval.backends.petals.failover.unserved_blocks`). petals alone would retry without
    a time bound (it counts attempts, and re-adds a dead server's DHT record, which lives
    ~2 minutes).

    Each batch goes to the swarm as one request, cut only to what a server refusing its
    size accepts (:mod:`dist_eval.backends.petals.requests`).

    ``owns_client=False``: ``inner`` is the caller's (a model object passed to
    ``evaluate``); :meth:`close` then leaves its client running and ``inner`` as it was.
    """

    def __init__(self, inner, family: Family, swarm_timeout: float = DEFAULT_SWARM_TIMEOUT, owns_client: bool = True,
                 audit_share: float = 0.0):
        super().__init__()
        import_petals()  # every client patch, also for a caller's model object (backends.petals.shims)
        self.inner = inner
        self.family = family
        self.swarm_timeout = swarm_timeout
        self.owns_client = owns_client
        blocks = family.get(inner, family.blocks)
        self.sequence_manager = blocks.sequence_manager
        if audit_share > 0:  # a share of the forwards replayed on other servers (backends.petals.audit)
            audit.attach(self.sequence_manager, audit_share)
        self._own_forward = blocks.__dict__.get("forward")  # normally none: the class's
        remote_forward = blocks.forward
        # Instance attribute: nn.Module.__call__ then runs the bounded version.
        blocks.forward = lambda *args, **kwargs: self._bounded_remote(remote_forward, *args, **kwargs)
        self.helper_watch = HelperWatch(self.sequence_manager, watchdog=owns_client).start()
        send_batches_whole(self.sequence_manager)  # one request per batch (backends.petals.requests)
        config = inner.config
        self._prompt_tokens = config.pre_seq_len if getattr(config, "tuning_mode", None) else 0
        # the digest of the client's token embeddings, which a first server must hold too to be
        # sent token ids: computed once, when a server first offers its own (backends.petals.wire)
        table = family.get(inner, family.embeddings).weight
        self._own_digest = functools.lru_cache(maxsize=None)(lambda: embeddings_digest(table)) \
            if family.embeds_on_server else None
        # the blocks whose servers are sent the rows' token ids (DeepSeek-V4's hash routing: backends.petals.wire)
        self._routed_blocks = family.token_routed_blocks(config)
        # per thread (batches in flight run in threads): the token ids of the forward running
        # in this thread and the positions its head reads, for its remote blocks (backends.petals.wire)
        self._forward_facts = threading.local()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # No attention mask: the petals client rejects any mask that is not all ones.
        if torch.is_grad_enabled():  # a training step: petals' own requests (its backward needs them)
            return self.inner(input_ids=input_ids).logits
        facts = self._forward_facts
        facts.token_ids = input_ids
        facts.positions = self.family.last_token_index(input_ids, self.inner.config.pad_token_id) + self._prompt_tokens
        try:
            return self.inner(input_ids=input_ids).logits
        finally:
            facts.token_ids = facts.positions = None

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final (normed) hidden states of the tokens [batch, seq, hidden], prompts removed
        (petals' backbone prepends and removes them itself).
        """
        return self.family.get(self.inner, self.family.backbone)(input_ids=input_ids).last_hidden_state

    def hidden_states_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states at ``positions`` [batch, n] (prompts not counted): [batch, n, hidden]. Where blocks
        route by token id (DeepSeek-V4's hash_moe), the remote blocks need the rows' token ids, which dist_eval's wire
        sends (:func:`~dist_eval.backends.petals.wire.forward_over_wire`, as the classifier's forward) and petals' own
        forward does not; the wire reads one position per row, so one forward per column of ``positions`` (one for
        single-token label words). Other families: petals' own forward, every position at once.
        """
        if not self._routed_blocks or torch.is_grad_enabled():
            return super().hidden_states_at(input_ids, positions)
        facts, backbone = self._forward_facts, self.family.get(self.inner, self.family.backbone)
        rows, columns = torch.arange(input_ids.shape[0]), []
        try:
            for column in positions.cpu().unbind(1):
                facts.token_ids, facts.positions = input_ids, column + self._prompt_tokens
                columns.append(backbone(input_ids=input_ids).last_hidden_state[rows, column])
        finally:
            facts.token_ids = facts.positions = None
        return torch.stack(columns, dim=1)

    def load_trainable(self, state: TrainableState) -> None:
        """The trained head and prompts of ``state`` (its structure is this client's) into the
        client's local weights; the servers hold none of them (deep prompts travel with each request).
        """
        _load_trainable(self.inner, state, self.family)

    def provenance(self) -> dict:
        """The servers this client's routing table holds for the model's blocks (see
        :mod:`dist_eval.backends.provenance`).
        """
        from dist_eval.backends.provenance import swarm_provenance

        facts = swarm_provenance(self.sequence_manager.state.sequence_info.block_infos)
        ledger = audit.ledger_of(self.sequence_manager)
        if ledger is not None:  # this client's audit (the report combines the ranks')
            facts["audit"] = ledger.facts()
        left_out = getattr(self.sequence_manager, failover.ROPE_LEFT_OUT_ATTR, None)
        if left_out:  # announced other RoPE settings than the client's config.json: out of every route
            facts["rope_left_out"] = {peer: {name: out.announced.get(name) for name in out.differ}
                                      for peer, out in sorted(left_out.items())}
        return facts

    def close(self) -> None:
        """Stop the client (its DHT process, p2pd and routing thread), in bounded time; or,
        for a client the caller owns, only undo what this adapter changed on ``inner``.
        """
        failover.flush_daemon_error_warnings()  # while the helpers run: a server's failure is said, not lost
        self.helper_watch.stop()  # first: a normal shutdown stops the helpers
        if not self.owns_client:
            restore_petals_split(self.sequence_manager)
            blocks = self.family.get(self.inner, self.family.blocks)
            if self._own_forward is None:
                del blocks.forward
            else:
                blocks.forward = self._own_forward
            return
        shutdown_petals_client(self.sequence_manager)
        self.helper_watch.close()

    def _bounded_remote(self, remote_forward, *args, **kwargs):
        first_failure = None
        while True:
            attempt_started = time.monotonic()
            if self.helper_watch.check() is not None:
                raise self.helper_watch.died
            try:
                positions = getattr(self._forward_facts, "positions", None)
                if positions is None:  # not this classifier's forward (e.g. hidden_states()): petals' own
                    return remote_forward(*args, **kwargs)
                hidden_states = args[0] if args else kwargs["inputs"]
                prompts = args[1] if len(args) > 1 else kwargs.get("prompts")
                return forward_over_wire(hidden_states, prompts, self.sequence_manager, positions,
                                         self._forward_facts.token_ids, self._prompt_tokens, self._own_digest,
                                         self._routed_blocks)
            except RequestTooLarge as refused:
                hidden_states = args[0] if args else kwargs["inputs"]  # [rows, tokens, hidden]
                learn_server_limit(self.sequence_manager, refused, row_tokens=hidden_states.shape[1])
            except Exception as e:
                if self.helper_watch.check() is not None:
                    raise self.helper_watch.died from e
                if not server_failure(e):  # the client's own error (a bug, a petals change): no retry helps
                    raise
                # a swarm failure: retried until the deadline
                if first_failure is None:
                    first_failure = attempt_started  # petals' own retries inside count too
                waited = time.monotonic() - first_failure
                if waited >= self.swarm_timeout:
                    raise swarm_failure(self.sequence_manager, self.swarm_timeout, waited, e) from e
                # petals gave up after max_retries quick attempts; let its routing refresh
                # (on_request_failure triggered one) before trying again
                time.sleep(min(1.0, self.swarm_timeout - waited))


# petals ClientConfig overrides (petals 2.2.0 defaults in brackets). Why each:
# - update_period 10 s [60]: routing refresh; how soon new servers, and servers back from
#   a ban, are used. A failed server leaves routing at once anyway (failover's patch).
# - max_retries 3 [unbounded], min/max_backoff 0.5/2 s [1/60]: petals' attempts per
#   remote call; a failed attempt reroutes around the failed server, so a few quick
#   ones suffice. Longer outages are retried by PetalsClassifier until --swarm-timeout,
#   which bounds a batch's wait in time (petals counts attempts, not seconds).
# - ban_timeout 60 s [15]: a server that failed is not routed to again for 60 s
#   (doubling on each new failure). A SIGKILLed server's DHT record outlives it by up to
#   2 x its update period (120 s by default); with 15 s bans the client would go back to
#   it every 15 s and pay a failed attempt each time. A block whose servers are all
#   banned still uses them (petals ignores bans then), so a false ban never stops a run.
# - request_timeout 60 s [180]: a server that accepts a request and never answers (hung)
#   is given up after this; a forward of one batch takes far less on a working server.
# - daemon_startup_timeout 30 s [60]: --initial-peers that nobody answers fail in 30 s.
DEFAULT_CLIENT_OPTIONS = dict(
    show_route=False,
    daemon_startup_timeout=30,
    request_timeout=60.0,
    update_period=10.0,
    max_retries=3,
    min_backoff=0.5,
    max_backoff=2.0,
    ban_timeout=60.0,
)


def wait_for_blocks(manager, timeout: float, dht_prefix: Optional[str]) -> None:
    """Return once every block of the client's sequence ``manager`` has a server in the DHT;
    else a UsageError naming the missing blocks after ``timeout`` seconds (petals itself
    would retry forever).
    """
    deadline = time.monotonic() + timeout
    # petals starts its routing thread lazily, on the first forward; update(wait=True)
    # before that waits forever. Start it the way petals does, and never wait unbounded.
    with manager._thread_start_lock:
        if not manager.is_alive():
            manager._thread.start()
    while True:
        manager.update(wait=False)
        manager.ready.wait(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        spans = manager.state.sequence_info.spans_containing_block
        missing = [i for i in range(len(manager)) if not spans[i]]
        if not missing:
            return
        if time.monotonic() >= deadline:
            hint = (
                " No block is served at all: check that --dht-prefix matches the servers' prefix"
                f" (used: {dht_prefix!r}) and that --initial-peers is this model's swarm."
                if len(missing) == len(manager)
                else " Start a server for them (python -m dist_eval.swarm, or petals' run_server)."
            )
            raise UsageError(
                f"after {timeout:.0f} s no server in the swarm holds block(s) {missing} "
                f"of {len(manager)}.{hint} (--swarm-timeout sets the wait.)",
                param="initial_peers",
            )
        time.sleep(1.0)


def load_petals(
    model_dir: str, state: TrainableState, family: Family, initial_peers, dht_prefix, client_options: dict,
    swarm_timeout: float, label_words: Optional[LabelWords] = None, audit_share: float = 0.0,
    servers_started_from_4x_config: bool = False,
) -> Backend:
    """The model of ``model_dir`` as a client of the swarm at ``initial_peers``, once every
    block is served, with the trained prompts and head. A folder in a layout petals'
    client cannot read is read from its converted copy (:mod:`dist_eval.backends.petals_folder`).
    With ``label_words``: petals' causal LM (``Family.petals_lm_class``; its LM head here, read where the family's
    releases save it: ``Family.saved_lm_head``) scoring them (:mod:`dist_eval.backends.zeroshot`).
    """
    import_petals()  # every client patch (backends.petals.shims)
    quiet_hivemind_logs()

    if not initial_peers:
        raise UsageError(
            "the petals backend needs the swarm's address (or none, to start a local swarm).", param="initial_peers"
        )
    kwargs = dict(
        initial_peers=list(initial_peers),
        torch_dtype=torch.float32,
        **{**DEFAULT_CLIENT_OPTIONS, **client_options},
    )
    if label_words is None:
        kwargs["num_labels"] = state.num_labels
    if dht_prefix:
        kwargs["dht_prefix"] = dht_prefix
    if state.tuning_mode:
        kwargs.update(tuning_mode=state.tuning_mode, pre_seq_len=state.pre_seq_len)
    from dist_eval.backends.blocks import family_class
    from dist_eval.backends.petals_folder import petals_model_folder

    started = time.time()
    try:
        petals_class = family.petals_class if label_words is None else family.petals_lm_class
        folder = petals_model_folder(model_dir)
        with no_random_init_of_meta_tensors(), no_quantizer_for_remote_blocks(), \
                heads_read_after(family.head, family.lm_head, unread=family.lm_head_weights):
            inner = family_class(petals_class, in_petals=True).from_pretrained(folder, **kwargs)
    except Exception as e:
        if type(e).__name__ == "P2PDaemonError":  # nobody answered at the initial peers
            remove_dead_hivemind_sockets(started)  # the failed p2pd's, which hivemind leaves
            raise UsageError(
                f"no swarm answered ({one_line(e, 160)}). "
                "Check the addresses (the servers print them) and that the servers are running.",
                param="initial_peers", value=list(initial_peers),
            ) from e
        raise
    manager = family.get(inner, family.blocks).sequence_manager
    try:
        if label_words is not None:  # the head where the family's releases save it (before the swarm's wait)
            read_saved_lm_head(family.get(inner, family.lm_head), folder, inner.config, family)
        wait_for_blocks(manager, swarm_timeout, dht_prefix)
        _require_block_options(manager, family, inner.config, servers_started_from_4x_config)
        _leave_out_servers_of_other_rope(manager, folder, model_dir)
    except BaseException:
        shutdown_petals_client(manager)
        raise
    _load_trainable(inner, state, family)
    client = PetalsClassifier(inner, family, swarm_timeout, audit_share=audit_share)
    if label_words is None:
        return client
    return ZeroShotScorer(client, family.get(inner, family.lm_head), label_words)


def _leave_out_servers_of_other_rope(manager, folder: str, model_dir: str) -> None:
    """Leave out of every route the servers that compute the blocks from a config.json of other RoPE settings than
    ``folder``'s (the client's copy of ``model_dir``: :func:`~dist_eval.backends.petals.failover.leave_out_other_rope`),
    the settings kept for servers met later; refused in one line naming ``model_dir`` where a block has no other
    server. (After the load, a block so left without one is the swarm's failure: waited for, then named.)
    """
    from dist_eval.backends.config_json import read_config_json, rope_settings

    setattr(manager, failover.OWN_ROPE_ATTR, rope_settings(read_config_json(folder)))
    unserved = failover.leave_out_other_rope(manager, say=False)
    left_out = getattr(manager, failover.ROPE_LEFT_OUT_ATTR)
    if unserved:
        raise UsageError(f"{failover.other_rope_line(manager, left_out)}, and no other server serves block(s) "
                         f"{unserved} of {len(manager)}. Start the servers from the same config.json (python -m "
                         "dist_eval.swarm), or evaluate with the file they serve.", param="model_dir", value=model_dir)
    if left_out:
        failover.warn_left_out(manager, left_out)


def _require_block_options(manager, family: Family, config, servers_read_4x_form: bool = False) -> None:
    """A model whose blocks only dist_eval's servers compute (a newer family, llama3 rope), or that stock
    petals servers compute with other numbers (:func:`stock_misreadings`), is refused on a swarm with
    other servers. ``servers_read_4x_form``: the user says they read a copy of config.json in the 4.x form.
    """
    from dist_eval.backends.blocks import needs_block_options
    from dist_eval.backends.provenance import servers_without_block_options

    options = needs_block_options(family, config)
    misread = stock_misreadings(config, family, servers_read_4x_form)
    if not options and not misread:
        return
    others = servers_without_block_options(manager.state.sequence_info.block_infos)
    if not others:
        return
    shown = ", ".join(f"{peer[:16]}... (petals {printable(version)})" for peer, version in others[:3])
    serve = "Serve it with python -m dist_eval.swarm or launch/start_server.sh"
    if options:
        lack = f" ({family.stock_servers_lack})" if family.stock_servers_lack else ""
        raise UsageError(
            f"the swarm's server(s) {shown} are not dist_eval's, and this {family.model_type} model's blocks "
            f"need dist_eval's block options{lack} (docs/models-and-checkpoints.md). {serve}.", param="initial_peers")
    fields = ", ".join(f"{name} {json.dumps(value)} ({why})" for name, (value, why) in misread.items())
    moved = any(why == MOVED for _, why in misread.values())
    raise UsageError(
        f"the swarm's server(s) {shown} are stock petals servers, which compute this {family.model_type} model "
        f"without its config.json's {fields}: other numbers than the model's. {serve}".replace("{", "{{")
        .replace("}", "}}") + ("; or, if these servers were started from a copy of the folder in transformers 4.x's "
                               "form (top-level rope_theta, rope_scaling), say so with {0}" if moved else "")
        + " (docs/models-and-checkpoints.md).", param="initial_peers", names=("servers_started_from_4x_config",))


# what petals 2.2's servers (transformers 4.33) take for a RoPE field config.json leaves out
STOCK_SERVER_DEFAULTS = {"rope_theta": 10000.0, "rope_scaling": None}
MOVED = "saved in transformers 5.x's form, rope_parameters, which they read as missing"


def stock_misreadings(config, family: Family, servers_read_4x_form: bool = False) -> dict:
    """{field: (value, why)} of what in ``config`` petals 2.2's own servers compute otherwise: the fields
    read from transformers 5.x's form (:mod:`dist_eval.backends.config_json`: they find them missing and take
    their default), unless ``servers_read_4x_form``, and a rope_theta their block ignores
    (``Family.server_rotary_attention``); {} when none.
    """
    from dist_eval.backends.config_json import read_as

    moved = {} if servers_read_4x_form else read_as(config) or {}
    misread = {name: (value, MOVED) for name, value in moved.items()
               if name not in STOCK_SERVER_DEFAULTS or STOCK_SERVER_DEFAULTS[name] != value}
    theta = getattr(config, "rope_theta", STOCK_SERVER_DEFAULTS["rope_theta"])
    if family.server_rotary_attention and theta != STOCK_SERVER_DEFAULTS["rope_theta"]:
        misread["rope_theta"] = (theta, "their block's RoPE base is always 10000")
    return misread


def _load_trainable(inner, state: TrainableState, family: Family) -> None:
    with torch.no_grad():
        if "score.weight" in state.tensors:  # none with label words
            family.get(inner, family.head).weight.copy_(state.tensors["score.weight"])
        if state.tuning_mode:
            family.get(inner, family.prompts).weight.copy_(state.tensors["prompt_embeddings.weight"])
        if state.tuning_mode == "deep_ptune":
            family.get(inner, family.deep_prompts).weight.copy_(state.tensors["intermediate_prompt_embeddings.weight"])
