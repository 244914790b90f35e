"""Files dist_eval writes and reads (issue 50, dist_eval/atomic.py): a write never follows a planted
link, leaves no temporary file when it fails, and gives the file the mode a plain open would; a
read takes a regular file of bounded size only and never blocks (a FIFO, a device, a link to one).
Every file dist_eval writes goes through atomic.py (issue 69: an ``ast`` scan of the package finds
direct writes; the few that are not files a reader could see half written are listed, with why).
"""
import ast
import os
import subprocess
import sys
import threading

import pytest
from conftest import REPO

from dist_eval.atomic import atomic_create, atomic_write, read_regular


def test_a_link_planted_under_the_old_temporary_name_is_not_followed(tmp_path):
    """Before: the temporary name was PATH.tmp<pid>, opened plainly: a link planted there made the
    write overwrite the link's target."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    path = tmp_path / "metrics.json"
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    atomic_write(str(path), "{}\n")
    assert victim.read_text() == "keep me" and path.read_text() == "{}\n"
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", "metrics.json", f"metrics.json.tmp{os.getpid()}"])


def test_a_failed_write_leaves_nothing(tmp_path):
    """Before: the temporary file of a write that failed (a full disk, an error mid-way) stayed."""
    def fails(f):
        f.write("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(str(tmp_path / "predictions.jsonl"), fails)
    assert os.listdir(tmp_path) == []
    atomic_write(str(tmp_path / "a.txt"), "é\n")  # text is UTF-8 whatever the locale
    assert (tmp_path / "a.txt").read_bytes() == "é\n".encode()


def test_the_file_gets_the_mode_of_a_plain_open(tmp_path):
    code = ("import os, sys; os.umask(0o027); from dist_eval.atomic import atomic_write; "
            "atomic_write(sys.argv[1], 'x'); open(sys.argv[2], 'w').close()")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), str(tmp_path / "b")], cwd=REPO, check=True,
                   timeout=60)
    assert os.stat(tmp_path / "a").st_mode & 0o777 == os.stat(tmp_path / "b").st_mode & 0o777 == 0o640


def _read_within(path, seconds=10.0, **keywords):
    """read_regular's result or exception, failing the test if it has not returned in ``seconds``."""
    out = {}

    def read():
        try:
            out["value"] = read_regular(path, **keywords)
        except Exception as e:
            out["error"] = e

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), f"read_regular({path}) still blocked after {seconds} s"
    return out


def test_only_regular_files_of_bounded_size_are_read(tmp_path):
    regular = tmp_path / "rows"
    regular.write_bytes(b"x" * 100)
    assert _read_within(str(regular), max_bytes=100)["value"] == b"x" * 100
    assert "over the bound" in str(_read_within(str(regular), max_bytes=99)["error"])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in str(_read_within(str(fifo), max_bytes=100)["error"])
    zero = tmp_path / "zero"
    os.symlink("/dev/zero", zero)
    assert "not a regular file" in str(_read_within(str(zero), max_bytes=1 << 20)["error"])
    linked = tmp_path / "linked"
    os.symlink(regular, linked)  # a link to a regular file is that file
    assert _read_within(str(linked), max_bytes=100)["value"] == b"x" * 100


def test_a_file_of_another_user_is_refused_when_an_owner_is_asked(tmp_path):
    """Any user: this user's file asked to be another's (no root needed to give it away: the check compares
    the file's owner with the one asked)."""
    mine = tmp_path / "mine"
    mine.write_bytes(b"rows")
    refused = _read_within(str(mine), max_bytes=10, owner=os.geteuid() + 1)["error"]
    assert f"owned by another user (uid {os.geteuid()})" in str(refused)
    assert _read_within(str(mine), max_bytes=10, owner=os.geteuid())["value"] == b"rows"
    assert _read_within(str(mine), max_bytes=10)["value"] == b"rows"


def test_a_file_created_whole_only_where_none_is(tmp_path):
    """atomic_create (the --output-dir lock): the whole content or FileExistsError, the file there left
    alone, no temporary file left either way."""
    lock = tmp_path / ".dist_eval.lock"
    atomic_create(str(lock), lambda f: f.write('{"pid": 1}'))
    with pytest.raises(FileExistsError):
        atomic_create(str(lock), '{"pid": 2}')
    assert lock.read_text() == '{"pid": 1}' and os.listdir(tmp_path) == [".dist_eval.lock"]


