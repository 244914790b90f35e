"""Big blocks placed by their size (issue 48): each block's weights counted from config.json alone
(dist_eval.swarm.placement.block_parameters) equal the blocks dist_eval builds, tensor for tensor,
for every family it counts; on the published configs' shapes (no weights) they give the figures of
a block in bf16 that decide placement (a DeepSeek-V3 mixture-of-experts block 23 GB, its dense
prefix blocks 1.2 GB); servers take as many blocks as fit their share by those sizes
(plan_by_size); `swarm status --model` shows each server's share. Fast: no processes."""
import json

import pytest

from dist_eval.backends.families import FAMILIES
from dist_eval.swarm.placement import SwarmError, block_parameters, plan_by_size
from dist_eval.swarm.status import add_sizes, render

GB = 10**9
# the published configs' shapes (the keys block_parameters reads; hub config.json files hold them)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                   num_hidden_layers=61, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                   n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
KIMI_K2 = dict(DEEPSEEK_V3, model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64,
               n_routed_experts=384, first_k_dense_replace=1)
LLAMA4_MAVERICK = {"model_type": "llama4", "text_config": dict(
    model_type="llama4_text", hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
    num_hidden_layers=48, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=128,
    interleave_moe_layer_step=2)}
GLM_45 = dict(model_type="glm4_moe", hidden_size=5120, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
              num_hidden_layers=92, intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
              n_shared_experts=1, first_k_dense_replace=3, attention_bias=True, use_qk_norm=True)
QWEN3_235B = dict(model_type="qwen3_moe", hidden_size=4096, num_attention_heads=64, num_key_value_heads=4,
                  head_dim=128, num_hidden_layers=94, intermediate_size=12288, moe_intermediate_size=1536,
                  num_experts=128, decoder_sparse_step=1, mlp_only_layers=[])
# Qwen3.5-27B as released: a vision-language config.json, the text model's config nested; 48 Gated DeltaNet
# blocks and 16 gated full-attention ones (3:1)
QWEN3_5_27B = {"model_type": "qwen3_5", "vision_config": {"depth": 27, "hidden_size": 1152}, "text_config": dict(
    model_type="qwen3_5_text", hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    num_hidden_layers=64, intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16)}
# Qwen3.5-397B-A17B: the same hybrid, every block a mixture of 512 experts (10 per token) and a gated shared expert
QWEN3_5_397B = {"model_type": "qwen3_5_moe", "text_config": dict(
    model_type="qwen3_5_moe_text", hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
    num_hidden_layers=60, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 15)}
# Qwen3-Next-80B-A3B (a flat config): Qwen3.5-MoE's hybrid, 512 experts (10 per token) and a gated shared expert
QWEN3_NEXT_80B = dict(
    model_type="qwen3_next", hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    num_hidden_layers=48, intermediate_size=5120, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
    num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1,
    mlp_only_layers=[], full_attention_interval=4, vocab_size=151936)
MIXTRAL_8X22B = dict(model_type="mixtral", hidden_size=6144, num_attention_heads=48, num_key_value_heads=8,
                     num_hidden_layers=56, intermediate_size=16384, num_local_experts=8)


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - {"bloom", "falcon"}))
def test_the_count_from_config_json_is_the_blocks_dist_eval_builds(name):
    """Every block of a tiny model of the family (dense and mixture blocks, by index) holds exactly
    as many weights as block_parameters counts from its config alone."""
    from conftest import _tiny_config

    from dist_eval.backends.blocks import family_class

    config = _tiny_config(name, 64, 4)
    model = family_class(FAMILIES[name].local_class, in_petals=False)(config)
    built = [sum(t.numel() for t in layer.state_dict().values()) for layer in model.model.layers]
    assert block_parameters(config.to_dict()) == built
    assert len(set(built)) > 1 or name not in ("deepseek_v3", "kimi_k2", "glm4_moe", "qwen3_moe", "llama4_text",
                                               "qwen3_5")


