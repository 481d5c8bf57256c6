"""`load_cluster`: the one entry point from a cluster spec string (CLI `--cluster`) to a `Cluster`.

Grammar:

    SPEC   := TERM ('+' TERM)* | PATH
    TERM   := PRESET (':' OPTION)*            options may also be separated by ','
    OPTION := nodes=N | gpu=NAME | nics=N | nic_speed_Gbps=X

e.g. `dgx-a100-80gb:nodes=4` or `p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1` (16 GPUs: the 12
V100s first, node-major in SPEC order). PATH is a file: `.yaml`/`.yml`/`.json` a cluster file
(docs/CLUSTER_FORMAT.md), `.xml` an NCCL topology dump, anything else `nvidia-smi topo -m` text.

Keyword arguments are defaults for every preset term (a term's own options win); for a topology
file, which describes one node, they describe the rest: `nodes` copies, the `gpu` type (topo -m
does not name it), NIC count and speed. A cluster file sets those per node group and rejects
them. `gpu` is a catalog name or a YAML/JSON file holding one custom device mapping.
Network latency: `network_latency_us`, else the largest default of the node types involved
(presets: by network class; topology files: 5 us for NICs of 100 Gb/s and more, else 30 us).
Between nodes of different types a GPU gets the smaller per-GPU NIC share (`Cluster.link`).
`nccl_tests` logs are applied in order (see `nccl_tests.apply_nccl_tests`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError
from tagplan.frontends import catalog, presets
from tagplan.frontends.cluster_file import load_cluster_file, number, positive_int, read_data
from tagplan.frontends.nccl_tests import apply_nccl_tests, load_nccl_tests
from tagplan.frontends.nccl_xml import parse_nccl_xml
from tagplan.frontends.nvidia_topo import parse_nvidia_topo
from tagplan.frontends.textfile import read_text
from tagplan.ir.cluster import Cluster, DeviceSpec, Network, Node

OPTIONS = ("nodes", "gpu", "nics", "nic_speed_Gbps")
_DATA_SUFFIXES = (".yaml", ".yml", ".json")
_FILE_SUFFIXES = (*_DATA_SUFFIXES, ".xml", ".txt", ".log", ".topo")


def resolve_gpu(gpu: str) -> DeviceSpec:
    """A catalog device by name, or the custom device in a YAML/JSON file (a `gpu:` key is optional)."""
    if Path(gpu).suffix.lower() not in _DATA_SUFFIXES:
        return catalog.lookup_device(gpu)
    data = read_data(gpu)
    if isinstance(data, dict) and set(data) == {"gpu"}:
        data = data["gpu"]
    return catalog.device_value(data, gpu)


def _option(key: str, value: str, field: str) -> Any:
    """A term option's value, converted and checked; SpecError names the field and what is accepted."""
    if key == "gpu":
        try:
            return resolve_gpu(value)
        except SpecError as err:
            raise SpecError(f"{field}: {err}") from None
    try:
        parsed: int | float = int(value) if key in ("nodes", "nics") else float(value)
    except ValueError:
        parsed_text = "an integer" if key in ("nodes", "nics") else "a number"
        raise SpecError(f"{field}: {value!r} is not accepted; expected {parsed_text}") from None
    return positive_int(parsed, field) if isinstance(parsed, int) else number(parsed, field)


def _term(term: str, defaults: dict[str, Any]) -> tuple[presets.Preset, dict[str, Any]]:
    """The preset a term names and its options (the defaults, overridden by the term's own)."""
    name, *parts = (p.strip() for p in re.split(r"[:,]", term))
    base = presets.preset(name)
    options = dict(defaults)
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in OPTIONS:
            raise SpecError(f"cluster spec {term!r}: option {part!r} is not accepted; accepted options: "
                            f"{', '.join(k + '=...' for k in OPTIONS)}")
        options[key.strip()] = _option(key.strip(), value.strip(), f"{name}:{key.strip()}")
    return base, options


