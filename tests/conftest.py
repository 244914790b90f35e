"""Shared fixtures: a tiny Llama classifier (model folder + tokenizer + checkpoint) and
small datasets, generated deterministically in a temp folder (nothing downloaded)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import subprocess
import sys
import uuid
from typing import Dict, Optional

import datasets  # noqa: F401  (see below)
import process_leaks  # no test leaves a process behind
import pytest
import suite_plugin  # the gpu, multiproc and swarm marks, checked; --reverse-order
import torch
from threadpoolctl import threadpool_limits
from transformers.utils import logging as hf_logging

# datasets binds its log handler to sys.stderr when imported, transformers when its logging is
# first used: here, before any test, not inside a test whose captured stream is closed after it
# (a later test's log line would then print a "--- Logging error ---" traceback).
hf_logging.get_logger()

# One thread for what a test computes in this process, as a torchrun rank computes (torchrun sets
# OMP_NUM_THREADS=1; tests/inprocess_cli.py's one_thread did it per call): the suite runs two
# workers and their processes on two cores, where two threads per matmul only wait on each other
# (benchmarks/RESULTS.md, 2026-11-27: test_backends_zeroshot's transformers reference 7.6 s -> 0.4 s;
# six in-process files 89-102 s -> 44-53 s of CPU). BLAS (numpy, scikit-learn) alike; a test that
# wants more threads asks for them (test_merge_ranks' threadpool_limits). The processes a test
# starts get their own settings, as before (this changes no variable of the environment).
torch.set_num_threads(1)
threadpool_limits(limits=1)


def pytest_addoption(parser):
    suite_plugin.add_options(parser)


def pytest_configure(config):
    config.addinivalue_line("markers", "simulation: many simulated runs of a statistic, vectorized (seconds, in "
                                       "every run of the suite)")
    for plugin in (process_leaks, suite_plugin):
        if not config.pluginmanager.is_registered(plugin):
            config.pluginmanager.register(plugin, f"dist_eval_{plugin.__name__}")
    process_leaks.stop_on_sigterm(config)

# This test process's own mark, inherited by every process it starts (also once orphaned): each
# pytest process (an xdist worker too) sets its own, so that swarm_server_pids tells this process's
# servers from those of another worker or of another pytest run on the same machine.
os.environ["DIST_EVAL_TEST_PROCESS"] = uuid.uuid4().hex
# The row store (dist_eval/rowstore/) is on by default, in the user's cache: the suite turns it
# off for every run it starts (torchrun jobs inherit this), so that no test is served the rows of
# another test or of an earlier run (two runs compared bit for bit must both evaluate). The row
# store's own tests (tests/test_rowstore.py) pass a folder of their own.
os.environ["DIST_EVAL_ROW_STORE"] = "off"
# The swarm audit replays 3% of a client's forwards, and each server's first, on a swarm the run did
# not start (dist_eval.backends.petals.audit): tests count their servers' requests, so the suite's default
# is none; the audit's own tests (tests/test_audit.py) pass a share.
os.environ["DIST_EVAL_AUDIT"] = "0"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = [f"w{i}" for i in range(60)]


def build_tiny_model(folder: str, seed: int = 0, num_layers: int = 4, family: str = "llama", layout: str = "causal_lm",
                     variant: str = "") -> str:
    """A random tiny ``<family>ForCausalLM`` + word-level tokenizer, saved like a real model.

    ``family``: llama (the default, unchanged), bloom, falcon, mistral, qwen2, qwen3 (head_dim 16, not
    hidden/heads), qwen3_moe (4 experts, 2 per token, blocks 0 and 2 dense) or glm4_moe (head_dim 16,
    half of it rotated, q/k/v biases, no q/k norm; block 0 dense, the others 4 experts in 2 groups, 2
    per token, and a shared expert) or mixtral (head_dim 16, every block 4 experts, 2 per token) or
    deepseek_v3 / kimi_k2 (the latent attention, yarn RoPE; block 0 dense, the others GLM-4.5's mixture) or
    llama4_text (head_dim 16, blocks 1 and 3 of 4 experts, 2 per token, and a shared expert, block 3 no RoPE).
    ``layout``: "causal_lm"
    (a ``*ForCausalLM`` save: ``model.``/``transformer.`` key prefixes), "base" (a base model
    save, e.g. ``BloomModel``: ``h.<i>.`` keys, the layout of bigscience's hub checkpoints)
    or "seq_cls" (a ``*ForSequenceClassification`` save, with a random 3-class ``score``).
    Every layout of one (family, seed, num_layers, variant) holds the same weights.
    ``variant`` (falcon only): "" (falcon-40b style: new decoder architecture, rotary,
    2 kv heads), "alibi" (alibi instead of rotary) or "7b" (falcon-7b style: multi-query,
    parallel attention).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(seed)
    config = _tiny_config(family, len(vocab), num_layers, variant)
    from dist_eval.backends.blocks import family_class
    from dist_eval.backends.compat import configs_are_dataclasses
    from dist_eval.backends.families import FAMILIES

    model = family_class(FAMILIES[family].local_lm_class, in_petals=False)(config)
    if layout == "base":
        model = model.base_model
    elif layout == "seq_cls":
        config.num_labels = 3
        classifier = family_class(FAMILIES[family].local_class, in_petals=False)(config)
        classifier.base_model.load_state_dict(model.base_model.state_dict())
        model = classifier
    elif layout != "causal_lm":
        raise ValueError(f"layout={layout!r}")
    # dist_eval's classes' names as they are: transformers 5.x reverts its own conversion mapping of a model_type on
    # save by default (kimi_k25's "blocks" -> "layers" of its vision tower turned this text model's layers to blocks)
    as_built = {"save_original_format": False} if configs_are_dataclasses() else {}
    model.save_pretrained(folder, safe_serialization=True, **as_built)
    return folder


def split_into_shards(src: str, dst: str, blocks: bool = True) -> str:
    """``src`` (a single-file ``*ForCausalLM`` Llama save) re-saved in ``dst`` as a sharded folder: one
    shard per block (``model-blocks-<i>.safetensors``) and one for the rest (``model-client.safetensors``),
    with their index; ``blocks=False`` leaves the block shards out (what petals' client keeps of a model)."""
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), dst)
    shards = {}
    for key, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        block = key.split(".")[2] if key.startswith("model.layers.") else None
        shard = "model-client.safetensors" if block is None else f"model-blocks-{block}.safetensors"
        shards.setdefault(shard, {})[key] = tensor.contiguous()
    for shard, tensors in sorted(shards.items()):
        if blocks or shard == "model-client.safetensors":
            save_file(tensors, os.path.join(dst, shard), metadata={"format": "pt"})
    weight_map = {key: shard for shard, tensors in sorted(shards.items()) for key in sorted(tensors)}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        total_size = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=1)
    return dst