def test_real_configs_give_the_published_block_sizes():
    """One block in bf16 from the published shapes (no weights): the figures that decide placement."""
    bf16 = {name: [2 * n for n in block_parameters(config)] for name, config in (
        ("deepseek_v3", DEEPSEEK_V3), ("kimi_k2", KIMI_K2), ("llama4", LLAMA4_MAVERICK), ("glm4_moe", GLM_45),
        ("qwen3_moe", QWEN3_235B), ("mixtral", MIXTRAL_8X22B))}
    deepseek = bf16["deepseek_v3"]
    assert len(deepseek) == 61 and deepseek[:3] == [deepseek[0]] * 3 and 1.1 * GB < deepseek[0] < 1.2 * GB
    assert set(deepseek[3:]) == {deepseek[3]} and 22.9 * GB < deepseek[3] < 23.1 * GB
    assert 1330 * GB < sum(deepseek) < 1345 * GB  # 671B parameters with the embeddings and the MTP layer
    assert 34.0 * GB < bf16["kimi_k2"][1] < 34.2 * GB and bf16["kimi_k2"][0] < 1.2 * GB
    maverick = bf16["llama4"]
    assert maverick[0] < 0.7 * GB and 32.5 * GB < maverick[1] < 32.7 * GB and 33.1 * GB < sum(maverick[:2]) < 33.3 * GB
    assert 7.8 * GB < bf16["glm4_moe"][3] < 7.9 * GB and bf16["glm4_moe"][2] < 1.0 * GB
    assert 4.9 * GB < bf16["qwen3_moe"][0] < 5.0 * GB and 5.0 * GB < bf16["mixtral"][0] < 5.1 * GB


def test_a_hybrids_linear_and_full_blocks_are_each_sized_by_their_own_weights(tmp_path):
    """Qwen3.5-27B's and Qwen3.5-397B-A17B's published shapes (no weights): a Gated DeltaNet block (its
    projections, conv, decay and norm) 767 MB in bf16, a gated full-attention block (q twice as wide)
    745 MB, the 64 blocks 48.7 GB (26.9B parameters with the embeddings and the head: the release's 27.8B
    holds a vision tower and a prediction layer too). Servers take blocks by each one's size: two shares
    of 24 linear blocks and 8 full ones take 32 blocks each, where counting every block at the linear
    block's size would fit 31."""
    from dist_eval.swarm.placement import read_num_blocks

    sizes = [2 * n for n in block_parameters(QWEN3_5_27B)]
    linear, full = sizes[0], sizes[3]
    assert len(sizes) == 64 and sizes[:8] == [linear] * 3 + [full] + [linear] * 3 + [full]
    assert 766 * 10**6 < linear < 767 * 10**6 and 744 * 10**6 < full < 745 * 10**6
    assert 48.7 * GB < sum(sizes) < 48.71 * GB
    share = 24 * linear + 8 * full
    assert share // linear == 31 and plan_by_size(sizes, [share, share]) == [(0, 32), (32, 64)]
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_27B))
    assert read_num_blocks(str(tmp_path)) == 64
    # Qwen3.5-397B-A17B: a linear block 13.15 GB, a full one 13.12 GB (their experts alike), 788.6 GB of blocks
    # (396.3B parameters with the embeddings and the head; the release's 397B holds a vision tower too)
    moe = [2 * n for n in block_parameters(QWEN3_5_397B)]
    assert len(moe) == 60 and moe[:4] == [moe[0]] * 3 + [moe[3]] and moe[3] < moe[0]
    assert 13.15 * GB < moe[0] < 13.16 * GB and 13.12 * GB < moe[3] < 13.13 * GB
    assert 788.6 * GB < sum(moe) < 788.7 * GB


def test_qwen3_next_blocks_are_sized_by_their_own_weights_and_qwen3_moes_rule(tmp_path):
    """Qwen3-Next-80B-A3B's published shapes (no weights): a Gated DeltaNet block 3.297 GB in bf16, a gated
    attention one 3.284 GB (their mixtures alike: 512 experts and a gated shared expert), 158.1 GB of blocks
    (79.7B parameters with the embeddings and the head: the release's 80B); a block mlp_only_layers names
    is dense (its MLP of intermediate_size: 0.130 GB)."""
    from dist_eval.swarm.placement import read_num_blocks

    sizes = [2 * n for n in block_parameters(QWEN3_NEXT_80B)]
    assert len(sizes) == 48 and sizes[:4] == [sizes[0]] * 3 + [sizes[3]] and sizes[4:8] == sizes[:4]
    assert 3.297 * GB < sizes[0] < 3.298 * GB and 3.284 * GB < sizes[3] < 3.285 * GB
    assert 158.1 * GB < sum(sizes) < 158.2 * GB
    dense = 2 * block_parameters({**QWEN3_NEXT_80B, "mlp_only_layers": [0]})[0]
    assert 0.130 * GB < dense < 0.131 * GB
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_80B))
    assert read_num_blocks(str(tmp_path)) == 48


