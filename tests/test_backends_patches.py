"""dist_eval.backends.petals.shims: every patch of petals/hivemind applied in one place per side,
the version guard, the inventory in docs/design.md, and what counts as a server failure.
The last two tests run a real private swarm (marked `swarm`)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, write_csv

# the same on any stack: a bridge for other versions than the installed is applied with nothing to replace
CLIENT_PATCHES = ["hivemind_reexports", "stub_lock", "petals_version_assert", "get_file_from_repo",
                  "no_version_check", "model_type_as_saved", "client_dht_on_cpu", "prefix_tokens_on_cpu",
                  "tied_lm_head_on_meta", "failover",
                  "request_size", "deep_prompts", "announced_numerics", "quiet_lost_handoffs"]
SERVER_BRIDGES = ["decoder_mask", "bool_mask", "attention_init", "cache_block"]
SERVER_PATCHES = [*CLIENT_PATCHES, *SERVER_BRIDGES, "merged_forward", "wire_server", "config_forms",
                  "block_options_llama", "server_rotary_falcon",
                  "server_version", "drain", "block_index", "peft_on_demand",
                  "own_identity", "loopback_direct", "inherited_shared_memory", "state_file",
                  "announced_numerics_server"]
# the peft bridge, as petals' adapters module is first imported (a server with --adapters)
LAZY_BRIDGES = ["peft_names"]

# each in a fresh Python: the patches applied after one entry point, and the symbols they replaced
ENTRY_POINTS = {
    "import_petals": "from dist_eval.backends.petals.shims import import_petals\nimport_petals()",
    "PetalsClassifier": """
import types, torch
from dist_eval.backends.families import FAMILIES
from dist_eval.backends.petals.backend import PetalsClassifier
layers = types.SimpleNamespace(forward=None, sequence_manager=types.SimpleNamespace(state=None, dht=None))
inner = types.SimpleNamespace(model=types.SimpleNamespace(layers=layers, embed_tokens=torch.nn.Embedding(5, 2)),
                              config=types.SimpleNamespace(tuning_mode=None, pre_seq_len=0))
import dist_eval.backends.petals.backend as p
p.HelperWatch = lambda *a, **k: types.SimpleNamespace(start=lambda: None)  # no helper processes here
PetalsClassifier(inner, FAMILIES["llama"])""",
    "load_petals": """
from dist_eval.backends.petals.backend import load_petals
from dist_eval.errors import UsageError
try:
    load_petals("unused", None, None, [], None, {}, 1.0)
except UsageError:
    pass""",
    "apply_server_patches": "from dist_eval.swarm.server import apply_server_patches\napply_server_patches()",
}
_REPORT = "\nfrom dist_eval.backends.petals import shims\nprint(json.dumps([shims.applied(), shims.replaced()]))"
# test_the_server_patches_refuse_another_order's check, in import_petals' fresh Python after its entry (a fresh
# Python less): a server patch applied before the one it wraps is refused, and nothing is set or recorded (the
# entry's report, after it, still lists the client patches alone)
_REFUSAL = """
from dist_eval.swarm import wire
from dist_eval.backends.petals.shims import apply
try:
    apply("wire_server", "server", wire.server_replacements, after=("merged_forward",))
except RuntimeError as e:
    print("refused:", e)