def _families_config(family: str, **fields):
    """A config of ``family`` in dist_eval's config class for it (its model classes' ``config_class``): where
    transformers has the family itself (mistral, qwen2... on 5.x), AutoConfig gives transformers' own class, whose
    fields dist_eval's classes (built on another family's) do not read (5.x: no ``attention_bias``)."""
    from dist_eval.backends.blocks import family_class
    from dist_eval.backends.families import FAMILIES

    return family_class(FAMILIES[family].local_lm_class, in_petals=False).config_class(**fields)


def _tiny_config(family: str, vocab_size: int, num_layers: int, variant: str = ""):
    common = dict(vocab_size=vocab_size, hidden_size=32, num_attention_heads=4, pad_token_id=0, bos_token_id=None,
                  eos_token_id=None)
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(intermediate_size=64, num_hidden_layers=num_layers, max_position_embeddings=128, **common)
    if family == "bloom":
        from transformers import BloomConfig

        return BloomConfig(n_layer=num_layers, **common)
    if family == "falcon":
        from transformers import FalconConfig

        shapes = {
            "": dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False),
            "alibi": dict(new_decoder_architecture=True, num_kv_heads=2, alibi=True),
            "7b": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=False),
        }[variant]
        return FalconConfig(num_hidden_layers=num_layers, **shapes, **common)
    if family in ("mistral", "qwen2"):  # the families newer than the pinned transformers: dist_eval's classes
        from dist_eval.backends.blocks import register

        register()
        return _families_config(family, intermediate_size=64, num_hidden_layers=num_layers, num_key_value_heads=2,
                                    max_position_embeddings=128, **common)
    if family in ("qwen3", "qwen3_moe"):  # dist_eval's own layers: a head size apart, q/k norms; experts
        from dist_eval.backends.blocks import register

        register()
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                       decoder_sparse_step=2) if family == "qwen3_moe" else {}
        return _families_config(family, intermediate_size=64, num_hidden_layers=num_layers, num_key_value_heads=2,
                                    head_dim=16, max_position_embeddings=128, **experts, **common)
    if family == "glm4_moe":  # GLM-4.5-Air-style (no q/k norm); the reference's has them
        from dist_eval.backends.blocks import register

        register()
        return _families_config(
            family, intermediate_size=64, num_hidden_layers=num_layers, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128, attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16, n_group=2,
            topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, **common)
    if family in ("mixtral", "minimax_m2"):  # MiniMax-M2: Mixtral's names, whole-width q/k norms, a sigmoid router
        from dist_eval.backends.blocks import register

        register()
        return _families_config(family, intermediate_size=64, num_hidden_layers=num_layers, num_key_value_heads=2,
                                    head_dim=16, max_position_embeddings=128, num_local_experts=4,
                                    num_experts_per_tok=2, **common)
    # the latent attention with yarn RoPE; block 0 dense, then experts; GLM-5, DeepSeek-V3.2: an indexer per block
    # keeping 4 keys per query
    if family in ("deepseek_v3", "kimi_k2", "kimi_k25", "glm_moe_dsa", "deepseek_v32"):
        from dist_eval.backends.blocks import register

        register()
        sparse = family in ("glm_moe_dsa", "deepseek_v32")
        indexer = dict(index_topk=4, index_head_dim=8, index_n_heads=2) if sparse else {}
        return _families_config(
            family, **indexer, intermediate_size=64, num_hidden_layers=num_layers, num_key_value_heads=4,
            q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
            max_position_embeddings=128,
            rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 32}, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1, first_k_dense_replace=1,
            **common)
    if family == "deepseek_v4":  # each attention kind in turn (a window of 4, entries every 2 / 4 positions),
        from dist_eval.backends.blocks import register

        register()
        kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
        return _families_config(
            family, num_hidden_layers=num_layers, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.25,
            layer_types=[kinds[i % 3] for i in range(num_layers)], mlp_layer_types=["hash_moe"] + ["moe"] * (
                num_layers - 1), compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            sliding_window=4, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=2,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=128,
            **common)
    if family == "gpt_oss":  # sinks, a window of 4 on blocks 0 and 2, biases; every block 4 clamped experts, 2 a token
        from dist_eval.backends.blocks import register

        register()
        return _families_config(family, intermediate_size=16, num_hidden_layers=num_layers, num_key_value_heads=2,
                                    head_dim=16, max_position_embeddings=128, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4, attention_bias=True, **common)
    if family == "llama4_text":  # dense and MoE blocks alternate, the 4th block without RoPE
        from dist_eval.backends.blocks import register

        register()
        return _families_config(
            family, intermediate_size=16, intermediate_size_mlp=64, num_hidden_layers=num_layers, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2,
            interleave_moe_layer_step=2, **common)
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # Gated DeltaNet and (every 4th) gated attention; experts
        from dist_eval.backends.blocks import register

        register()
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24) if family in ("qwen3_5_moe", "qwen3_next") else {}
        return _families_config(
            family, intermediate_size=64, num_hidden_layers=num_layers, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, **experts, **common)
    raise ValueError(f"family={family!r}")