def test_kimi_k25_blocks_are_sized_from_its_text_config_as_the_servers_hold_them(tmp_path):
    """Kimi K2.5's published shapes (no weights; the vision-language config.json, text_config of model_type
    kimi_k2): DeepSeek-V3's blocks, block 0 dense (0.995 GB in bf16), the other 60 a mixture of 384 experts of
    2048 and a shared expert (34.12 GB each: its INT4 experts are held dequantized, as the servers load them),
    2048.1 GB of blocks (1026.4B parameters with the embeddings and the head: the release's 1T); an 80 GB
    share holds block 0 and two mixtures, or two mixtures."""
    from dist_eval.swarm.placement import read_num_blocks

    text = dict(model_type="kimi_k2", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
                n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840, n_group=1, topk_group=1)
    config = dict(model_type="kimi_k25", text_config=text, vision_config=dict(hidden_size=1152))
    sizes = [2 * n for n in block_parameters(config)]
    assert len(sizes) == 61 and sizes[1:] == [sizes[1]] * 60
    assert 0.995 * GB < sizes[0] < 0.996 * GB and 34.118 * GB < sizes[1] < 34.119 * GB
    assert 2048.1 * GB < sum(sizes) < 2048.2 * GB
    assert plan_by_size(sizes, [80 * GB] * 31)[:2] == [(0, 3), (3, 5)]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_num_blocks(str(tmp_path)) == 61


def test_minimax_m2_blocks_are_sized_by_their_experts_and_whole_width_norms():
    """MiniMax-M2's published shapes (no weights; config.json's rotary_dim form): every block a mixture of
    256 experts of 1536 with a correction bias, q/k norms over the whole projection: 7.337 GB a block in
    bf16, 454.9 GB of blocks (228.7B parameters with the embeddings and the head: the release's 230B)."""
    config = dict(model_type="minimax_m2", hidden_size=3072, num_attention_heads=48, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=62, intermediate_size=1536, num_local_experts=256,
                  num_experts_per_tok=8, vocab_size=200064, rotary_dim=64)
    counts = block_parameters(config)
    assert len(counts) == 62 and counts == [counts[0]] * 62
    assert counts[0] == 256 * (3 * 3072 * 1536 + 3072 + 1) + 2 * 3072 * 48 * 128 + 2 * 3072 * 8 * 128 + (
        48 + 8) * 128 + 2 * 3072
    assert 7.337 * GB < 2 * counts[0] < 7.338 * GB and 454.9 * GB < 2 * sum(counts) < 455.0 * GB


def test_gpt_oss_blocks_are_sized_by_their_dequantized_experts_biases_and_sinks():
    """gpt-oss-120b's and gpt-oss-20b's published shapes (no weights): every block 128 (32) experts with biases
    (gate and up of 2 x 2880), a router with a bias, q/k/v/o with biases and a sink per head, sized as the
    servers hold it, its MXFP4 experts dequantized: 6.426 GB a block of the 120b in bf16, 231.3 GB of blocks
    (116.8B parameters with the embeddings and the head, the release's figure); the 20b's 20.9B."""
    config = dict(model_type="gpt_oss", hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                  num_hidden_layers=36, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4,
                  vocab_size=201088, attention_bias=True, sliding_window=128,
                  quantization_config={"quant_method": "mxfp4"})
    counts = block_parameters(config)
    assert len(counts) == 36 and counts == [counts[0]] * 36
    assert counts[0] == 128 * (3 * 2880 * 2880 + 3 * 2880) + 128 * 2881 + 2 * 2880 * 4096 + 2 * 2880 * 512 + (
        4096 + 2 * 512 + 2880) + 64 + 2 * 2880
    assert 6.426 * GB < 2 * counts[0] < 6.427 * GB and 231.3 * GB < 2 * sum(counts) < 231.4 * GB
    embeddings = 2 * 201088 * 2880 + 2880  # the table, the head and the final norm
    assert 116.8 * GB < sum(counts) + embeddings < 116.9 * GB
    small = block_parameters({**config, "num_hidden_layers": 24, "num_local_experts": 32})
    assert 20.9 * GB < sum(small) + embeddings < 21.0 * GB