import petals.server.handler as handler, petals.server.block_functions as functions
assert handler.run_rpc_forward is functions.run_rpc_forward  # nothing set
"""
# after a server's patches, petals' PEFT module imported (a lazy bridge), what the bridges' probes say
# (test_every_bridge_is_still_needed_by_the_installed_stack_and_applied: one fresh Python for both tests)
_PROBES = """
import petals.utils.peft  # noqa: F401
from dist_eval.backends.petals import shims
print('NEEDED', json.dumps(shims.still_needed()))
print('HERE', json.dumps({name: shims.bridged_here(name) for name in shims.BRIDGES}))
"""
CHECKED_AFTER = {"import_petals": _REFUSAL, "apply_server_patches": _PROBES}


def _in_fresh_python(code: str, env=None):
    """(the patches applied, the symbols replaced, everything it printed) after ``code`` in a fresh Python."""
    proc = subprocess.run([sys.executable, "-c", "import json\n" + code + _REPORT], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, **(env or {})})  # a hang's
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (*json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout)


@pytest.fixture(scope="module")
def entry_results():
    return {name: _in_fresh_python(code + CHECKED_AFTER.get(name, "")) for name, code in ENTRY_POINTS.items()}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_applies_every_patch_of_its_side(entry_results, entry):
    applied, replaced, _ = entry_results[entry]
    assert applied == ([*SERVER_PATCHES, *LAZY_BRIDGES] if entry == "apply_server_patches" else CLIENT_PATCHES)
    assert "hivemind.p2p.servicer.ServicerBase._collect_rpc_handlers" in replaced  # the stub lock


def _inventory(installed_only: bool = False) -> dict:
    """{symbol: side} of the table under "What dist_eval changes in petals" in docs/design.md; ``installed_only``:
    less the rows of a bridge whose versions ("Assumes" as requirements) are not those installed here.
    """
    from packaging.requirements import InvalidRequirement

    from dist_eval.backends.petals.shims import satisfied

    def here(assumes: str) -> bool:
        try:
            return satisfied(assumes)
        except InvalidRequirement:  # prose: a patch applied on any stack
            return True

    text = open(os.path.join(REPO, "docs", "design.md")).read()
    section = text.split("## What dist_eval changes in petals", 1)[1].split("\n## ", 1)[0]
    rows = re.finditer(r"^\| `([\w.]+)` \| (\w+) \| ([^|]+) \|", section, re.MULTILINE)
    return {m.group(1): m.group(2) for m in rows if not installed_only or here(m.group(3).strip())}


def test_the_inventory_lists_exactly_what_the_patches_replace(entry_results):
    """Every symbol replaced in a server (client and server patches, the lazy bridges too), and those only; a
    bridge's rows for other versions than the installed are the rows left out here (on the pinned stack: 5.x's).
    """
    _, replaced, _ = entry_results["apply_server_patches"]
    assert _inventory(installed_only=True) == replaced
    assert set(replaced) <= set(_inventory())


def test_every_bridge_is_still_needed_by_the_installed_stack_and_applied(entry_results):
    """Issue 71: a bridge (shims.BRIDGES) the installed petals/hivemind no longer needs fails here: remove it, and
    its version pin. Asked in a fresh Python after a server's patches (the probes read the originals apply
    recorded)."""
    applied, _, printed = entry_results["apply_server_patches"]
    needed = json.loads(printed.split("NEEDED ", 1)[1].splitlines()[0])
    here = json.loads(printed.split("HERE ", 1)[1].splitlines()[0])
    from dist_eval.backends.petals.shims import BRIDGES

    # needed exactly where its versions are installed: on transformers 5.x all, on the pinned stack the first three
    assert set(needed) == set(BRIDGES) and needed == here, (needed, here)
    assert set(BRIDGES) <= set(applied) and set(BRIDGES) <= {*CLIENT_PATCHES, *SERVER_BRIDGES, *LAZY_BRIDGES}
    transformers_major = int(__import__("transformers").__version__.split(".")[0])
    assert all(here.values()) == (transformers_major >= 5), here


def test_a_bridge_found_unneeded_says_so(monkeypatch):
    """The probes can say no: hivemind with every name petals imports, petals' start-up without a PyPI check."""
    from dist_eval.backends.petals import shims

    shims.import_petals()  # first: petals imports what the re-exports put back
    import hivemind
    import petals.utils.version as version

    assert shims.still_needed()["hivemind_reexports"]
    monkeypatch.setitem(shims._applied, "hivemind_reexports", ("both", []))  # as if nothing had been missing
    for name in shims._HIVEMIND_REEXPORTS:
        monkeypatch.setattr(hivemind, name, getattr(hivemind, name), raising=False)
    monkeypatch.setitem(shims._applied, "no_version_check", ("both", []))

    def validate_version():  # a petals whose start-up asks nobody
        return None

    monkeypatch.setattr(version, "validate_version", validate_version)
    found = shims.still_needed()
    assert {name: found[name] for name in ("hivemind_reexports", "stub_lock", "no_version_check")} == {
        "hivemind_reexports": False, "stub_lock": True, "no_version_check": False}


