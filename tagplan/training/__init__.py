"""Training the GNN on simulator-labelled (and later measured) plans: loop, metrics, registry."""
