"""Search: the decision process over plans, MCTS, the intra-stage sharding solver, baselines and the planner."""
