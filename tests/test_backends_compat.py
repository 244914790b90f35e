"""dist_eval.backends.compat (and the hivemind patches of dist_eval.backends.petals.shims), checked on the real
classes."""
import os
import subprocess
import sys
import threading
from typing import AsyncIterator

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh_servicer_class():
    """A new hivemind servicer class, its stub type not built yet (as in a fresh client
    process), whose handler collection is slow enough for threads to meet inside it."""
    import time

    from hivemind.p2p.servicer import ServicerBase
    from hivemind.proto import runtime_pb2

    class SlowServicer(ServicerBase):
        async def rpc_info(self, request: runtime_pb2.ExpertUID, context) -> runtime_pb2.ExpertInfo:
            raise NotImplementedError

        async def rpc_forward_stream(
            self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context
        ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
            raise NotImplementedError

        @classmethod
        def _strip_iterator_hint(cls, hint):
            time.sleep(0.02)  # widen the window in which the class is marked collected but has no stub type
            return super()._strip_iterator_hint(hint)

    return SlowServicer


def _stubs_from_threads(servicer_class, num_threads: int = 8):
    """get_stub from ``num_threads`` threads at once: (stubs, errors)."""
    barrier = threading.Barrier(num_threads)
    stubs, errors = [], []

    def first_request():
        barrier.wait()
        try:
            stubs.append(servicer_class.get_stub(None, None))
        except Exception as e:  # noqa: BLE001 - what the test reports
            errors.append(e)

    threads = [threading.Thread(target=first_request) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return stubs, errors


def test_concurrent_first_stubs_all_succeed():
    """The cause of "failed a request (TypeError: 'NoneType' object is not callable)" on a
    rank's first forwards: threads creating the first stub at once."""
    from dist_eval.backends.petals.shims import import_petals

    import_petals()  # applies the stub lock (shims.thread_safe_stub_collection), as every rank does
    stubs, errors = _stubs_from_threads(_fresh_servicer_class())
    assert errors == [] and len(stubs) == 8
    assert all(hasattr(stub, "rpc_info") and hasattr(stub, "rpc_forward_stream") for stub in stubs)


def _gated_servicer_class():
    """A new hivemind servicer class whose handler collection, in the first thread that runs it,
    stops inside the window (the class marked collected, no stub type yet) until released:
    (class, inside: set when a thread is there, release)."""
    from hivemind.p2p.servicer import ServicerBase
    from hivemind.proto import runtime_pb2

    inside, release = threading.Event(), threading.Event()

    class GatedServicer(ServicerBase):
        async def rpc_info(self, request: runtime_pb2.ExpertUID, context) -> runtime_pb2.ExpertInfo:
            raise NotImplementedError

        @classmethod
        def _strip_iterator_hint(cls, hint):
            if not inside.is_set():
                inside.set()
                release.wait(timeout=60)
            return super()._strip_iterator_hint(hint)

    return GatedServicer, inside, release


def test_unpatched_hivemind_fails_the_same_way(monkeypatch):
    """The race is real without the patch (so the test above can fail): a second stub asked
    for while the first thread is inside the collection fails, whatever the scheduling."""
    from hivemind.p2p.servicer import ServicerBase

    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    original = ServicerBase._collect_rpc_handlers.__func__.__wrapped__
    monkeypatch.setattr(ServicerBase, "_collect_rpc_handlers", classmethod(original))
    servicer, inside, release = _gated_servicer_class()
    first = []
    thread = threading.Thread(target=lambda: first.append(servicer.get_stub(None, None)))
    thread.start()
    try:
        assert inside.wait(timeout=60), "the first thread never reached the collection"
        with pytest.raises(TypeError, match="not callable"):
            servicer.get_stub(None, None)
    finally:
        release.set()
        thread.join(timeout=60)
    assert len(first) == 1 and hasattr(first[0], "rpc_info")  # the first one, once done, has its stub


@pytest.mark.swarm
def test_fresh_clients_first_requests_at_once_never_fail(tiny_model, tiny_checkpoint, tiny_swarm, capfd):
    """Three fresh clients one after the other (the race is the client's: one swarm serves
    them all, conftest's tiny_swarm: issue 46, this test started a 2-server swarm of its own);
    each sends its first forwards at once from several threads (as --in-flight does), its stub
    class not built yet as in a new process: no request fails."""
    import torch

    from dist_eval.backends import load_model
    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    from petals.server.handler import TransformerConnectionHandler

    input_ids = torch.tensor([[2, 3, 4, 5, 0], [6, 7, 8, 0, 0]])
    for _ in range(3):
        # as in a new client process: no stub class built yet
        TransformerConnectionHandler._rpc_handlers = TransformerConnectionHandler._stub_type = None
        model = load_model("petals", tiny_model, checkpoint=tiny_checkpoint, initial_peers=tiny_swarm.initial_peers,
                           dht_prefix=tiny_swarm.dht_prefix)
        try:
            logits = _first_forwards_at_once(model.module, input_ids, num_threads=4)
        finally:
            model.close()
        assert all(x is not None and torch.equal(x, logits[0]) for x in logits)
    err = capfd.readouterr().err
    assert "failed a request" not in err, err[-3000:]


def _first_forwards_at_once(forward, input_ids, num_threads: int) -> list:
    import torch

    barrier = threading.Barrier(num_threads)
    results = [None] * num_threads

    def first_forward(i):
        barrier.wait()
        with torch.no_grad():
            results[i] = forward(input_ids)

    threads = [threading.Thread(target=first_forward, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results



# normal_ on a meta tensor imports torch._dynamo (seconds per process); the context skips it, and leaves
# every real tensor's draw exactly as torch makes it. Run in _DATASETS_THEN_QUIET's fresh Python after its
# own check (a fresh Python less), where torch._dynamo is asserted not imported before it
_META_TENSORS = """
import sys, torch
assert "torch._dynamo" not in sys.modules, "imported before the check"
from dist_eval.backends.compat import no_random_init_of_meta_tensors
torch.manual_seed(0); expected = torch.nn.init.normal_(torch.empty(5, 3), std=0.02)
with no_random_init_of_meta_tensors():
    meta = torch.nn.Embedding(7, 3, device="meta")
    torch.manual_seed(0); got = torch.nn.init.normal_(torch.empty(5, 3), std=0.02)
assert meta.weight.is_meta and torch.equal(got, expected)
assert "torch._dynamo" not in sys.modules, "normal_ on a meta tensor imported torch._dynamo"
assert torch.nn.init.normal_.__module__ == "torch.nn.init"  # restored
print("ok")
"""
# imported first (a user's script), datasets is silenced through its own functions
_DATASETS_THEN_QUIET = ("import datasets\nfrom dist_eval.backends.compat import quiet_third_party_output\n"
                        "quiet_third_party_output()\nprint(datasets.is_progress_bar_enabled(), "
                        "datasets.logging.get_verbosity() == datasets.logging.ERROR)\n")


@pytest.fixture(scope="module")
def datasets_then_quiet():
    """The lines _DATASETS_THEN_QUIET, then _META_TENSORS, printed in one fresh Python."""
    return _run_fresh(_DATASETS_THEN_QUIET + _META_TENSORS).splitlines()


def test_meta_tensors_are_not_randomly_initialised_and_others_are_unchanged(datasets_then_quiet):
    assert datasets_then_quiet[-1] == "ok", datasets_then_quiet  # _META_TENSORS ran to its end, its asserts passed


_QUIET_THEN_DATASETS = """
import sys
from dist_eval.backends.compat import quiet_third_party_output
from dist_eval.backends.petals.shims import import_petals
quiet_third_party_output()
import_petals()
print("datasets imported by petals' import:", "datasets" in sys.modules)
import datasets
print("bars disabled:", datasets.is_progress_bar_enabled() is False)
print("verbosity error:", datasets.logging.get_verbosity() == datasets.logging.ERROR)
"""


def _run_fresh(code: str) -> str:
    """stdout of ``code`` in a new Python, without the user's datasets settings in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "DATASETS_VERBOSITY")}
    env["PYTHONPATH"] = REPO_ROOT
    # a deadline for a hang, not a speed: on a loaded 2-core machine a fresh Python importing petals took over
    # 120 s of wall (its output all printed, still exiting: a suite run's failure)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_quieting_does_not_import_datasets_and_still_silences_it():
    """A swarm server (which loads no data) no longer imports datasets for its quieting
    (~0.5 s of CPU each), and a process that loads data afterwards still gets no bars."""
    out = _run_fresh(_QUIET_THEN_DATASETS)
    assert "datasets imported by petals' import: False" in out
    assert "bars disabled: True" in out
    assert "verbosity error: True" in out


def test_quieting_after_datasets_was_imported_silences_it(datasets_then_quiet):
    """Imported first (a user's script), datasets is silenced through its own functions (_DATASETS_THEN_QUIET)."""
    assert datasets_then_quiet[0].split() == ["False", "True"], datasets_then_quiet


@pytest.mark.swarm
def test_a_server_without_adapters_imports_no_bitsandbytes(tiny_model, tiny_checkpoint, tiny_swarm):
    """A server's TransformerBackend imported petals.utils.peft, and bitsandbytes with it (0.6 s of
    every server's start on a CPU), for a using_adapter that is a no-op without adapters
    (dist_eval.swarm.server._peft_on_demand); a joining server checked that no other peer used its new
    identity file, with a second p2pd (_own_identity_unchecked), and was dialled back to learn that it
    is reachable on loopback, with a third, and kept a probe, a fourth (_loopback_is_direct). The
    servers serve, without any of it."""
    import torch
    from conftest import all_pids

    from dist_eval.backends import load_model

    def p2pd_in_group(pid, group):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return os.getpgid(pid) == group and f.read().split(b"\0")[0].endswith(b"p2pd")
        except OSError:  # gone meanwhile
            return False

    model = load_model("petals", tiny_model, checkpoint=tiny_checkpoint, initial_peers=tiny_swarm.initial_peers,
                       dht_prefix=tiny_swarm.dht_prefix)
    try:
        with torch.no_grad():
            assert model.module(torch.tensor([[2, 3, 4, 5]])).shape == (1, model.num_labels)
    finally:
        model.close()
    for server in tiny_swarm.servers:
        with open(f"/proc/{server.pgid}/maps") as maps:  # the server's main process leads its group
            assert "bitsandbytes" not in maps.read(), server.label
        # nor a second p2pd to check that no other peer uses its own new identity
        log = server.read_log()
        assert "Started" in log and "is not used by other peers" not in log, server.label
        # nor a third to be dialled back on loopback, where every peer is a local process
        assert "This server is accessible" not in log, server.label
        # and one p2pd in its group, its DHT's: no probe to dial other peers back
        daemons = [pid for pid in all_pids() if p2pd_in_group(pid, server.pgid)]
        assert len(daemons) == 1, (server.label, daemons)


# transformers 4.33's LlamaAttention (petals' llama server block copies its arithmetic): its output on a causal,
# grouped-k/v input at head_dim 8, and what dist_eval's attention step is given there (q and k after RoPE, v)
PINNED_LLAMA_ATTENTION = """
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

torch.manual_seed(0)
attention = LlamaAttention(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64)).eval()
batch, rows, hidden = 3, 11, torch.randn(3, 11, 32)
position_ids = torch.arange(rows)[None]
mask = torch.full((rows, rows), torch.finfo(torch.float32).min).triu(1)[None, None].expand(batch, 1, rows, rows)
heads = lambda projection, count: projection(hidden).view(batch, rows, count, 8).transpose(1, 2)
with torch.no_grad():
    expected = attention(hidden, attention_mask=mask, position_ids=position_ids)[0]
    q, k, v = heads(attention.q_proj, 4), heads(attention.k_proj, 2), heads(attention.v_proj, 2)
    q, k = apply_rotary_pos_emb(q, k, *attention.rotary_emb(v, seq_len=rows), position_ids)
torch.save({"expected": expected, "q": q, "k": k, "v": v, "mask": mask, "o_proj": attention.o_proj.weight}, OUT)
"""


def test_the_divided_attention_repeats_the_pinned_llama_attention_bit_for_bit(tmp_path):
    """Issue 71: ``divided_attention`` (what ``--backend local`` computes for Llama-type families where transformers
    offers a choice, >= 4.48: Family.local_attention) repeats, step for step, the attention of the pinned
    transformers' LlamaAttention (computed by transformers 4.33, in the pinned stack's Python), whose arithmetic
    petals' llama server block copies (q k^T divided by sqrt(head_dim)): the same bits at head_dim 8 with grouped k/v
    heads and the causal mask. There the two roundings differ: transformers 5.x's "eager" multiplies by
    head_dim ** -0.5 (so does it at head_dim 128), and its default, "sdpa", computes otherwise again: the swarm was
    2e-06 off the local backend on 5.23 (the audit's tests)."""
    import math
    import types

    import torch
    import transformers
    from conftest import on_pinned_stack
    from packaging.version import Version

    from dist_eval.backends.compat import attention_choice
    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.layers import DIVIDED_ATTENTION, divided_attention

    pinned = on_pinned_stack(PINNED_LLAMA_ATTENTION, tmp_path)
    expected, q, k, v = pinned["expected"], pinned["q"], pinned["k"], pinned["v"]
    batch, rows = expected.shape[:2]
    with torch.no_grad():
        steps = divided_attention(types.SimpleNamespace(num_key_value_groups=2), q, k, v, pinned["mask"])[0]
        found = torch.nn.functional.linear(steps.reshape(batch, rows, 32), pinned["o_proj"])
        scores = torch.matmul(q, k.repeat_interleave(2, dim=1).transpose(2, 3))
    assert torch.equal(found, expected)
    assert not torch.equal(scores / math.sqrt(8), scores * 8 ** -0.5)  # what the test tells apart, at this head_dim
    # Llama's families ask for this attention where transformers offers a choice (>= 4.36); the pinned 4.33 offers none
    offered = Version(transformers.__version__) >= Version("4.36")
    assert attention_choice(FAMILIES["llama"]) == ({"attn_implementation": DIVIDED_ATTENTION} if offered else {})
    assert {FAMILIES[name].local_attention for name in ("llama", "mistral", "qwen2")} == {DIVIDED_ATTENTION}


def _load_report_of(missing: set, logger) -> None:
    """transformers 5.x's LOAD REPORT of a load missing ``missing``, said to ``logger``, then 4.x's line of it."""
    import importlib

    import torch
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(missing_keys=missing, unexpected_keys=set(), mismatched_keys=set(), error_msgs=[],
                             conversion_errors={}, skipped_pp_keys=set())
    importlib.import_module("transformers.modeling_utils").log_state_dict_report(
        model=torch.nn.Linear(1, 1), pretrained_model_name_or_path="F", ignore_mismatched_sizes=False,
        loading_info=info, logger=logger)
    logger.warning(f"Some weights of X were not initialized from the model checkpoint at F and are newly "
                   f"initialized: {sorted(missing)}")


@pytest.mark.parametrize("thread_names", [True, False], ids=["logThreads", "no logThreads"])
def test_loads_in_threads_quiet_their_own_reports_alone_and_leave_transformers_and_torch_as_found(thread_names,
                                                                                               monkeypatch):
    """dist_eval's loads replace three functions of transformers and torch for their time (the load report, the
    quantizer's setup, normal_ on meta tensors: backends.compat). Loads in a caller's threads, entered and left out
    of order (A in, B in, A out, B out), leave each function as it was found (before: B restored A's replacement,
    and every later load of the process, the caller's own, lost its missing-head lines); and while A's load is in,
    a load in another thread hears its report whole; also where logging records no thread (logging.logThreads)."""
    import importlib
    import logging

    import torch
    from transformers.utils import logging as hf_logging

    from dist_eval.backends import compat

    monkeypatch.setattr(logging, "logThreads", thread_names)
    modeling = importlib.import_module("transformers.modeling_utils")
    found = (modeling.log_state_dict_report, modeling.get_hf_quantizer, torch.nn.init.normal_)
    said, logger = [], logging.getLogger("transformers.modeling_utils")

    class Keep(logging.Handler):
        def emit(self, record):
            said.append((threading.current_thread().name, "score.weight" in record.getMessage()))

    a_in, b_in, a_out, caller_done = (threading.Event() for _ in range(4))

    def loads(first, then, done):
        with compat.heads_read_after("score"), compat.no_quantizer_for_remote_blocks(), \
                compat.no_random_init_of_meta_tensors():
            first.set()
            for event in then:
                assert event.wait(30)
            _load_report_of({"score.weight"}, logger)  # its own load: the head it reads after, unsaid
        done.set()

    keep, verbosity = Keep(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logger.addHandler(keep)
    try:
        a = threading.Thread(target=loads, args=(a_in, (caller_done, b_in), a_out), name="A")
        b = threading.Thread(target=lambda: a_in.wait(30) and loads(b_in, (a_out,), threading.Event()), name="B")
        a.start(), b.start()
        assert a_in.wait(30)
        # a caller's load in another thread while A's is in: said as ever
        caller = threading.Thread(target=_load_report_of, args=({"score.weight"}, logger), name="caller")
        caller.start(), caller.join(30)
        caller_done.set()
        a.join(30), b.join(30)
    finally:
        logger.removeHandler(keep)
        hf_logging.set_verbosity(verbosity)
    assert (modeling.log_state_dict_report, modeling.get_hf_quantizer, torch.nn.init.normal_) == found
    assert said == [("caller", True), ("caller", True)], said  # 5.x's report, 4.x's line


def test_a_replacement_that_fails_or_meets_anothers_patch_leaves_the_function_as_it_should_be():
    """compat._ScopedReplacement: a replacement whose making fails changes nothing (before: the count of loads in
    stayed up, the dispatch for good); another's patch of the same function set and undone while a load is in
    (transformers' no_init_weights around a caller's model) is not put back over at the load's end."""
    import torch

    from dist_eval.backends import compat

    found = torch.nn.init.normal_

    def broken(original):
        raise RuntimeError("no replacement")

    with pytest.raises(RuntimeError, match="no replacement"), compat.no_random_init_of_meta_tensors(), \
            compat._NORMAL.within(broken):
        pass
    assert torch.nn.init.normal_ is found
    with compat.no_random_init_of_meta_tensors():
        assert torch.nn.init.normal_ is not found
    assert torch.nn.init.normal_ is found

    def skip(tensor, *args, **kwargs):
        return tensor

    torch.nn.init.normal_ = skip  # another's patch, set before the load
    try:
        with compat.no_random_init_of_meta_tensors():
            torch.nn.init.normal_ = found  # ... and undone by them while the load is in
    finally:
        left, torch.nn.init.normal_ = torch.nn.init.normal_, found
    assert left is found
