"""How big each request to the swarm is: one batch of the plan goes as one request, split
only to what the servers accept.

petals 2.2.0's client cuts every remote forward into micro-batches of at most 1024 tokens
(``petals.client.sequential_autograd.MAX_TOKENS_IN_BATCH``), whatever the servers accept
(``--max_batch_size``, 2048 tokens by default, 8192 for multi-query models). A batch of the
plan (up to ``--max-batch-tokens``) then became two or more requests, each paying a round
trip and per-request work on every server it passes: that work, not the arithmetic, is
what a small model's servers spend their time on. Measured on the CPU benchmark
(benchmarks/RESULTS.md): 449 -> 700 samples/s at N=2 from sending each batch whole.

A server that gets more tokens than its ``--max_batch_size`` answers "Task size greater
than max_batch_size (N)". That is not a failed server: the client learns N, keeps it for
the rest of the run, and sends the batch again cut into requests of at most N tokens
(rows are independent, so only float rounding can change).

Deep prompts (``deep_ptune``) travel once per request, not once per row: petals' client
builds them for every row of the batch ([blocks, rows, prompt length, hidden]), the same
values in every row, and sends them all; a request then carried (blocks x prompt length)
vectors per row besides its hidden states, several times the hidden states for a deep
model (computed in benchmarks/RESULTS.md). The client dist_eval drives sends them for one row
([blocks, 1, prompt length, hidden]); a server adds them to every row by broadcasting
(``hidden[:, :P] += prompt``, petals' own server code and dist_eval's merged forward alike),
the same values added, so the logits are unchanged bit for bit (with petals' default wire
format: no compression, or one that rounds each value alone; an 8-bit one with per-block
statistics could round one row of prompts differently from many). Only with gradients
off: petals' backward expects one prompt per row.

Only clients that dist_eval drives are changed: the limit lives on the client's sequence
manager (:func:`send_batches_whole`), and a manager without it keeps petals' own splitting
and prompts. The two patches (:func:`split_replacements`, :func:`prompt_replacements`) are
applied by :func:`dist_eval.backends.petals.shims.apply_client_patches`.
"""
from __future__ import annotations

import re
import threading
from typing import Optional

from dist_eval.errors import UsageError, one_line, warn

_LIMIT_ATTR = "dist_eval_request_tokens"  # absent: petals' splitting; None: whole; N: at most N tokens
_TOO_LARGE_RE = re.compile(r"Task size greater than max_batch_size \((\d+)\)")
_learn_lock = threading.Lock()


class UnrecognisedRefusal(RuntimeError):
    """A server refused a request over its size in words that dist_eval cannot read (another petals?)."""


class RequestTooLarge(Exception):
    """A server refused a request over its ``--max_batch_size`` (``server_limit`` tokens)."""

    def __init__(self, server_limit: int):
        super().__init__(f"a server accepts at most {server_limit} tokens per request (its --max_batch_size)")
        self.server_limit = server_limit


def too_large(error: Optional[BaseException]) -> Optional[RequestTooLarge]:
    """The RequestTooLarge that ``error`` (a failed request's exception) stands for, or None."""
    if error is None:
        return None
    text = str(error)
    match = _TOO_LARGE_RE.search(text)
    if match is None and "max_batch_size" in text:  # not a dead server: petals' text changed
        raise UnrecognisedRefusal(
            f"a server refused a request naming max_batch_size in words dist_eval does not recognise "
            f"({one_line(text, 200)}); expected 'Task size greater than max_batch_size (N)', petals 2.2.0.post1's. "
            "Install the supported petals (./launch/install.sh), or lower --max-batch-tokens below the servers' "
            "--max_batch_size."
        ) from error
    return RequestTooLarge(int(match.group(1))) if match else None


def send_batches_whole(sequence_manager) -> None:
    """From now on this client sends each forward's batch as one request (split only after
    a server refused its size, see :func:`learn_server_limit`); the client patches must be
    applied (:func:`dist_eval.backends.petals.shims.import_petals`).
    """
    setattr(sequence_manager, _LIMIT_ATTR, None)


def restore_petals_split(sequence_manager) -> None:
    """Give the client back petals' own micro-batching (a caller's client, after evaluation)."""
    if hasattr(sequence_manager, _LIMIT_ATTR):
        delattr(sequence_manager, _LIMIT_ATTR)


def drives(sequence_manager) -> bool:
    """Whether dist_eval sizes this client's requests (:func:`send_batches_whole` was called)."""
    return hasattr(sequence_manager, _LIMIT_ATTR)


