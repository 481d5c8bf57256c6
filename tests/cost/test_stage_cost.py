from collections import Counter

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Plan, Stage, Workload


def test_prefix_block_counts_equal_a_direct_count_for_every_range() -> None:
    model = load_model("t5?layers=3&hidden=64&heads=4&ffn=128&vocab=50", seq_len=8)
    coster = Simulator(model, load_cluster("dgx-a100-80gb"), Workload()).coster
    n = len(model.layers)
    for start in range(n):
        for end in range(start + 1, n + 1):
            expected = Counter(model.layers[i].block for i in range(start, end))
            assert coster.block_counts(Stage(layers=(start, end), devices=(0,))) == expected


def test_equal_blocks_on_equal_links_are_costed_once() -> None:
    model = load_model("gpt?layers=8&hidden=256&heads=4&vocab=100", seq_len=64)
    sim = Simulator(model, load_cluster("dgx-a100-80gb:nodes=2"), Workload(global_batch=8, seq_len=64))
    a = Stage(layers=(0, 10), devices=(0, 1, 2, 3), tp=4)
    b = Stage(layers=(0, 10), devices=(8, 9, 10, 11), tp=4)  # another node, same link class
    sim.coster.replica(a, 0, 1.0)
    before = (len(sim.coster.block_memo), len(sim.coster.tp_memo))
    sim.coster.replica(b, 0, 1.0)
    assert (len(sim.coster.block_memo), len(sim.coster.tp_memo)) == before


def test_a_cut_inside_the_t5_decoder_carries_the_encoder_output_too() -> None:
    model = load_model("t5?layers=3&hidden=64&heads=4&ffn=128&vocab=50", seq_len=8)
    coster = Simulator(model, load_cluster("dgx-a100-80gb"), Workload()).coster
    names = [layer.name for layer in model.layers]
    inside_decoder = names.index("decoder.block.2")
    in_encoder = names.index("encoder.block.2")
    width = model.block_of(1).output_bytes
    assert coster.cut_bytes(in_encoder) == width
    assert coster.cut_bytes(inside_decoder) == 2 * width  # the previous block's output and the encoder's


def test_a_mixed_group_is_paced_by_its_slowest_figure_of_each_kind() -> None:
    cluster = load_cluster("dgx-a100-40gb+dgx-a100-80gb")  # equal peaks, different memory bandwidth
    sim = Simulator(load_model("gpt?layers=2&hidden=64&heads=4&vocab=10", seq_len=8), cluster, Workload())
    a40, a80 = cluster.devices[0].spec, cluster.devices[8].spec
    paced = sim.coster.slowest((8, 0))
    assert paced.mem_bandwidth_Bps == min(a40.mem_bandwidth_Bps, a80.mem_bandwidth_Bps)
    assert paced.peak_flops_bf16 == min(a40.peak_flops_bf16 or 0, a80.peak_flops_bf16 or 0)
    assert sim.coster.slowest((8, 9)) == a80  # one type: itself


def test_a_mixed_groups_cost_does_not_depend_on_its_named_type_being_costed_first() -> None:
    # the combined spec of an A100-80GB + A100-40GB group is named A100-80GB (equal peaks) but has the
    # 40GB's lower memory bandwidth: it must not share the 80GB's memoised block times
    model = load_model("gpt?layers=4&hidden=1024&heads=16&vocab=5000", seq_len=512)
    cluster, workload = load_cluster("dgx-a100-80gb+dgx-a100-40gb"), Workload(global_batch=8, seq_len=512)
    pure = Plan(stages=(Stage(layers=(0, len(model.layers)), devices=(0, 1), tp=2),))
    mixed = Plan(stages=(Stage(layers=(0, len(model.layers)), devices=(0, 8), tp=2),))
    fresh = Simulator(model, cluster, workload).simulate(mixed).iteration_time_s
    warmed = Simulator(model, cluster, workload)
    assert warmed.simulate(pure).iteration_time_s < fresh  # the 80GB pair is faster: the two differ
    assert warmed.simulate(mixed).iteration_time_s == fresh