# the 4.33 mask helpers' outputs, computed by transformers 4.33 itself (conftest.on_pinned_stack)
PINNED_MASKS = """
import torch
from transformers.models.bloom.modeling_bloom import BloomModel
from transformers.models.falcon.modeling_falcon import FalconModel
from transformers.models.llama.modeling_llama import LlamaModel

batch, length, found = 2, 4, {}
for past in (0, 3):
    ones, embeds = torch.ones(batch, length + past), torch.zeros(batch, length, 8)
    found[past] = {"llama": LlamaModel._prepare_decoder_attention_mask(None, ones, (batch, length), embeds, past),
                   "falcon": FalconModel._prepare_attn_mask(ones, (batch, length), past),
                   "bloom": BloomModel._prepare_attn_mask(None, ones, (batch, length), past)}
torch.save(found, OUT)
"""


@pytest.fixture(scope="module")
def pinned_masks(tmp_path_factory) -> dict:
    """{past: {family: mask}} of transformers 4.33's own helpers (run in the pinned stack's Python)."""
    from conftest import on_pinned_stack

    return on_pinned_stack(PINNED_MASKS, tmp_path_factory.mktemp("masks"))


@pytest.mark.parametrize("past", [0, 3])
def test_the_bridges_mask_helpers_equal_the_pinned_transformers_own(past, pinned_masks):
    """Issue 71: the 4.33 mask helpers that the server bridges give transformers 5.x (petals' blocks call them) equal
    4.33's own (computed by transformers 4.33, in the pinned stack's Python): the decoder mask (additive), the static
    bool mask, and the bool mask made additive for 5.x's alibi attention. A copy that drifts from the original fails.
    """
    from dist_eval.backends.petals import shims

    batch, length = 2, 4
    embeds = torch.zeros(batch, length, 8)
    ones = torch.ones(batch, length + past)
    pinned = pinned_masks[past]
    assert torch.equal(shims.prepare_decoder_attention_mask(None, ones, (batch, length), embeds, past),
                       pinned["llama"])
    assert torch.equal(shims.prepare_bool_attn_mask(ones, (batch, length), past), pinned["falcon"])
    additive = shims.alibi_additive_mask(ones, (batch, length), past, torch.float32)
    assert torch.equal(additive == torch.finfo(torch.float32).min, pinned["bloom"]) and set(
        additive.unique().tolist()) <= {0.0, torch.finfo(torch.float32).min}


def test_the_tuple_cache_gives_petals_layout_back():
    """The cache object the alibi block's bridge hands 5.x's attention: the past (4.33's layout) before the new
    keys and values, and ``present`` in 4.33's layout again."""
    from dist_eval.backends.petals.shims import TupleCache

    batch, heads, past, new, dim = 2, 3, 4, 1, 5
    key = torch.randn(batch, heads, past + new, dim)
    value = torch.randn(batch, heads, past + new, dim)
    as_petals = (key[:, :, :past].reshape(batch * heads, past, dim).permute(0, 2, 1),
                 value[:, :, :past].reshape(batch * heads, past, dim))
    cache = TupleCache(as_petals, batch, heads)
    assert cache.get_seq_length() == past
    full_key, full_value = cache.update(key[:, :, past:], value[:, :, past:], 0)
    assert torch.equal(full_key, key) and torch.equal(full_value, value)
    present_key, present_value = cache.present()
    assert torch.equal(present_key, key.reshape(batch * heads, past + new, dim).permute(0, 2, 1))
    assert torch.equal(present_value, value.reshape(batch * heads, past + new, dim))


def test_the_file_helper_bridge_finds_a_file_and_answers_none_for_a_missing_one(tmp_path):
    """transformers.utils.get_file_from_repo as the bridge gives it back (on 5.x): a folder's file, or None; built
    on any stack (its cached_file is 4.33's too), and where transformers has its own (4.33), answering as that does."""
    import transformers.utils

    from dist_eval.backends.petals import shims

    (tmp_path / "config.json").write_text("{}")
    (_, _, get_file_from_repo), = shims.get_file_from_repo_back()
    assert get_file_from_repo(str(tmp_path), "config.json") == str(tmp_path / "config.json")
    assert get_file_from_repo(str(tmp_path), "adapter_config.json") is None
    own = getattr(transformers.utils, "get_file_from_repo", None)
    if not shims.bridged_here("get_file_from_repo"):  # the installed transformers' own: the bridge's model
        assert own is not get_file_from_repo
        for name in ("config.json", "adapter_config.json"):
            assert own(str(tmp_path), name) == get_file_from_repo(str(tmp_path), name), name


