"""The cluster SPEC grammar: `parse_cluster_spec` (pure) -> `ClusterSpec`, then `build_cluster` -> `Cluster`.

Grammar:

    SPEC   := TERM ('+' TERM)* | PATH
    TERM   := PRESET (':' OPTION)*            options may also be separated by ','
    OPTION := nodes=N | gpu=NAME | nics=N | nic_speed_Gbps=X

e.g. `dgx-a100-80gb:nodes=4` or `p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1` (16 GPUs: the 12
V100s first, node-major in SPEC order). PATH is a file: `.yaml`/`.yml`/`.json` a cluster file
(docs/CLUSTER_FORMAT.md), `.xml` an NCCL topology dump, anything else `nvidia-smi topo -m` text.

`ClusterOptions` are defaults for every preset term (a term's own options win); for a topology
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
from dataclasses import dataclass
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
MAX_SPEC_CHARS = 2000
_DATA_SUFFIXES = (".yaml", ".yml", ".json")
_FILE_SUFFIXES = (*_DATA_SUFFIXES, ".xml", ".txt", ".log", ".topo")


@dataclass(frozen=True)
class ClusterTerm:
    """One `PRESET[:option=value...]` term; options not given are None."""

    preset: str
    nodes: int | None = None
    gpu: str | None = None
    nics: int | None = None
    nic_speed_Gbps: float | None = None


@dataclass(frozen=True)
class ClusterSpec:
    """A parsed cluster SPEC: preset terms, or the path of a file (a cluster file or a topology dump)."""

    text: str
    terms: tuple[ClusterTerm, ...] = ()
    path: str | None = None

    @property
    def names_file(self) -> bool:
        """True when building it reads a file: a cluster or topology file, or a term's `gpu=<file>.yaml`."""
        return self.path is not None or any(
            t.gpu is not None and Path(t.gpu).suffix.lower() in _DATA_SUFFIXES for t in self.terms)

    @property
    def nodes(self) -> int | None:
        """Nodes the preset terms ask for (each term 1 unless it says nodes=N); None for a file."""
        return None if self.path is not None else sum(t.nodes or 1 for t in self.terms)


@dataclass(frozen=True)
class ClusterOptions:
    """Defaults for every preset term, or what a one-node topology file leaves out (module docstring)."""

    nodes: int | None = None
    gpu: str | None = None
    nic_speed_Gbps: float | None = None
    nics: int | None = None
    network_latency_us: float | None = None
    nccl_tests: tuple[str, ...] = ()


def parse_cluster_spec(text: str) -> ClusterSpec:
    """The ClusterSpec `text` names; SpecError naming the term and option. Pure: reads no file."""
    if not isinstance(text, str):
        raise SpecError(f"cluster SPEC: {type(text).__name__} is not accepted; expected a string")
    spec = text.strip()
    if not spec:
        raise SpecError(f"cluster SPEC is empty; give PRESET[:nodes=N][+...] ({', '.join(presets.preset_names())}) "
                        "or a file path")
    if len(spec) > MAX_SPEC_CHARS:
        raise SpecError(f"cluster SPEC: {len(spec)} characters is over the limit of {MAX_SPEC_CHARS}")
    if not _is_presets(spec):
        return ClusterSpec(spec, path=spec)
    return ClusterSpec(spec, terms=tuple(_parse_term(t.strip()) for t in spec.split("+")))


def _parse_term(term: str) -> ClusterTerm:
    name, *parts = (p.strip() for p in re.split(r"[:,]", term))
    presets.preset(name)  # SpecError for an unknown preset, with the nearest names
    values: dict[str, Any] = {}
    for part in parts:
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep or key not in OPTIONS:
            raise SpecError(f"cluster spec {term!r}: option {part!r} is not accepted; accepted options: "
                            f"{', '.join(k + '=...' for k in OPTIONS)}")
        if key in values:  # last-wins would drop one silently
            raise SpecError(f"cluster spec {term!r}: option {key!r} is given twice; give each option once")
        values[key] = _option_value(key, value, f"{name}:{key}")
    return ClusterTerm(preset=name, **values)


def _option_value(key: str, value: str, field: str) -> Any:
    """A term option's value, checked (a gpu name stays a name until built)."""
    if key == "gpu":
        if not value:
            raise SpecError(f"{field}: empty; give a GPU type ({', '.join(catalog.known_devices()[:6])}, ...)")
        return value
    if key in ("nodes", "nics"):
        if not re.fullmatch(r"\d{1,9}", value):  # int() would also take '5_0000', '+5' and ' 5'
            raise SpecError(f"{field}: {value!r} is not accepted; expected a whole number")
        return positive_int(int(value), field)
    try:
        parsed = float(value)
    except ValueError:
        raise SpecError(f"{field}: {value!r} is not accepted; expected a number") from None
    return number(parsed, field)