def build_checkpoint(
    path: str, hidden: int = 32, num_labels: int = 3, tuning_mode="ptune", pre_seq_len=3, num_layers=4, seed=1
) -> str:
    from dist_eval.backends.checkpoint import save_checkpoint

    g = torch.Generator().manual_seed(seed)
    tensors = {"score.weight": torch.randn(num_labels, hidden, generator=g)}
    if tuning_mode:
        tensors["prompt_embeddings.weight"] = torch.randn(pre_seq_len, hidden, generator=g)
    if tuning_mode == "deep_ptune":
        tensors["intermediate_prompt_embeddings.weight"] = 0.1 * torch.randn(
            pre_seq_len, num_layers * hidden, generator=g
        )
    save_checkpoint(path, tuning_mode, tensors)
    return path


def write_csv(path: str, num_rows: int, num_labels: int = 3, seed: int = 0, max_words: int = 20) -> str:
    """Rows of 1..max_words random words and integer labels (label 2 rare, for class imbalance)."""
    r = random.Random(seed)
    with open(path, "w") as f:
        f.write("text,label\n")
        for _ in range(num_rows):
            text = " ".join(r.choice(WORDS) for _ in range(r.randint(1, max_words)))
            f.write(f"{text},{r.choice([0, 0, 1, 1, 2][: max(2, num_labels + 2)]) % num_labels}\n")
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "ptune.pt"))


