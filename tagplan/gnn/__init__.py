"""The learned scorer: the joint computation-graph + device-topology graph of a plan (features),
a heterogeneous GATv2 network that predicts log(T / T_lb) and whether the plan fits (model), and
the batched scorer with the MCTS `Prior` and `Evaluator` built on it (scorer)."""
