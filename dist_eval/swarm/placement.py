"""Where a local swarm's servers go: block ranges, and the checks of a swarm's arguments.

Standard library only.
"""
from __future__ import annotations

import errno
import ipaddress
import json
import os
import re
import socket
from typing import List, Optional, Sequence, Tuple


class SwarmError(Exception):
    """The local swarm could not be started (or was misconfigured). The message is one
    line: what failed, what to do, and the tail of the failing server's log.
    """


# a peer to join: what the INITIAL_PEERS= line of a running swarm (or petals) prints
_PEER_RE = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/[^/\s]+/tcp/\d{1,5}/p2p/[1-9A-HJ-NP-Za-km-z]+$")


def _split(num_blocks: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous, near-equal ranges covering [0, num_blocks)."""
    return [(p * num_blocks // parts, (p + 1) * num_blocks // parts) for p in range(parts)]


def plan_blocks(num_blocks: int, num_servers: int, blocks_per_server: Optional[int] = None) -> List[Tuple[int, int]]:
    """Block range ``(start, end)`` (end exclusive) of each server.

    Default: one server serves everything. With two or more servers, every block is
    served by **two** servers, so that one server can fail without a block going
    missing: the servers form two layers, the first ``ceil(K/2)`` servers split the
    blocks into contiguous near-equal ranges, and so do the other ``floor(K/2)``
    (with more servers in a layer than blocks, ranges repeat). Each server then holds
    about ``2 * num_blocks / K`` blocks (twice the memory of a plain split; pass
    ``blocks_per_server=ceil(num_blocks / K)`` to give that up). For K=2 both servers
    serve every block; for K=3 and 4 blocks: 0:2, 2:4, 0:4; for K=4: 0:2, 2:4, 0:2, 2:4.

    ``blocks_per_server=B``: every server serves B contiguous blocks, the ranges evenly
    spread from block 0 to the last block (overlapping where K*B > num_blocks).
    SwarmError if they cannot cover every block (K*B < num_blocks).
    """
    if num_blocks < 1 or num_servers < 1:
        raise SwarmError(f"cannot place {num_blocks} block(s) on {num_servers} server(s).")
    if blocks_per_server is not None:
        if blocks_per_server < 1:
            raise SwarmError(f"blocks_per_server={blocks_per_server}: expected a positive number of blocks.")
        size = min(blocks_per_server, num_blocks)
        if size * num_servers < num_blocks:
            raise SwarmError(
                f"blocks_per_server={blocks_per_server} x {num_servers} server(s) cannot cover the model's "
                f"{num_blocks} blocks: use at least {-(-num_blocks // num_servers)} blocks per server or more servers."
            )
        if num_servers == 1:
            return [(0, size)]
        span = num_blocks - size
        starts = [(i * span + (num_servers - 1) // 2) // (num_servers - 1) for i in range(num_servers)]
        return [(s, s + size) for s in starts]
    if num_servers == 1:
        return [(0, num_blocks)]
    plan: List[Tuple[int, int]] = []
    for layer_size in ((num_servers + 1) // 2, num_servers // 2):
        ranges = _split(num_blocks, min(layer_size, num_blocks))
        plan.extend(ranges[i % len(ranges)] for i in range(layer_size))
    return plan


def check_host(host: str) -> str:
    """``host`` if it is an IPv4 address servers can listen on *and* announce, else SwarmError."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise SwarmError(
            f"host={host!r}: expected an IPv4 address of this machine that the clients can reach "
            "(e.g. 10.0.0.5; `hostname -I` lists them), or 127.0.0.1 for a swarm on this machine only."
        ) from None
    if address.is_unspecified:
        # petals announces the address it listens on: 0.0.0.0 would be announced as-is
        raise SwarmError(
            f"host={host!r}: servers announce the address they listen on, and {host} is nobody's address; "
            "pass this machine's IP that the clients can reach (e.g. 10.0.0.5; `hostname -I` lists them)."
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise SwarmError(
                    f"host={host!r}: not an address of this machine; pass one of its own IPs "
                    "(`hostname -I` lists them), the one the clients can reach."
                ) from None
            raise
    return host


def check_peers(peers: Sequence[str]) -> List[str]:
    """``peers`` as strings, each a multiaddr to join (else SwarmError)."""
    peers = [str(p) for p in peers]
    for p in peers:
        if not _PEER_RE.match(p):
            raise SwarmError(
                f"initial peer {p!r}: expected a multiaddr like /ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... "
                "(a running swarm prints them on its INITIAL_PEERS=... line)."
            )
    return peers


def check_block_range(block_range, num_blocks: int) -> Tuple[int, int]:
    """``block_range`` as ``(A, B)`` with 0 <= A < B <= ``num_blocks`` (else SwarmError)."""
    try:
        start, end = (int(x) for x in block_range)
    except (TypeError, ValueError):
        start, end = -1, -1
    if not 0 <= start < end <= num_blocks:
        shown = ":".join(map(str, block_range)) if isinstance(block_range, (tuple, list)) else repr(block_range)
        raise SwarmError(
            f"block range {shown}: expected A:B (end exclusive) with 0 <= A < B <= {num_blocks}, "
            f"the model's number of blocks; e.g. 0:{num_blocks} for all of them."
        )
    return start, end


def read_num_blocks(model_dir: str) -> int:
    """The model's number of blocks, from ``model_dir``'s config.json (else SwarmError)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise SwarmError(f"{model_dir}: no config.json in the folder. Pass a folder saved with save_pretrained().")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise SwarmError(f"{path}: not readable as JSON ({e}).") from None
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):  # a vision-language release
        config = config["text_config"]
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and value >= 1:
            return value
    raise SwarmError(f"{path}: no positive num_hidden_layers; is this a transformer model petals can serve?")


def default_prefix(model_dir: str) -> str:
    """The DHT prefix of a swarm of ``model_dir`` when none is given: ``dist_eval-<folder name>``."""
    base = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    return "dist_eval-" + (re.sub(r"[^A-Za-z0-9_-]", "_", base) or "model")


def block_parameters(config: dict) -> List[int]:
    """The number of weights of each block of a model, from its config.json (a dict) alone: the
    shapes of the block dist_eval computes for its family (attention, latent attention, dense MLP
    or mixture of experts by the family's rule, norms), no weights read. A multimodal config's
    ``text_config`` is the text model's. What a server loading the block holds, in values.
    """
    config = dict(config.get("text_config") or config)
    if config.get("model_type") in ("bloom", "falcon"):
        raise SwarmError(f"config.json: the blocks of model_type {config['model_type']!r} are not counted here "
                         "(every block of theirs is the same size)")
    count = _config_int(config, "num_hidden_layers", "n_layer", "num_layers")
    if config.get("model_type") == "deepseek_v4":
        return [_hyper_connected_parameters(config, i) for i in range(count)]
    return [_mixer_parameters(config, i) + _mlp_parameters(config, i) + 2 * config["hidden_size"]
            for i in range(count)]


def _hyper_connected_parameters(config: dict, index: int) -> int:
    """The values of DeepSeek-V4's block ``index`` (dist_eval.backends.layers.HyperConnectedLayer): its attention
    (q latent and its norm, the shared key = value and its norm, the grouped output, sinks), its compressor and
    indexer by its kind, its mixture (router and its correction bias or, hash-routed, tid2eid; experts and the
    shared one), two norms and two hyper-connections; a key config.json leaves out has transformers 5.x's default.
    """
    from types import SimpleNamespace

    from dist_eval.backends.families import FAMILIES, v4_compress_rate, v4_layer_types, v4_mlp_types

    read = SimpleNamespace(**{**dict(FAMILIES["deepseek_v4"].block_options), **config})
    hidden, heads, head_dim, rank = read.hidden_size, read.num_attention_heads, read.head_dim, read.q_lora_rank
    groups, out_rank = read.o_groups, read.o_lora_rank
    attention = (hidden * rank + rank + rank * heads * head_dim + hidden * head_dim + head_dim
                 + heads * head_dim * out_rank + groups * out_rank * hidden + heads)
    kind = v4_layer_types(read)[index]
    if kind != "sliding_attention":
        rate, sparse = v4_compress_rate(read, kind), kind == "compressed_sparse_attention"
        width = 2 * head_dim if sparse else head_dim
        attention += 2 * hidden * width + rate * width + head_dim
        if sparse:  # the indexer: wq_b, weights_proj, its own compressor of 2 x index_head_dim
            index_heads, index_dim = read.index_n_heads, read.index_head_dim
            attention += (rank * index_heads * index_dim + hidden * index_heads + 4 * hidden * index_dim
                          + rate * 2 * index_dim + index_dim)
    experts, inner = read.n_routed_experts, read.moe_intermediate_size
    routing = read.vocab_size * read.num_experts_per_tok if v4_mlp_types(read)[index] == "hash_moe" else experts
    mixture = experts * hidden + routing + (experts + 1) * 3 * hidden * inner
    streams = read.hc_mult
    hyper = 2 * ((2 + streams) * streams * (streams * hidden + 1) + 3)
    return attention + mixture + 2 * hidden + hyper


# Gated DeltaNet and full attention; HYBRID_MIXTURES: a mixture with a gated shared expert (in every block, but
# by decoder_sparse_step and mlp_only_layers in a qwen3_next config)
HYBRID_MIXTURES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
HYBRIDS = ("qwen3_5", "qwen3_5_text") + HYBRID_MIXTURES


def _mixer_parameters(config: dict, index: int) -> int:
    """The weights of block ``index``'s attention: a hybrid's Gated DeltaNet or gated full attention by
    its layer_types (else every full_attention_interval-th full), another family's attention.
    """
    if config.get("model_type") not in HYBRIDS:
        return _attention_parameters(config) + _indexer_parameters(config, index)
    types = config.get("layer_types")
    interval = config.get("full_attention_interval", 4)
    kind = types[index] if types else ("full_attention" if (index + 1) % interval == 0 else "linear_attention")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if kind == "full_attention":  # q twice as wide (the output gate), q/k norms
        head_dim, kv_heads = config.get("head_dim", 256), config.get("num_key_value_heads") or heads
        bias = (3 * heads + 2 * kv_heads) * head_dim + hidden if config.get("attention_bias") else 0
        return 3 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim + bias
    keys = config.get("linear_num_key_heads", 16) * config.get("linear_key_head_dim", 128)
    value_heads = config.get("linear_num_value_heads", 32)
    values = value_heads * config.get("linear_value_head_dim", 128)
    conv = 2 * keys + values
    # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, the depthwise conv, dt_bias and A_log, the norm, out_proj
    return (hidden * conv + hidden * values + 2 * hidden * value_heads + conv * config.get("linear_conv_kernel_dim", 4)
            + 2 * value_heads + config.get("linear_value_head_dim", 128) + values * hidden)


# sparse attention (the latent attention and an indexer per block, where the block has its own): (index_n_heads,
# index_head_dim) by default, transformers 5.x's; GLM-5's blocks of indexer_types shared have no indexer
SPARSE_ATTENTION = {"glm_moe_dsa": (32, 128), "deepseek_v32": (64, 128)}


def _indexer_parameters(config: dict, index: int) -> int:
    """The weights of block ``index``'s indexer: wq_b from the query latent, wk, its key LayerNorm and weights_proj."""
    from dist_eval.backends.families import indexer_types

    kind = config.get("model_type")
    if kind not in SPARSE_ATTENTION or indexer_types(config, kind == "glm_moe_dsa")[index] != "full":
        return 0
    hidden, (heads, head_dim) = config["hidden_size"], SPARSE_ATTENTION[kind]
    heads, head_dim = config.get("index_n_heads", heads), config.get("index_head_dim", head_dim)
    return config["q_lora_rank"] * heads * head_dim + hidden * head_dim + 2 * head_dim + hidden * heads


def _config_int(config: dict, *keys: str) -> int:
    for key in keys:
        if isinstance(config.get(key), int) and config[key] >= 1:
            return config[key]
    raise SwarmError(f"config.json: no positive {' or '.join(keys)}; is this a transformer model?")


def _attention_parameters(config: dict) -> int:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("kv_lora_rank"):  # DeepSeek-V3's latent attention
        q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
        nope, rope, value = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        query = hidden * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        return query + hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + value) + heads * value * hidden
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    inner, kv_inner = heads * head_dim, kv_heads * head_dim
    if config.get("model_type") == "gpt_oss":  # biases on q, k, v and o (unless config.json says none), sinks
        biases = inner + 2 * kv_inner + hidden if config.get("attention_bias", True) else 0
        return 2 * hidden * inner + 2 * hidden * kv_inner + biases + heads
    total = 2 * hidden * inner + 2 * hidden * kv_inner
    if config.get("attention_bias"):  # q, k, v (and o but in GLM-4.5)
        total += inner + 2 * kv_inner + (hidden if config.get("model_type") != "glm4_moe" else 0)
    elif config.get("model_type") == "qwen2":  # q, k and v always
        total += inner + 2 * kv_inner
    if config.get("model_type") == "minimax_m2":  # q/k norms over every head at once
        return total + inner + kv_inner
    norms = config.get("model_type") in ("qwen3", "qwen3_moe") or (
        config.get("model_type") == "glm4_moe" and config.get("use_qk_norm"))
    return total + (2 * head_dim if norms else 0)


def _mlp_parameters(config: dict, index: int) -> int:
    hidden, kind = config["hidden_size"], config.get("model_type")

    def gated(inner: int) -> int:
        return 3 * hidden * inner

    if kind == "mixtral":
        return config["num_local_experts"] * (gated(config["intermediate_size"]) + hidden)
    if kind == "gpt_oss":  # fused experts with biases (gate and up 2 x intermediate), a router with a bias
        experts, inner = config.get("num_local_experts", 128), config.get("intermediate_size", 2880)
        return experts * (gated(inner) + 2 * inner + hidden) + experts * (hidden + 1)
    if kind == "minimax_m2":  # and a correction bias per expert
        return config.get("num_local_experts", 256) * (gated(config.get("intermediate_size", 1536)) + hidden + 1)
    if kind in ("llama4_text", "llama4"):
        step = config.get("interleave_moe_layer_step", 1)
        moe_layers = config.get("moe_layers")
        moe_layers = moe_layers if moe_layers is not None else range(step - 1, config["num_hidden_layers"], step)
        if index not in moe_layers:
            return gated(config.get("intermediate_size_mlp", 16384))
        experts = config.get("num_local_experts", 16)
        return experts * (gated(config["intermediate_size"]) + hidden) + gated(config["intermediate_size"])
    layer_types = config.get("mlp_layer_types")  # transformers 5.x's, where config.json gives it (GLM-5)
    if config.get("n_routed_experts") and (layer_types[index] == "sparse" if layer_types else
                                           index >= config.get("first_k_dense_replace", 0)):
        experts, inner = config["n_routed_experts"], config["moe_intermediate_size"]
        return experts * (gated(inner) + hidden + 1) + gated(inner * config.get("n_shared_experts", 1))
    sparse = index not in (config.get("mlp_only_layers") or ()) and (
        (index + 1) % config.get("decoder_sparse_step", 1) == 0)
    if config.get("num_experts") and kind in HYBRID_MIXTURES and (sparse or kind != "qwen3_next"):
        shared = config.get("shared_expert_intermediate_size", 512)  # a gated shared expert
        return config["num_experts"] * (gated(config.get("moe_intermediate_size", 512)) + hidden) + gated(
            shared) + hidden
    if config.get("num_experts") and kind == "qwen3_moe" and sparse:
        return config["num_experts"] * (gated(config["moe_intermediate_size"]) + hidden)
    return gated(config["intermediate_size"])


def plan_by_size(block_bytes: Sequence[int], budgets: Sequence[int]) -> List[Tuple[int, int]]:
    """Contiguous block ranges, one per server in order: each takes as many of the next blocks as fit
    in its ``budgets`` bytes by each block's own size (``block_bytes``: a mixture-of-experts block
    weighs many dense ones), the last range ending at the last block. SwarmError, naming the block,
    when one does not fit a server's budget or the servers cannot hold every block.
    """
    gib, ranges, start = 2**30, [], 0
    for server, budget in enumerate(budgets):
        end, used = start, 0
        while end < len(block_bytes) and used + block_bytes[end] <= budget:
            used, end = used + block_bytes[end], end + 1
        if end == start and start < len(block_bytes):
            raise SwarmError(f"block {start} ({block_bytes[start] / gib:.1f} GiB) does not fit server {server}'s "
                             f"share ({budget / gib:.1f} GiB): give the servers more memory or fewer blocks each")
        ranges.append((start, end))
        start = end
        if start == len(block_bytes):
            break
    if start < len(block_bytes):
        rest = sum(block_bytes[start:])
        raise SwarmError(f"{len(budgets)} server(s) hold blocks 0:{start}; blocks {start}:{len(block_bytes)} "
                         f"({rest / gib:.1f} GiB) fit none: start more servers")
    return ranges