def one_thread_swarm(model, **kwargs):
    """A started LocalSwarm whose servers compute with one thread, stopped afterwards (a
    generator for a fixture).

    The local reference runs with one thread (run_cli sets OMP_NUM_THREADS=1); the servers
    must too: a CPU matmul's summation order, so its last bits, depends on the thread
    count, and tests compare logits bit for bit.
    """
    from unittest import mock

    from dist_eval.swarm import LocalSwarm

    swarm = LocalSwarm(model, **kwargs)
    try:
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
            swarm.start()
        yield swarm
    finally:
        swarm.stop()


class _LentForks:
    """A started swarm's fork server (dist_eval/swarm/forks.py), lent to other swarms' starts: closed at its
    own swarm's stop only."""

    def __init__(self, forks):
        self._forks = forks

    def __getattr__(self, name):
        return getattr(self._forks, name)

    def close(self, timeout: float = 2.0) -> None:
        pass


@contextlib.contextmanager
def forking_from(swarm):
    """The LocalSwarms started inside fork their servers from ``swarm``'s fork server (a started swarm of
    several servers): the imports of a server (~4.5 s of CPU) once, not once per swarm. Each server so
    started is its own process, session and p2pd, as any forked server, with the fork server's environment
    (``swarm``'s at its start: set there what they must read, e.g. OMP_NUM_THREADS); a command it cannot
    serve (another module) starts as a process of its own. Stop them before ``swarm``."""
    from unittest import mock

    lent = _LentForks(swarm._launch.forks)
    with mock.patch("dist_eval.swarm.launch.ForkServer", lambda *args, **kwargs: lent):
        yield


@pytest.fixture(scope="session")
def tiny_swarm(tiny_model):
    """Two servers of the tiny Llama, each holding every block, one thread: shared by the modules
    whose tests only send it requests (none stops or kills a server of it)."""
    yield from one_thread_swarm(tiny_model, num_servers=2, dht_prefix="dist-eval-test")


@pytest.fixture(scope="session")
def split_swarm(tiny_model, tmp_path_factory):
    """Two servers of the tiny Llama holding blocks 0:2 and 2:4 (every request crosses both, each
    for part of the model), one thread each, reporting their runtime's tasks every second in
    their logs (``swarm.log_paths``). Shared by test_backends_wire.py and
    test_swarm_merged_forward.py (issue 46; each started its own)."""
    logs = tmp_path_factory.mktemp("split-swarm-logs")
    yield from one_thread_swarm(tiny_model, num_servers=2, blocks_per_server=2, dht_prefix="split-swarm",
                                log_dir=str(logs), extra_server_args=["--stats_report_interval", "1"])


@pytest.fixture(scope="session")
def local_reference_160(tiny_model, tiny_checkpoint, tmp_path_factory):
    """(the rows file, the predictions, metrics.json) of the local backend on 160 rows (seed 7),
    batch size 2, one batch in flight: what every run of the tiny model on those rows must give,
    on a swarm (any N, a server killed or drained mid-run) as locally. Computed once, in this
    process with one thread (equal to a torchrun rank bitwise): shared by test_swarm_failover.py
    and test_swarm_supervisor.py, which each ran it under torchrun before (issue 46)."""
    from inprocess_cli import run_cli_in_process

    folder = tmp_path_factory.mktemp("reference_160")
    data = write_csv(str(folder / "rows.csv"), 160, seed=7)
    out = folder / "local"
    assert run_cli_in_process(reference_160_args(tiny_model, tiny_checkpoint, data, out, "--backend", "local")) == 0
    with open(out / "metrics.json") as f:
        metrics = json.load(f)
    return data, read_jsonl(str(out / "predictions.jsonl")), metrics


