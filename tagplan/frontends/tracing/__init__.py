"""The pieces behind `tagplan.frontends.torch_export.graph_from_module`.

`trace` runs the exported graph and records each node (`nodes` holds the records), `ops`
classifies nodes and computes their per-sample figures, `layers` groups them into layers and
`blocks` turns layers into hashed Blocks. The conventions they follow are documented in
`tagplan/frontends/torch_export.py`.
"""
