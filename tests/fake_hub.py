"""A hub on 127.0.0.1 for tests: the file endpoints ``huggingface_hub.hf_hub_download`` calls
(``HEAD``/``GET /<repo>/resolve/<revision>/<file>``, with the commit, ETag and size headers it
reads), serving folders given as ``{repo_id: folder}``; every requested path is recorded."""
from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import threading
from typing import Dict, Iterator, List

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: Dict[str, str]):
        self.repos, self.requests = repos, []  # requests: (method, path)
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def files(self, method: str = "GET") -> List[str]:
        """The file names requested with ``method`` (the requests for a file: huggingface_hub 2.x also asks
        ``/api/agent-harnesses``, a registry it names the caller's agent from in its user agent, answered 404)."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1] for m, path in self.requests
                if m == method and "/resolve/" in path]

    def _answer(self, handler, body: bool) -> None:
        self.requests.append((handler.command, handler.path))
        repo, _, rest = handler.path.lstrip("/").partition("/resolve/")
        name = rest.partition("/")[2]
        folder = self.repos.get(repo)
        path = os.path.join(folder, name) if folder else None
        if path is None or not os.path.isfile(path):
            handler.send_response(404)
            handler.send_header("X-Error-Code", "EntryNotFound" if folder else "RepoNotFound")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        with open(path, "rb") as f:
            data = f.read()
        handler.send_response(200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)


@contextlib.contextmanager
def fake_hub(repos: Dict[str, str]) -> Iterator[FakeHub]:
    hub = FakeHub(repos)
    thread = threading.Thread(target=hub._server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub._server.shutdown()
        hub._server.server_close()
        thread.join()
