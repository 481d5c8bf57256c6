"""tagplan: a topology-aware planner for distributed training on heterogeneous clusters."""

__version__ = "0.1.0"
