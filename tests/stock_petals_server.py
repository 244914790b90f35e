"""A server of petals' own (``petals.cli.run_server``) with none of dist_eval's server-side
changes, only the hivemind compatibility every petals process needs: it stands in for
the servers of a swarm that others run. Tests put it in place of
``dist_eval.swarm.server`` (``dist_eval.swarm.local.SERVER_MODULE``); it takes the same
arguments, ``--initial_peers_file`` included.
"""
import sys

if __name__ == "__main__":
    from dist_eval.backends.compat import import_petals, no_random_init_of_meta_tensors
    from dist_eval.swarm.server import _server_argv

    import_petals()
    from petals.cli import run_server

    sys.argv = ["petals.cli.run_server", *_server_argv(sys.argv[1:])]
    with no_random_init_of_meta_tensors():
        run_server.main()