def reference_160_args(model, checkpoint, data, out, *extra):
    """The CLI's flags of :func:`local_reference_160`'s batch plan (batch size 2, in flight 1), and ``extra``."""
    return ["--model", model, "--data-files", data, "--checkpoint", checkpoint, "--output-dir", str(out),
            "--batch-size", "2", "--in-flight", "1", "--save-logits", *extra]


@contextlib.contextmanager
def converted_family_swarm(tmp_path_factory, family: str, layout: str = "causal_lm"):
    """(model folder, cache, swarm): a tiny ``family`` model saved in ``layout`` (one petals cannot
    read as it is: the swarm serves the converted copy, in ``cache``), two servers each holding half
    of the blocks, one thread (the client's summation order); stopped on leaving. A test using it
    sets DIST_EVAL_CACHE to ``cache`` (the client reads the converted copy too), not the user's."""
    from unittest import mock

    from dist_eval.swarm import LocalSwarm

    root = tmp_path_factory.mktemp(f"swarm-{family}")
    model = build_tiny_model(str(root / f"tiny-{family}"), family=family, layout=layout)
    cache = str(root / "cache")
    with mock.patch.dict(os.environ, {"DIST_EVAL_CACHE": cache}):
        swarm = LocalSwarm(model, num_servers=2)  # each server half of the blocks
    try:
        with mock.patch.dict(os.environ, {"DIST_EVAL_CACHE": cache, "OMP_NUM_THREADS": "1"}):
            swarm.start()
        yield model, cache, swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="session")
def bloom_swarm(tmp_path_factory):
    """:func:`converted_family_swarm` of a tiny BLOOM saved from BloomForCausalLM. Shared by
    test_families_swarm.py and test_backends_zeroshot_swarm.py (issue 46; each started its own)."""
    with converted_family_swarm(tmp_path_factory, "bloom") as started:
        yield started


def run_cli(args, nproc: int = 1, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc -m dist_eval args`` (or plain python for nproc=0)."""
    if nproc == 0:
        cmd = [sys.executable, "-m", "dist_eval", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            "-m",
            "dist_eval",
            *args,
        ]
    return run_in_own_group(cmd, timeout=timeout, env=run_env(env))


def run_env(env=None) -> dict:
    """The environment of :func:`run_cli`'s processes: one thread, offline, this checkout; ``env`` added."""
    # the checkout under test, not an installed copy of the package
    pythonpath = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": pythonpath, **(env or {})}


@pytest.fixture(scope="session")
def rank_zygote(tmp_path_factory):
    """This test process's fork server of ranks (tests/forked_ranks.py), for :func:`run_ranks`."""
    from forked_ranks import RankZygote

    zygote = RankZygote(run_env(), str(tmp_path_factory.mktemp("zygote")))
    try:
        yield zygote
    finally:
        zygote.stop()


def run_ranks(zygote, args, nproc: int, timeout: float = 300, env=None, script=None) -> subprocess.CompletedProcess:
    """:func:`run_cli` on ``nproc`` ranks forked from ``zygote`` (conftest's ``rank_zygote``): real
    processes in a real gloo group, the CLI's ``__main__`` (or ``script``, with ``args``), torchrun's
    environment, without each rank's and the launcher's imports (tests/forked_ranks.py says what
    differs from torchrun: not for a test of the launch). ``rank_codes``: each rank's exit code. An
    ``env`` the fork server cannot serve (a library reads it when imported): torchrun."""
    full_env = run_env(env)
    if not zygote.serves(full_env):
        if script is None:
            result = run_cli(args, nproc=nproc, timeout=timeout, env=env)
        else:
            result = run_in_own_group([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                       "--master_port", str(free_port()), script, *args], timeout=timeout, env=full_env)
        result.rank_codes = None
        return result
    argv = ["-m", "dist_eval", *args] if script is None else [script, *args]
    suite_plugin.note_launch("forked ranks: " + " ".join(argv[:2]))
    # the petals client's import (~1.4 s) once in the launcher, not in every rank
    backend = args[args.index("--backend") + 1] if "--backend" in args else "petals"
    preload = [] if backend == "local" or script else ["dist_eval.backends.petals.shims:import_petals"]
    return zygote.launch(argv, nproc, full_env, free_port(), timeout, preload)


def start_ranks(zygote, args, nproc: int, env=None):
    """:func:`run_ranks` started, not waited for: (the launch, its stdout, its stderr: text pipes
    read as the ranks write). The launch is used as a ``subprocess.Popen`` of torchrun is (``pid``
    leads its process group; ``poll``, ``wait``, ``returncode``), with the ranks' ``pids`` in rank
    order. ``nproc`` 0: one process without torchrun's environment (a plain ``python -m dist_eval``).
    An ``env`` the fork server cannot serve: torchrun (or python), a Popen (``pids`` then None)."""
    full_env = run_env(env)
    if not zygote.serves(full_env):
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                    str(free_port())] if nproc else []
        proc = subprocess.Popen([sys.executable, *launcher, "-m", "dist_eval", *args], cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, start_new_session=True)
        proc.pids = None
        return proc, proc.stdout, proc.stderr
    suite_plugin.note_launch("forked ranks: -m dist_eval" if nproc else "forked process: -m dist_eval")
    backend = args[args.index("--backend") + 1] if "--backend" in args else "petals"
    preload = [] if backend == "local" else ["dist_eval.backends.petals.shims:import_petals"]
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    try:
        launch = zygote.start(zygote.request(["-m", "dist_eval", *args], nproc, full_env, free_port(), preload),
                              out_w, err_w)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return launch, os.fdopen(out_r, "r", errors="replace"), os.fdopen(err_r, "r", errors="replace")