# a call that writes a file -> the index of its argument that is the file (None: the call writes by itself); a
# call without that argument returns the data instead (to_json(), ...). shutil's and tempfile's are by full name.
WRITES = {"savefig": 0, "save_pretrained": 0, "save_to_disk": 0, "to_csv": 0, "to_json": 0, "to_parquet": 0,
          "tofile": 0, "write_text": None, "write_bytes": None, "np.save": 0, "np.savez": 0,
          "np.savez_compressed": 0, "torch.save": 1, "json.dump": 1, "pickle.dump": 1, "save_file": 1,
          "shutil.copyfile": 1, "shutil.copy": 1, "shutil.copy2": 1, "shutil.copytree": 1, "shutil.move": 1,
          "tempfile.mkstemp": None, "tempfile.NamedTemporaryFile": None}
_OS_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
# (module, function) -> why its direct writes are not files a reader could find half written
NOT_THROUGH_ATOMIC = {
    ("swarm/process.py", "_spawn"): "a server's log: its own output, appended while it runs and read as it grows",
    ("swarm/forks.py", "start"): "the fork server's log: its own output, appended while it runs",
    ("swarm/forks.py", "_fork"): "a forked server's log (its stdout and stderr), as swarm/process.py's _spawn",
    ("demo.py", "demo_assets"): "the demo cache's lock: an empty file held by flock, never read",
    ("demo.py", "_install"): "into a temporary folder that demo_assets renames into place whole",
    ("demo_build.py", "build"): "into a temporary folder that main renames into place whole (the shipped assets)",
    ("demo_build.py", "_build_data"): "the same folder (the tokenizer), renamed into place whole",
    ("demo_build.py", "_build_base_model"): "the same folder (the model), renamed into place whole",
    ("backends/petals_folder.py", "_write_converted"): "into a temporary folder renamed into place whole (the "
                                                        "converted copy of a model folder)",
    ("results.py", "mapped_array"): "a map of an anonymous temporary file, unlinked as it is made: no name",
    ("output/files.py", "write_second_half"): "a forked child's half of predictions.jsonl, into a hidden scratch "
                                              "file made by atomic.scratch_beside, copied into the atomic write's "
                                              "file and removed",
}


def _enclosing(tree: ast.AST) -> dict:
    """Each node -> the name of the function it is in (None: the module's top level)."""
    where = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            where[child] = name
            visit(child, inner)
    visit(tree, None)
    return where


def _handed_in(tree: ast.AST) -> set:
    """Names a write may go to without a direct write: an in-memory buffer (``x = io.BytesIO()``) and the
    parameter of a function given to atomic_write or atomic_create (the temporary file it opened)."""
    safe = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func).endswith("BytesIO"):
            safe.update(("buffer", t.id) for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("atomic_write", "atomic_create")):
            given = {a.id for a in node.args[1:] if isinstance(a, ast.Name)}
            safe.update(("param", a.arg, id(f)) for f in ast.walk(tree)
                        if isinstance(f, ast.FunctionDef) and f.name in given for a in f.args.args)
            safe.update(("param", a.arg, id(f)) for f in node.args[1:] if isinstance(f, ast.Lambda)
                        for a in f.args.args)
    return safe


def _writes_file(call: ast.Call) -> bool:
    """Whether ``call`` opens or writes a file by itself (before knowing where its file argument comes from)."""
    full = ast.unparse(call.func)
    name = full.rsplit(".", 1)[-1]
    if full == "os.open":
        flags = {getattr(n, "attr", getattr(n, "id", None)) for n in ast.walk(call.args[1])} if call.args[1:] else set()
        return bool(flags & _OS_WRITE_FLAGS)
    if name in ("open", "fdopen"):  # open(path, mode): a mode that is not a plain constant may write
        mode = call.args[1] if call.args[1:] else next((k.value for k in call.keywords if k.arg == "mode"), None)
        return mode is not None and not (isinstance(mode, ast.Constant) and not set(str(mode.value)) & set("wax+"))
    if full.endswith("memmap"):
        mode = next((k.value for k in call.keywords if k.arg == "mode"), None)
        return not (isinstance(mode, ast.Constant) and mode.value in ("r", "c"))
    return full in WRITES or (name in WRITES and "." not in name and isinstance(call.func, ast.Attribute))


