"""The backends by name: what each takes and what it is, in one table (no torch imported).

Every question the run asks of a backend's name (does it compute here, so ``--device``
applies; do its blocks run on a swarm, so ``--initial-peers`` applies and a local swarm is
started without them; which of ``load_model``'s keywords it reads) is answered here, and
nowhere by comparing the name with a string.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, Optional

from dist_eval.errors import UsageError


@dataclass(frozen=True)
class BackendKind:
    """One backend: how it is built and what it is."""

    name: str
    loader: str  # "module:function": fn(model_dir, state, family, label_words=, **the keywords in takes)
    takes: tuple  # load_model's keywords it reads, beyond the model, prompts + head and label words
    on_swarm: bool  # its blocks run on a Petals swarm (a local one is started without --initial-peers)
    computes_here: bool  # it computes in this process: --device applies
    streamed: Optional[BackendKind] = None  # the same backend with its blocks streamed from disk (--stream-blocks)

    def with_blocks_streamed(self, param: str = "stream_blocks") -> BackendKind:
        """This backend with its blocks streamed from disk, one at a time; a UsageError naming ``param`` where
        its blocks are not computed here.
        """
        if self.streamed is None:
            raise UsageError(f"expected {{0}} 'local': the blocks of {{0}} {self.name!r} are computed elsewhere, "
                             "not read from disk here. Drop it, or pass {0} local.", param=param, names=("backend",))
        return self.streamed

    def load(self, model_dir: str, state, family, label_words, **given):
        """The backend module, built from the keywords it takes (the others are not passed)."""
        module, _, name = self.loader.partition(":")
        build = getattr(importlib.import_module(module), name)
        return build(model_dir, state, family, label_words=label_words, **{k: given[k] for k in self.takes})


BACKENDS: Dict[str, BackendKind] = {
    "petals": BackendKind("petals", "dist_eval.backends.petals.backend:load_petals",
                          ("initial_peers", "dht_prefix", "client_options", "swarm_timeout", "audit_share",
                           "servers_started_from_4x_config"),
                          on_swarm=True, computes_here=False),
    "local": BackendKind("local", "dist_eval.backends.local:load_local", ("device",),
                         on_swarm=False, computes_here=True,
                         # the same model, bit for bit, in the memory of one block: each read from disk (or fetched
                         # from the hub: ``hub``) when the forward reaches it and freed after
                         streamed=BackendKind("local", "dist_eval.backends.streamed:load_streamed", ("device", "hub"),
                                              on_swarm=False, computes_here=True)),
}


def backend_kind(name: str, param: str = "backend") -> BackendKind:
    """The backend called ``name``; a UsageError naming ``param`` for another."""
    if name not in BACKENDS:
        raise UsageError(f"expected one of {', '.join(repr(b) for b in BACKENDS)}.", param=param, value=name)
    return BACKENDS[name]