def resolve_gpu(gpu: str) -> DeviceSpec:
    """A catalog device by name, or the custom device in a YAML/JSON file (a `gpu:` key is optional)."""
    if Path(gpu).suffix.lower() not in _DATA_SUFFIXES:
        return catalog.lookup_device(gpu)
    data = read_data(gpu)
    if isinstance(data, dict) and set(data) == {"gpu"}:
        data = data["gpu"]
    return catalog.device_value(data, gpu)


def _gpu(name: str, field: str) -> DeviceSpec:
    try:
        return resolve_gpu(name)
    except SpecError as err:
        raise SpecError(f"{field}: {err}") from None


def _copies(node: Node, prefix: str, count: int, counters: dict[str, int]) -> list[Node]:
    """`count` copies of `node` named `<prefix>-<i>`, numbered on from earlier copies of `prefix`."""
    start = counters.get(prefix, 0)
    counters[prefix] = start + count
    return [presets.replace_node(node, name=f"{prefix}-{start + i}") for i in range(count)]


def _from_presets(spec: ClusterSpec, options: ClusterOptions) -> Cluster:
    nodes: list[Node] = []
    latencies: list[float] = []
    counters: dict[str, int] = {}
    for term in spec.terms:
        base = presets.preset(term.preset)
        gpu = term.gpu or options.gpu
        node = presets.with_overrides(base.node, gpu=None if gpu is None else _gpu(gpu, f"{term.preset}:gpu"),
                                      nics=term.nics or options.nics,
                                      nic_speed_Gbps=term.nic_speed_Gbps or options.nic_speed_Gbps)
        nodes.extend(_copies(node, base.name, term.nodes or options.nodes or 1, counters))
        latencies.append(base.network.latency_s)
    return Cluster(name=spec.text, nodes=tuple(nodes), network=Network(latency_s=max(latencies)))


def _from_file(path: Path, options: ClusterOptions) -> Cluster:
    if not path.is_file():
        raise SpecError(f"cluster spec {str(path)!r}: no such file (and not a preset: "
                        f"{', '.join(presets.preset_names())})")
    if path.suffix.lower() in _DATA_SUFFIXES:
        given = [k for k in ("nodes", "gpu", "nics", "nic_speed_Gbps") if getattr(options, k) is not None]
        if given:
            raise SpecError(f"{path}: {', '.join(given)} cannot be given with a cluster file; set them "
                            "in its node_groups")
        return load_cluster_file(path)
    parse = parse_nccl_xml if path.suffix.lower() == ".xml" else parse_nvidia_topo
    gpu = None if options.gpu is None else _gpu(options.gpu, "gpu")
    node = parse(read_text(path), gpu=gpu, name=path.stem, nics=options.nics, nic_speed_Gbps=options.nic_speed_Gbps)
    latency_s = presets.latency_for_nic(node.nic_bandwidth_Bps)
    return Cluster(name=path.stem, nodes=tuple(_copies(node, path.stem, options.nodes or 1, {})),
                   network=Network(latency_s=latency_s))


def _is_presets(spec: str) -> bool:
    first = re.split(r"[:,+]", spec, maxsplit=1)[0].strip().lower()
    if "+" in spec or first in presets.preset_names():
        return True
    return not (Path(spec).suffix.lower() in _FILE_SUFFIXES or "/" in spec or "\\" in spec)


def _checked(options: ClusterOptions) -> ClusterOptions:
    """`options` with every number checked (SpecError naming the option)."""
    if options.nodes is not None:
        positive_int(options.nodes, "nodes")
    if options.nics is not None:
        positive_int(options.nics, "nics")
    if options.nic_speed_Gbps is not None:
        number(options.nic_speed_Gbps, "nic_speed_Gbps")
    if options.network_latency_us is not None:
        number(options.network_latency_us, "network_latency_us", minimum=0)
    return options


def build_cluster(spec: ClusterSpec, options: ClusterOptions | None = None) -> Cluster:
    """The cluster a parsed SPEC describes (grammar in the module docstring); SpecError on bad input."""
    options = _checked(options or ClusterOptions())
    cluster = _from_file(Path(spec.path), options) if spec.path is not None else _from_presets(spec, options)
    if options.network_latency_us is not None:
        network = cluster.network.model_copy(update={"latency_s": options.network_latency_us / 1e6})
        cluster = Cluster(name=cluster.name, nodes=cluster.nodes, network=network)
    for log_path in options.nccl_tests:
        cluster = apply_nccl_tests(cluster, load_nccl_tests(log_path))
    return cluster


def load_cluster(text: str, options: ClusterOptions | None = None) -> Cluster:
    """`build_cluster(parse_cluster_spec(text), options)`: the Cluster a SPEC string names."""
    return build_cluster(parse_cluster_spec(text), options)