def direct_writes(source: str) -> list:
    """The calls of a module that write a file not through atomic.py: (line, function, code)."""
    tree = ast.parse(source)
    where, safe = _enclosing(tree), _handed_in(tree)
    lambdas = {id(n): n for n in ast.walk(tree) if isinstance(n, (ast.Lambda, ast.FunctionDef))}
    found = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and _writes_file(n)):
        full = ast.unparse(call.func)
        index = WRITES.get(full, WRITES.get(full.rsplit(".", 1)[-1]))
        target = call.args[index] if index is not None and call.args[index:] else None
        if index is not None and target is None and full not in WRITES:
            continue  # to_json(): the data, returned
        if isinstance(target, ast.Name) and (("buffer", target.id) in safe or any(
                ("param", target.id, key) in safe and _inside(call, node) for key, node in lambdas.items())):
            continue
        found.append((call.lineno, where.get(call), ast.unparse(call)))
    return sorted(found)


def _inside(node: ast.AST, function: ast.AST) -> bool:
    return any(child is node for child in ast.walk(function))


def test_every_file_dist_eval_writes_goes_through_the_atomic_path():
    """An ``ast`` scan of every module but atomic.py: a direct write (open for writing, os.open with a
    write flag, Path.write_*, savefig / np.save / torch.save / json.dump to a file, a copy, ...) fails the
    test, naming it, unless listed in NOT_THROUGH_ATOMIC with why; a listed one no longer there fails too."""
    seen = direct_writes(
        "import io, json, os, shutil, numpy as np, torch\n"
        "def f(path, fig, arr, fd):\n"
        "    open(path, 'w').write('x'); open(path, mode='ab'); os.fdopen(fd, 'w'); open(path).read()\n"
        "    os.open(path, os.O_WRONLY | os.O_CREAT); os.open(path, os.O_RDONLY)\n"
        "    fig.savefig(path); np.save(path, arr); torch.save(arr, path); json.dump(arr, open(path))\n"
        "    path.write_text('x'); shutil.copyfile(path, path); arr.copy(); fig.to_json()\n"
        "    buffer = io.BytesIO(); fig.savefig(buffer)\n"
        "    atomic_write(path, lambda f: json.dump(arr, f)); atomic_write(path, lambda f: torch.save(arr, f))\n"
        "    def write(f):\n"
        "        np.savez(f, a=arr)\n"
        "    atomic_write(path, write)\n")
    assert sorted(code for _, _, code in seen) == sorted([  # what it must see, and not the atomic writes
        "open(path, 'w')", "open(path, mode='ab')", "os.fdopen(fd, 'w')", "os.open(path, os.O_WRONLY | os.O_CREAT)",
        "fig.savefig(path)", "np.save(path, arr)", "torch.save(arr, path)", "json.dump(arr, open(path))",
        "path.write_text('x')", "shutil.copyfile(path, path)"]), seen
    package = os.path.join(REPO, "dist_eval")
    found, listed = [], set()
    for folder, _, files in os.walk(package):
        for name in sorted(f for f in files if f.endswith(".py")):
            module = os.path.relpath(os.path.join(folder, name), package)
            if module == "atomic.py":
                continue
            for line, function, code in direct_writes(open(os.path.join(folder, name)).read()):
                if (module, function) in NOT_THROUGH_ATOMIC:
                    listed.add((module, function))
                else:
                    found.append(f"dist_eval/{module}:{line} ({function}): {code[:120]}")
    assert not found, "files written not through dist_eval/atomic.py (atomic_write, atomic_create):\n" + \
        "\n".join(found)
    assert listed == set(NOT_THROUGH_ATOMIC), f"listed but no longer found: {set(NOT_THROUGH_ATOMIC) - listed}"