@pytest.fixture(scope="session")
def no_figures(tmp_path_factory) -> dict:
    """The env (PYTHONPATH) of a CLI subprocess whose figures nobody looks at: matplotlib hidden,
    as run_cli_in_process's ``hide_modules=("matplotlib",)`` does in this process (the figures are
    the same function of the same metrics, and most of a small run's report: ~2 s of each run)."""
    from inprocess_cli import without_modules

    hidden = without_modules(tmp_path_factory.mktemp("no_figures"), "matplotlib")
    return {"PYTHONPATH": os.pathsep.join(p for p in (hidden, REPO, os.environ.get("PYTHONPATH")) if p)}


# launch/install_reference.sh's environments: its argument -> (the variable that moves it, its folder in the repository)
REFERENCE_VENVS = {"4": ("DIST_EVAL_REFERENCE_VENV", ".venv-reference"),
                   "5": ("DIST_EVAL_REFERENCE5_VENV", ".venv-reference5"),
                   "pinned": ("DIST_EVAL_PINNED_VENV", ".venv-pinned")}


def pinned_by_reference(generation: str) -> Dict[str, str]:
    """The distributions launch/install_reference.sh pins to one version (``name==version``) for ``generation``."""
    with open(os.path.join(REPO, "launch", "install_reference.sh"), encoding="utf-8") as f:
        script = f.read()
    (case,) = re.findall(rf"^  {re.escape(generation)}\) (.*?);;", script, flags=re.M | re.S)
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', case.split("NO_DEPS")[0]))


