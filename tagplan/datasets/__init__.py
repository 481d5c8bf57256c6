"""Simulator-labelled datasets: random models and clusters, labelled plans on disk, PyG datasets.

`models` draws models of the parametric families and a ResNet-like CNN, `clusters` draws
heterogeneous clusters from the device catalog, `synthetic` writes plans of those instances
labelled by the simulator (`generate`, `load_samples`, `rebuild`), and `pyg` serves a generated
directory as a `torch_geometric` dataset of joint graphs.
"""
