"""The petals wing: the client of a swarm, behind the :class:`~dist_eval.backends.base.Backend` interface.

In the order a forward meets them:

- :mod:`~dist_eval.backends.petals.shims`: the one way to import petals, and every change dist_eval makes to
  petals and hivemind (client and server), each with the version it was written against
- :mod:`~dist_eval.backends.petals.backend`: :class:`PetalsClassifier` and ``load_petals``: embeddings, prompts
  and head here, the blocks on the swarm
- :mod:`~dist_eval.backends.petals.requests`: a batch goes as one request, split only to what a server accepts
- :mod:`~dist_eval.backends.petals.wire`: what a forward sends and gets back (the client half; the server half is
  :mod:`dist_eval.swarm.wire`)
- :mod:`~dist_eval.backends.petals.failover`: routing around failed servers; naming unserved blocks
- :mod:`~dist_eval.backends.petals.audit`: a share of the forwards replayed on other servers
- :mod:`~dist_eval.backends.petals.helpers`: the client's helper processes (DHT, p2pd), a watch over them, and
  the client's shutdown

Nothing is imported here: the report writers read the audit's summaries without importing petals.
"""