def test_glm5_blocks_are_sized_by_their_indexers_and_mixtures():
    """GLM-5's published shapes (no weights): the latent attention and an indexer per block (32 heads of 128 from
    the query latent, a key of 128 and its LayerNorm, weights_proj), 3 dense blocks then mixtures of 256 experts of
    2048 and a shared expert: 0.80 GB and 19.75 GB a block in bf16, 1,484 GB of blocks (743.9B parameters with
    the embeddings and the head: the release's 744B); a block whose indexer_types says shared has no indexer."""
    config = dict(model_type="glm_moe_dsa", hidden_size=6144, num_attention_heads=64, num_key_value_heads=64,
                  num_hidden_layers=78, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                  v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32, n_routed_experts=256,
                  n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3,
                  intermediate_size=12288, vocab_size=154880, rope_parameters={"rope_theta": 1000000})
    counts = block_parameters(config)
    indexer = 2048 * 32 * 128 + 6144 * 128 + 2 * 128 + 6144 * 32
    assert len(counts) == 78 and counts[:3] == [counts[0]] * 3 and counts[3:] == [counts[3]] * 75
    assert 0.801 * GB < 2 * counts[0] < 0.802 * GB and 19.75 * GB < 2 * counts[3] < 19.76 * GB
    assert 1484.0 * GB < 2 * sum(counts) < 1484.1 * GB
    shared = block_parameters({**config, "indexer_types": ["full", "shared"] * 39})
    assert [a - b for a, b in zip(counts, shared)] == [0, indexer] * 39
    assert block_parameters({**config, "mlp_layer_types": ["sparse"] * 78})[0] == counts[3]


def test_deepseek_v32_blocks_are_deepseek_v3s_and_an_indexer_each():
    """DeepSeek-V3.2's published shapes (no weights): DeepSeek-V3's blocks and in each an indexer (64 heads of 128
    from the query latent of 1536, a key of 128 and its LayerNorm, weights_proj): 671.9B parameters with the
    embeddings and the head (the release's 685B with its multi-token-prediction layer, not counted)."""
    config = dict(DEEPSEEK_V3, model_type="deepseek_v32", index_topk=2048, index_head_dim=128, index_n_heads=64,
                  vocab_size=129280)
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    counts, v3 = block_parameters(config), block_parameters(DEEPSEEK_V3)
    assert [a - b for a, b in zip(counts, v3)] == [indexer] * 61
    assert 671.85 * GB < sum(counts) + 2 * 129280 * 7168 + 7168 < 671.9 * GB


def test_deepseek_v4_flash_blocks_from_its_published_shapes():
    """DeepSeek-V4-Flash's shapes (transformers 5.x's DeepseekV4Config defaults: hidden 4096, 43 blocks, 64 heads of
    512 sharing one key, 256 experts of 2048, 6 a token; no weights): 284.3B parameters with the embeddings, the head,
    the final norm and hc_head (the published 284B); the hash-routed blocks 0-2 hold tid2eid (a row of 6 expert ids
    per token) in place of the correction bias, a compressed sparse block a compressor twice as wide and an
    indexer."""
    config = dict(model_type="deepseek_v4", hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
                  vocab_size=129280)
    counts = block_parameters(config)  # layer_types by default: 3 heavily compressed, then sparse and heavy in turn
    assert len(counts) == 43 and counts[:3] == [counts[0]] * 3 and counts[0] - counts[4] == 129280 * 6 - 256
    indexer = 1024 * 64 * 128 + 4096 * 64 + 2 * 4096 * 2 * 128 + 4 * 2 * 128 + 128  # wq_b, weights, its compressor
    assert counts[3] - counts[4] == indexer + 2 * 4096 * 512 + 4 * 2 * 512 - 128 * 512  # and a compressor 2x as wide
    assert 284.3 * GB < sum(counts) + 2 * 129280 * 4096 + 4096 + 4 * 4 * 4096 + 4 + 1 < 284.35 * GB
    assert block_parameters({**config, "mlp_layer_types": ["moe"] * 43})[0] == counts[4]
    assert 13.16 * GB < 2 * counts[0] < 13.17 * GB  # a block in bf16


def test_servers_take_as_many_blocks_as_fit_their_share_by_each_blocks_size():
    """DeepSeek-V3 on 80 GB shares: the first server takes the three small dense blocks and three
    mixture blocks, the others three mixture blocks each; a 16 GB share holds no mixture block."""
    sizes = [2 * n for n in block_parameters(DEEPSEEK_V3)]
    plan = plan_by_size(sizes, [80 * GB] * 24)
    assert plan[0] == (0, 6) and plan[1] == (6, 9) and plan[-1][1] == 61
    assert all(sum(sizes[a:b]) <= 80 * GB for a, b in plan) and all(a < b for a, b in plan)
    assert [b for _, b in plan[:-1]] == [a for a, _ in plan[1:]]  # contiguous, every block once
    with pytest.raises(SwarmError, match=r"block 3 \(21.4 GiB\) does not fit server 1's share \(14.9 GiB\)"):
        plan_by_size(sizes, [16 * GB] * 100)  # server 0 takes the dense blocks 0:3
    with pytest.raises(SwarmError, match=r"2 server\(s\) hold blocks 0:9; blocks 9:61 .* fit none"):
        plan_by_size(sizes, [80 * GB] * 2)