def is_reference_here(generation: str) -> bool:
    """Whether this Python already has every version launch/install_reference.sh pins for ``generation``: the
    suite's own environment is then that reference (launch/install.sh's current stack is generation 5's), and
    its scripts run here, each in a process of its own: nothing dist_eval applies in this process reaches them
    (the reference scripts import no dist_eval; tests/reference/on_current_stack.py imports it, as it means to)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> Optional[str]:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    pins = pinned_by_reference(generation)
    return bool(pins) and all(installed(name) == wanted for name, wanted in pins.items())


def reference_python(generation: str, install: bool = True) -> str:
    """The Python of launch/install_reference.sh's environment ``generation`` (:data:`REFERENCE_VENVS`), made or
    found by the script first unless ``install`` is False (a lock makes a second caller wait for the first's); this
    one where it is that environment already (:func:`is_reference_here`), and then nothing is installed."""
    if is_reference_here(generation):
        return sys.executable
    if install:
        done = subprocess.run([os.path.join(REPO, "launch", "install_reference.sh"), generation], capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    variable, folder = REFERENCE_VENVS[generation]
    return os.path.join(os.environ.get(variable, os.path.join(REPO, folder)), "bin", "python")


def stack_python(stack: str) -> str:
    """The Python of ``stack``: "pinned" (the transformers petals 2.2 pins, < 4.35, where stock petals servers run)
    or "current" (transformers 5.x: :func:`reference_python`'s generation 5): this one where it is of that stack,
    else the environment launch/install_reference.sh makes for it (.venv-pinned, .venv-reference5; a lock makes a
    second caller wait for the first's install)."""
    if stack == "current":
        return reference_python("5")
    import transformers
    from packaging.version import Version

    return sys.executable if Version(transformers.__version__) < Version("4.35") else reference_python("pinned")


def on_pinned_stack(script: str, tmp_path) -> dict:
    """What ``script`` computes with transformers 4.33 (the stack petals 2.2 pins: :func:`stack_python`): run there
    with ``OUT`` (a path) bound, it saves a dict of tensors to it with torch.save; that dict, read here."""
    out = str(tmp_path / "pinned.pt")
    done = subprocess.run([stack_python("pinned"), "-c", f"OUT = {out!r}\n" + script], capture_output=True,
                          text=True, timeout=300, env=run_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def run_in_own_group(cmd, timeout: float, env=None) -> subprocess.CompletedProcess:
    """subprocess.run in a new process group; on timeout the whole group (torchrun, its
    workers, their DHT and p2pd children) is stopped, not only the top process."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    finally:
        stop_group(proc.pid, grace=5.0)  # nothing of the run may outlive it
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM the process group, SIGKILL whatever is left after ``grace`` seconds."""
    import signal
    import time

    def alive():
        return [p for p in all_pids() if _pgid(p) == pgid and _state(p) != "Z"]

    if not alive():
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode("utf-8", "replace").rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def transformers_said():
    """Within: the messages transformers' loggers emit (a list, filled as they come), at its default level
    (WARNING), whatever an earlier test set; the caller's own logging as it was after."""
    import logging

    from transformers.utils import logging as hf_logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    keep, verbosity = Keep(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logging.getLogger("transformers").addHandler(keep)
    try:
        yield seen
    finally:
        logging.getLogger("transformers").removeHandler(keep)
        hf_logging.set_verbosity(verbosity)


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (32768 on): a port the kernel handed
    out (port 0) is handed out again to the next socket that asks, e.g. a p2pd's, before torchrun
    binds it (seen: EADDRINUSE at rendezvous in a loaded run); one drawn here is taken only by a
    test that draws the same one."""
    import socket

    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32767")


def eval_args(model, inputs, out, *extra):
    """The CLI's flags for ``model`` on ``inputs`` = (checkpoint, data file), writing to ``out``."""
    checkpoint, data = inputs
    return ["--model", model, "--checkpoint", checkpoint, "--data-files", data, "--batch-size", "8",
            "--save-logits", "--output-dir", str(out), *extra]


def outputs(folder):
    """(predictions.jsonl text, metrics.json without its ``run`` section, ``run``) of a run's folder."""
    with open(os.path.join(folder, "predictions.jsonl")) as f:
        predictions = f.read()
    with open(os.path.join(folder, "metrics.json")) as f:
        metrics = json.load(f)
    return predictions, {k: v for k, v in metrics.items() if k != "run"}, metrics["run"]


def read_jsonl(path: str):
    import json

    with open(path) as f:
        return [json.loads(line) for line in f]


def processes_in_group_of(pids):
    """pids (from /proc) whose process group is one of ``pids``'s groups."""
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    return [p for p in all_pids() if _pgid(p) in groups]


def all_pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _child_commands(pid: int) -> dict:
    """{child pid: its command line} of the direct children of ``pid``."""
    out = {}
    for child in all_pids():
        try:
            with open(f"/proc/{child}/stat", "rb") as f:
                if int(f.read().rpartition(b")")[2].split()[1]) != pid:
                    continue
            with open(f"/proc/{child}/cmdline", "rb") as f:
                out[child] = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except (OSError, ValueError, IndexError):
            continue
    return out


def swarm_servers_of(pid: int) -> dict:
    """{server pid: its fork server's pid, or None}: the servers of the local swarm that process ``pid``
    started, each leading its own process group: its children running dist_eval.swarm.server, or, where
    one of them is the swarm's fork server (dist_eval/swarm/forks.py, a swarm of several servers), the
    servers forked from it."""
    out = {}
    for child, cmd in _child_commands(pid).items():
        if "dist_eval.swarm.server" not in cmd:
            continue
        if "--dist_eval_fork_server" not in cmd:
            out[child] = None
            continue
        for server, server_cmd in _child_commands(child).items():
            if "dist_eval.swarm.server" in server_cmd and _pgid(server) == server:
                out[server] = child
    return out


def swarm_server_pids():
    """Live processes running dist_eval's swarm server entry point, started from this test
    process: those whose environment holds this process's ``DIST_EVAL_TEST_PROCESS`` (set above,
    inherited also once orphaned), not another xdist worker's nor another pytest run's on the
    same machine (two ``-n 0`` runs side by side too)."""
    mine = f"DIST_EVAL_TEST_PROCESS={os.environ['DIST_EVAL_TEST_PROCESS']}".encode()
    out = []
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if b"dist_eval.swarm.server" not in cmd:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if mine in environ:
            out.append(pid)
    return out


_DEMO_WORKER = """
import json, sys
from dataclasses import asdict
from dist_eval.demo import demo_assets
assets = demo_assets(sys.argv[1], log=lambda line: print("LOG", line, flush=True))
print("ASSETS", json.dumps(asdict(assets)), flush=True)
"""


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory):
    """The built-in demo assets, built for real once per test run, by two processes
    calling ``demo_assets`` on the same empty cache at once (as two torchrun ranks do):
    (cache, each process's stdout, the DemoAssets each returned).

    Under pytest-xdist the workers share one build: the first to get the lock builds it in
    the run's common temp folder and records what the builders said; the others read that.
    """
    from dist_eval.demo import DemoAssets

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, common to its workers (each has its own below it)
    record = root / "demo_build.json"
    with open(root / "demo_build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not record.exists():
            cache = root / "demo_cache"
            cache.mkdir()
            record.write_text(json.dumps({"cache": str(cache), "outputs": _build_demo(str(cache))}))
    built = json.loads(record.read_text())
    returned = []
    for out in built["outputs"]:
        line = [line for line in out.splitlines() if line.startswith("ASSETS ")][-1]
        fields = json.loads(line[len("ASSETS ") :])
        fields["label_names"] = tuple(fields["label_names"])
        returned.append(DemoAssets(**fields))
    return built["cache"], built["outputs"], returned


def _build_demo(cache: str) -> list:
    """The stdout of two processes calling ``demo_assets(cache)`` at once."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DEMO_WORKER, cache],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"demo_assets failed:\n{out}\n{err[-3000:]}"
            outputs.append(out)
    finally:
        for proc in procs:
            stop_group(proc.pid)
    return outputs


@pytest.fixture(scope="session")
def demo_cache(demo_build) -> str:
    """The cache folder holding the built-in demo assets (built once per session)."""
    return demo_build[0]


def read_stdout_line(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line of ``proc`` (a Popen with stdout=PIPE), or what came before it
    exits or ``timeout`` seconds pass."""
    return read_pipe_until(proc.stdout, lambda buf: b"\n" in buf, timeout, proc)


def read_pipe_until(stream, done, timeout: float, proc: Optional[subprocess.Popen] = None) -> str:
    """What ``stream`` (a pipe) gives until ``done(bytes so far)``, the pipe closes, ``proc``
    (if given) exits with nothing more to read, or ``timeout`` seconds pass."""
    import selectors
    import time

    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    buf, end = b"", time.monotonic() + timeout
    try:
        while not done(buf) and time.monotonic() < end:
            if not sel.select(timeout=0.5):
                if proc is not None and proc.poll() is not None:
                    break
                continue
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
    finally:
        sel.close()
    return buf.decode()