def request_limit(sequence_manager) -> Optional[int]:
    """The most tokens per request this client sends (None: a batch goes whole)."""
    return getattr(sequence_manager, _LIMIT_ATTR, None)


def learn_server_limit(sequence_manager, refused: RequestTooLarge, row_tokens: int) -> None:
    """After ``refused``: send requests of at most its limit from now on, once per client a
    warning line; a UsageError if even one row (``row_tokens``, prompt vectors included)
    is over it, since no split can help then.
    """
    limit = refused.server_limit
    if row_tokens > limit:
        raise UsageError(
            f"a row of {row_tokens} tokens (prompt vectors included) is more than a swarm server accepts "
            f"in one request ({limit} tokens, its --max_batch_size). Lower --max-length, or restart the "
            f"servers with --max_batch_size {row_tokens} or more.",
            param="max_length",
        )
    with _learn_lock:  # batches in flight may be refused at once: one line per client
        current = request_limit(sequence_manager)
        if current is not None and current <= limit:
            return
        setattr(sequence_manager, _LIMIT_ATTR, limit)
        warn(
            f"{refused}; sending requests of at most {limit} tokens from now on "
            f"(set --max-batch-tokens {limit} or lower to plan batches that fit)."
        )


def request_batches(inputs, prompts, sequence_manager) -> tuple:
    """(hidden states of each request, prompts of each request) for a forward of ``inputs``
    [rows, tokens, hidden] with ``prompts`` (deep prompts [blocks, rows or 1, P, hidden], or
    none): the whole batch, or pieces of at most :func:`request_limit` tokens.
    """
    from petals.utils.misc import DUMMY, is_dummy

    limit = request_limit(sequence_manager)
    batch_size = inputs.shape[0] if limit is None else max(limit // inputs.shape[1], 1)
    input_batches = inputs.detach().split(batch_size)
    if prompts is None or is_dummy(prompts):
        prompt_batches = [DUMMY] * len(input_batches)
    elif prompts.shape[1] == 1:  # one row of deep prompts for every row (prompt_replacements)
        prompt_batches = [prompts.detach()] * len(input_batches)
    else:
        prompt_batches = prompts.detach().split(batch_size, dim=1)
    return input_batches, prompt_batches


def split_replacements() -> list:
    """The remote-forward autograd function of petals, with the micro-batch size read from the
    client's sequence manager (petals reads a module constant).
    """
    import torch
    from petals.client import sequential_autograd as sa

    function = sa._RemoteSequentialAutogradFunction
    petals_forward = function.forward

    def forward(ctx, inputs, prompts, sequence_manager):
        if not hasattr(sequence_manager, _LIMIT_ATTR):
            return petals_forward(ctx, inputs, prompts, sequence_manager)
        # from here on petals 2.2.0's own forward, but for the requests' size
        input_batches, prompt_batches = request_batches(inputs, prompts, sequence_manager)
        _ = sequence_manager.rpc_info  # lazy init, as petals does
        outputs = sa.RemoteExpertWorker.run_coroutine(
            sa._gather_forward(input_batches, prompt_batches, sequence_manager)
        )
        assert len(outputs) == len(input_batches)
        ctx.prompt_batches = prompt_batches
        ctx.sequence_manager = sequence_manager
        ctx.intemediate_input_batches = [output[1] for output in outputs]  # petals' spelling
        ctx.sequences_for_batches = [output[2] for output in outputs]
        return torch.cat([output[0] for output in outputs], dim=0)

    return [(function, "forward", staticmethod(forward))]


def prompt_replacements() -> list:
    """The ``PTuneMixin.get_prompt`` of petals, made to build a client's deep prompts for one row,
    sent once per request, when dist_eval drives the client (see the module docstring).
    """
    import torch
    from petals.client.ptune import PTuneMixin
    from petals.client.remote_sequential import RemoteSequential

    petals_get_prompt = PTuneMixin.get_prompt

    def get_prompt(self, batch_size):
        compact = (
            self.config.tuning_mode == "deep_ptune"
            and not torch.is_grad_enabled()
            and any(isinstance(m, RemoteSequential) and drives(m.sequence_manager) for m in self.children())
        )
        if not compact:
            return petals_get_prompt(self, batch_size)
        prompts, deep_prompts = petals_get_prompt(self, 1)
        # the input prompts are concatenated with the rows' embeddings here: one per row
        return prompts.expand(batch_size, -1, -1), deep_prompts

    return [(PTuneMixin, "get_prompt", get_prompt)]