def _copies(node: Node, prefix: str, count: int, counters: dict[str, int]) -> list[Node]:
    """`count` copies of `node` named `<prefix>-<i>`, numbered on from earlier copies of `prefix`."""
    start = counters.get(prefix, 0)
    counters[prefix] = start + count
    return [presets.replace_node(node, name=f"{prefix}-{start + i}") for i in range(count)]


def _from_presets(spec: str, defaults: dict[str, Any]) -> Cluster:
    nodes: list[Node] = []
    latencies: list[float] = []
    counters: dict[str, int] = {}
    for term in spec.split("+"):
        base, opts = _term(term.strip(), defaults)
        node = presets.with_overrides(base.node, gpu=opts.get("gpu"), nics=opts.get("nics"),
                                      nic_speed_Gbps=opts.get("nic_speed_Gbps"))
        nodes.extend(_copies(node, base.name, opts.get("nodes", 1), counters))
        latencies.append(base.network.latency_s)
    return Cluster(name=spec, nodes=tuple(nodes), network=Network(latency_s=max(latencies)))


def _from_file(path: Path, defaults: dict[str, Any]) -> Cluster:
    if not path.is_file():
        raise SpecError(f"cluster spec {str(path)!r}: no such file (and not a preset: "
                        f"{', '.join(presets.preset_names())})")
    if path.suffix.lower() in _DATA_SUFFIXES:
        if defaults:
            raise SpecError(f"{path}: {', '.join(defaults)} cannot be given with a cluster file; set them "
                            "in its node_groups")
        return load_cluster_file(path)
    parse = parse_nccl_xml if path.suffix.lower() == ".xml" else parse_nvidia_topo
    node = parse(read_text(path), gpu=defaults.get("gpu"), name=path.stem, nics=defaults.get("nics"),
                 nic_speed_Gbps=defaults.get("nic_speed_Gbps"))
    latency_s = presets.latency_for_nic(node.nic_bandwidth_Bps)
    return Cluster(name=path.stem, nodes=tuple(_copies(node, path.stem, defaults.get("nodes", 1), {})),
                   network=Network(latency_s=latency_s))


def _is_presets(spec: str) -> bool:
    first = re.split(r"[:,+]", spec, maxsplit=1)[0].strip().lower()
    if "+" in spec or first in presets.preset_names():
        return True
    return not (Path(spec).is_file() or Path(spec).suffix.lower() in _FILE_SUFFIXES or "/" in spec)


def load_cluster(
    spec: str,
    *,
    nodes: int | None = None,
    gpu: str | None = None,
    nic_speed_Gbps: float | None = None,
    nics: int | None = None,
    network_latency_us: float | None = None,
    nccl_tests: list[str] | None = None,
) -> Cluster:
    """The cluster `spec` describes (grammar in the module docstring); SpecError on any bad input."""
    defaults: dict[str, Any] = {}
    if nodes is not None:
        defaults["nodes"] = positive_int(nodes, "nodes")
    if gpu is not None:
        defaults["gpu"] = resolve_gpu(gpu)
    if nics is not None:
        defaults["nics"] = positive_int(nics, "nics")
    if nic_speed_Gbps is not None:
        defaults["nic_speed_Gbps"] = number(nic_speed_Gbps, "nic_speed_Gbps")
    spec = spec.strip()
    cluster = _from_presets(spec, defaults) if _is_presets(spec) else _from_file(Path(spec), defaults)
    if network_latency_us is not None:
        latency_s = number(network_latency_us, "network_latency_us", minimum=0) / 1e6
        network = cluster.network.model_copy(update={"latency_s": latency_s})
        cluster = Cluster(name=cluster.name, nodes=cluster.nodes, network=network)
    for log_path in nccl_tests or []:
        cluster = apply_nccl_tests(cluster, load_nccl_tests(log_path))
    return cluster