def test_swarm_status_shows_each_servers_share_by_its_blocks_sizes():
    sizes = block_parameters(DEEPSEEK_V3)
    status = {"dht_prefix": "dist_eval-deepseek", "num_blocks": 61, "num_blocks_from": "given", "unserved": [],
              "healthy": True, "blocks": [{"block": i, "servers": ["A" if i < 6 else "B"],
                                            "online": ["A" if i < 6 else "B"]} for i in range(61)],
              "servers": [dict(peer_id=peer, addresses=[], reachable=True, state="ONLINE", blocks=blocks,
                               torch_dtype="torch.bfloat16", quant_type="NONE", throughput=1.0, version="2.2.0")
                          for peer, blocks in (("A", [0, 6]), ("B", [6, 61]))]}
    add_sizes(status, sizes)
    assert status["servers"][0]["weight_bytes"] == 2 * sum(sizes[:6]) and status["block_parameters"] == sizes
    lines = render(status).splitlines()
    assert lines[1].startswith("  S0  ONLINE   blocks 0:6 (67.6 GiB)  bfloat16")
    assert lines[2].startswith("  S1  ONLINE   blocks 6:61 (1178.9 GiB)  bfloat16")


def test_a_model_split_over_gpus_is_split_by_its_blocks_sizes():
    """DeepSeek-V3 in bf16 (1,340 GB) over 15 GPUs whose weight share is 95 GB: an equal count of
    blocks (5 a GPU, 110 GB at the mean block size) is refused; by size, every GPU holds at most its
    share (four 23 GB mixture blocks, or the three dense blocks and three). 14 such GPUs cannot hold
    it (58 mixture blocks, 4 a GPU at most): refused in one line."""
    from dist_eval.swarm.devices import plan_servers

    weights = block_parameters(DEEPSEEK_V3)
    sizes = [2 * w for w in weights]

    def plan(gpus, by_size=True):
        return plan_servers("cuda", None, "bfloat16", gpu_memory=[190 * GB] * gpus, weight_bytes=sum(sizes),
                            saved_dtype="bfloat16", num_blocks=len(sizes), block_weights=weights if by_size else None)

    with pytest.raises(SwarmError, match="do not fit"):
        plan(15, by_size=False)
    ranges = plan(15).block_ranges
    assert plan(15).devices == tuple(f"cuda:{g}" for g in range(len(ranges))) and len(ranges) == 15
    assert ranges[0][0] == 0 and ranges[-1][1] == 61 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(sum(sizes[a:b]) for a, b in ranges) <= 95 * GB
    with pytest.raises(SwarmError, match=r"do not fit the local swarm's 14 GPU\(s\) by size.*--initial-peers"):
        plan(14)


def test_a_local_swarm_of_a_mixture_model_places_its_blocks_by_size(tmp_path, monkeypatch):
    """LocalSwarm asks the plan with each block's count from config.json and serves its ranges: a tiny
    DeepSeek-V3 (a dense block 0, then mixture blocks) on two GPUs too small for a whole copy (no GPU
    here: the GPUs' memory the plan is given is made up; no server is started)."""
    from conftest import build_tiny_model

    from dist_eval.swarm import LocalSwarm
    from dist_eval.swarm import local as local_swarm
    from dist_eval.swarm.devices import GPU_WEIGHT_SHARE

    model = build_tiny_model(str(tmp_path / "deepseek"), family="deepseek_v3", num_layers=4)
    sizes = [4 * n for n in block_parameters(json.load(open(tmp_path / "deepseek" / "config.json")))]
    assert sizes[0] < sizes[1] == sizes[3]
    share = sizes[0] + 2 * sizes[1]
    monkeypatch.setattr(local_swarm, "visible_gpu_memory", lambda device: [int(share / GPU_WEIGHT_SHARE)] * 2)
    swarm = LocalSwarm(model, device="cuda", torch_dtype="float32")
    assert swarm.server_plan.block_ranges is not None and swarm.server_plan.devices == ("cuda:0", "cuda:1")
    assert swarm.placement == list(swarm.server_plan.block_ranges) == [(0, 2), (2, 4)]
    assert all(sum(sizes[a:b]) <= share for a, b in swarm.placement)