def test_the_server_patches_refuse_another_order(entry_results):
    """After import_petals (client patches only), in a fresh Python: _REFUSAL (run there, its asserts with it)."""
    applied, _, printed = entry_results["import_petals"]
    assert "refused: patch 'wire_server' applied before ['merged_forward']" in printed
    assert applied == CLIENT_PATCHES  # nothing recorded by the refusal


def test_another_petals_or_hivemind_is_refused_in_one_line_unless_allowed(monkeypatch, capsys):
    from dist_eval.backends.petals import shims
    from dist_eval.backends.petals.shims import import_petals
    from dist_eval.errors import UsageError

    versions = {"petals": "2.3.0", "hivemind": "1.1.12"}
    monkeypatch.setattr(shims, "installed_version", versions.get)
    monkeypatch.setattr(shims, "_versions_checked", False)
    monkeypatch.delenv(shims.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(shims.UnsupportedPetalsError) as caught:
        import_petals()  # checked before anything is imported or patched
    text = str(caught.value)
    assert "\n" not in text and isinstance(caught.value, ImportError) and isinstance(caught.value, UsageError)
    assert text.startswith("installed: petals 2.3.0; dist_eval's petals patches support petals 2.2.0.post1")
    assert "DIST_EVAL_ALLOW_UNSUPPORTED_PETALS=1" in text and "hivemind" not in text  # only what differs

    monkeypatch.setenv(shims.ALLOW_UNSUPPORTED_ENV, "1")
    import_petals()
    import_petals()  # checked once per process: one warning line
    warnings = [line for line in capsys.readouterr().err.splitlines() if "trying anyway" in line]
    assert len(warnings) == 1 and "petals 2.3.0" in warnings[0] and "2.2.0.post1" in warnings[0]


def test_only_transport_and_server_errors_are_server_failures():
    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PHandlerError
    from petals.client.routing.sequence_manager import MissingBlocksError

    from dist_eval.backends.petals.failover import ServerAnswerError, server_failure

    for error in (P2PHandlerError("Failed to call handler"), ControlFailure("failed to dial"), TimeoutError(),
                  ConnectionResetError(), EOFError(), MissingBlocksError([1]), ServerAnswerError("shape")):
        assert server_failure(error), error
    for error in (TypeError("'NoneType' object is not callable"), KeyError("x"), AttributeError("y"), ValueError()):
        assert not server_failure(error), error


def test_a_client_error_in_petals_own_requests_bans_no_server(capsys):
    from test_backends_failover import fail, make_manager

    manager, peers, _ = make_manager()
    with pytest.raises(TypeError, match="ours"):
        fail(manager, peers[2], TypeError("ours"))
    assert peers[2] not in manager.state.banned_peers
    assert not (getattr(manager.state, "dist_eval_outcomes", None) or {})
    assert "failed a request" not in capsys.readouterr().err


def test_a_size_refusal_in_unknown_words_is_no_dead_server():
    from dist_eval.backends.petals.requests import RequestTooLarge, UnrecognisedRefusal, too_large

    assert too_large(RuntimeError("Task size greater than max_batch_size (64), it can't be processed")).server_limit \
        == 64 and isinstance(too_large(RuntimeError("Task size greater than max_batch_size (8)")), RequestTooLarge)
    assert too_large(RuntimeError("connection refused")) is None
    with pytest.raises(UnrecognisedRefusal, match="max_batch_size in words dist_eval does not recognise"):
        too_large(RuntimeError("Batch of 100 tokens exceeds max_batch_size=64"))


# ---- on a real private swarm ------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(tiny_swarm):
    return tiny_swarm


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import datasets

    csv = write_csv(str(tmp_path_factory.mktemp("patches") / "data.csv"), 24, seed=3)
    return datasets.load_dataset("csv", data_files=csv, split="train")


def _failures(manager) -> list:
    outcomes = getattr(manager.state, "dist_eval_outcomes", None) or {}
    return [peer for peer, (_, ok) in outcomes.items() if not ok]


@pytest.mark.swarm
def test_a_client_side_error_ends_the_run_at_once_and_bans_no_server(swarm, tiny_model, tiny_checkpoint, data,
                                                                       monkeypatch, capfd):
    from transformers import AutoTokenizer

    from dist_eval import evaluate, load_model
    from dist_eval.backends.petals import wire
    from dist_eval.ranks.phases import RankFailure

    model = load_model("petals", tiny_model, checkpoint=tiny_checkpoint, initial_peers=swarm.initial_peers,
                       dht_prefix=swarm.dht_prefix, swarm_timeout=30.0)
    manager = model.module.sequence_manager

    def broken(*args, **kwargs):
        raise TypeError("a bug in dist_eval's request building")

    monkeypatch.setattr(wire, "_request_tensors", broken)
    started = time.monotonic()
    try:
        with pytest.raises(RankFailure, match="TypeError: a bug in dist_eval's request building") as caught:
            evaluate(model, data, tokenizer=AutoTokenizer.from_pretrained(tiny_model), batch_size=8, in_flight=2)
        took = time.monotonic() - started
        banned = [peer for peer in manager.state.sequence_info.block_infos[0].servers
                  if peer in manager.state.banned_peers]
        failures = _failures(manager)
    finally:
        model.close()
    assert isinstance(caught.value.__cause__, TypeError)  # the error itself, its traceback with it
    assert took < 10, took  # was: every server banned, retried until --swarm-timeout (30 s here)
    assert banned == [] and failures == []
    assert "failed a request" not in capfd.readouterr().err


@pytest.mark.swarm
def test_a_petals_object_with_requests_in_flight_on_a_fresh_stub_class_fails_none(swarm, tiny_model, data,
                                                                                  monkeypatch, capfd):
    """The in-memory model path applies the stub lock too, on hivemind's stub class as a fresh
    process has it (see _fresh_stub_class_without_the_lock)."""
    from dist_eval import evaluate
    from dist_eval.backends.petals import shims
    from dist_eval.backends.petals.helpers import shutdown_petals_client
    from dist_eval.backends.petals.shims import import_petals

    import_petals()  # petals' own import needs dist_eval's hivemind re-exports
    from petals.utils.auto_config import AutoDistributedModelForSequenceClassification
    from transformers import AutoTokenizer

    model = AutoDistributedModelForSequenceClassification.from_pretrained(
        swarm.model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix, num_labels=3,
        torch_dtype=torch.float32)
    manager = model.model.layers.sequence_manager
    try:
        _fresh_stub_class_without_the_lock(monkeypatch)
        result = evaluate(model, data, tokenizer=AutoTokenizer.from_pretrained(swarm.model_dir), batch_size=4,
                          in_flight=2, return_logits=True)
        failures = _failures(manager)
    finally:
        shutdown_petals_client(manager)
    assert "stub_lock" in shims.applied()  # applied again by the object's path
    assert result.predictions.logits.shape == (len(data), 3)
    assert failures == []
    assert "failed a request" not in capfd.readouterr().err


def _fresh_stub_class_without_the_lock(monkeypatch) -> None:
    """hivemind's stub collection as in a process whose petals was imported without the lock,
    petals' stub class not built yet, and its collection slowed so that threads meet in it."""
    from hivemind.p2p.servicer import ServicerBase
    from petals.server.handler import TransformerConnectionHandler

    from dist_eval.backends.petals import shims

    monkeypatch.setattr(ServicerBase, "_collect_rpc_handlers",
                        classmethod(ServicerBase._collect_rpc_handlers.__func__.__wrapped__))
    monkeypatch.delitem(shims._applied, "stub_lock")
    monkeypatch.setattr(TransformerConnectionHandler, "_rpc_handlers", None)
    monkeypatch.setattr(TransformerConnectionHandler, "_stub_type", None)
    strip = TransformerConnectionHandler._strip_iterator_hint

    def slow_strip(hint):
        time.sleep(0.02)  # widen the window in which the class is marked collected but has no stub type
        return strip(hint)

    monkeypatch.setattr(TransformerConnectionHandler, "_strip_iterator_hint", staticmethod(slow_strip))
