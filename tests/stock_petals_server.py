"""A server of petals' own (``petals.cli.run_server``) with none of dist_eval's server-side
changes, only the hivemind compatibility every petals process needs, and the two files a local
swarm starts its servers with (``--initial_peers_file``; ``--state_file``, where it reports its
state: :func:`dist_eval.swarm.server.state_reporting`, which changes nothing a client sees): it
stands in for the servers of a swarm that others run. Tests put it in place of
``dist_eval.swarm.server`` (``dist_eval.swarm.local.SERVER_MODULE``); it takes the same arguments.
"""
import sys

if __name__ == "__main__":
    from dist_eval.backends.compat import no_random_init_of_meta_tensors
    from dist_eval.backends.petals.shims import apply, import_petals
    from dist_eval.swarm import server

    argv = server.take_state_file(sys.argv[1:])
    import_petals()
    apply("state_file", "server", server.state_reporting)
    from petals.cli import run_server

    sys.argv = ["petals.cli.run_server", *server.server_argv(argv)]
    with no_random_init_of_meta_tensors():
        run_server.main()
