"""Hugging Face configs without a download: names, overrides and `config.json` files.

- `make_config(config_class, overrides)`: the config class with `key=value` strings coerced to the
  types of its defaults (the `hf:NAME?key=value` SPEC).
- `resolve_hf_name(name)`: `hf:` names are config classes (`MistralConfig`) or architectures
  (`MistralForCausalLM`, any class transformers' auto mappings list); both resolve to the
  model type, its config class and the model class to build (a causal LM where the type has one).
- `read_hf_config(path)`: a `config.json` as published on a model hub (or a directory holding
  one) -> the config object built by `AutoConfig.for_model(model_type, **fields)` and the model
  class named by its `architectures` (else the auto mapping's). Hub-only fields (`auto_map`,
  `quantization_config`, `torch_dtype`, ...) are dropped: no remote code runs, no weights exist.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError, nearest

_HUB_ONLY = ("auto_map", "quantization_config", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
             "architectures", "model_type")
_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class HFArch:
    """What an `hf:` name or a config.json resolves to."""

    model_type: str  # transformers' model type, e.g. "mistral"
    config_class: str  # e.g. "MistralConfig"
    model_class: str  # the class built, e.g. "MistralForCausalLM"


def make_config(config_class: str, overrides: dict[str, str]) -> Any:
    """The config object with overrides coerced to the types of the defaults (use_cache off)."""
    import transformers

    cls = getattr(transformers, config_class)
    try:
        default = cls()
    except Exception as exc:
        raise SpecError(f"{config_class}: transformers cannot build its default config: {exc}") from exc
    keys = sorted(set(default.to_dict()) | set(getattr(cls, "attribute_map", {})))
    values: dict[str, Any] = {}
    for key, text in overrides.items():
        if key not in keys:
            close = nearest(key, keys, n=5) or keys[:5]
            raise SpecError(
                f"unknown {config_class} key {key!r}. Did you mean {', '.join(repr(c) for c in close)}? "
                f"({len(keys)} keys are accepted)"
            )
        values[key] = _coerce(config_class, key, text, getattr(default, key, None))
    values["use_cache"] = False
    try:
        return cls(**values)
    except Exception as exc:
        raise SpecError(f"{config_class}: the overrides {overrides} are rejected: {exc}") from exc


def _coerce(config_class: str, key: str, text: str, default: Any) -> Any:
    """Parse a query-string value as the type of the config's default value."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, str):
            return text
        if text.lower() in ("none", "null"):
            return None
        return json.loads(text)  # numbers, booleans, lists and dicts for None/list/dict defaults
    except ValueError:
        if default is None:
            return text
        raise SpecError(
            f"{config_class}: {key}={text!r} is not a valid {type(default).__name__} "
            f"(default {default!r})"
        ) from None


_DEPTH_KEY = re.compile(r"(?:num_|n_)?(?:hidden_|encoder_|decoder_)?layers?|(?:encoder|decoder)_num_hidden_layers"
                        r"|num_global_layers|depth")
"""A config key that counts blocks: num_hidden_layers, num_layers, n_layer(s), num_decoder_layers, encoder_layers..."""


def config_depth(config: Any) -> int:
    """Blocks a transformers config builds: the sum of its layer counts, nested configs' too (T5's num_layers plus
    num_decoder_layers, which defaults to it; MPT's n_layers; a multimodal model's text and vision stacks)."""
    def count(values: dict[str, Any]) -> int:
        total = 0
        if "encoder_layers" in values and "decoder_layers" in values:  # transformers 4's BART family mirrors
            values = {k: v for k, v in values.items() if k != "num_hidden_layers"}  # encoder_layers in it
        for key, value in values.items():
            if isinstance(value, dict):
                total += count(value)
            elif isinstance(key, str) and _DEPTH_KEY.fullmatch(key) and isinstance(value, int) \
                    and not isinstance(value, bool):
                total += max(value, 0)
        return total

    return count(config.to_dict())


def spec_depth(config_class: str, overrides: dict[str, str]) -> int:
    """`config_depth` of an `hf:NAME?key=value` SPEC's config (a config class or an architecture), built without
    the model; SpecError for an unknown name or key. Cached by SPEC: an upload repeats one SPEC per record."""
    return _spec_depth(config_class, tuple(sorted(overrides.items())))


@functools.lru_cache(maxsize=256)
def _spec_depth(config_class: str, overrides: tuple[tuple[str, str], ...]) -> int:
    return config_depth(make_config(resolve_hf_name(config_class).config_class, dict(overrides)))


def _config_classes() -> dict[str, str]:
    """model type -> config class name, for every model type transformers knows."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return dict(CONFIG_MAPPING_NAMES)


def _model_classes() -> dict[str, list[str]]:
    """model class name -> the model types whose auto mappings list it (causal LMs first). A class may be
    listed under several types (LlamaForCausalLM under llama and exaone, GPT2LMHeadModel under gpt2 and
    gpt-sw3): `_model_type_of` picks the class's own."""
    from transformers.models.auto import modeling_auto

    out: dict[str, list[str]] = {}
    causal = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
    names = [causal, *sorted(n for n in dir(modeling_auto) if n.endswith("_MAPPING_NAMES") and n != causal)]
    for attr in names:
        mapping = getattr(modeling_auto, attr)
        if not isinstance(mapping, dict):
            continue
        for model_type, classes in mapping.items():
            for cls in (classes,) if isinstance(classes, str) else classes:
                types = out.setdefault(str(cls), [])
                if str(model_type) not in types:
                    types.append(str(model_type))
    return out


def _model_type_of(model_class: str, listed: list[str], configs: dict[str, str]) -> str:
    """The model type of a class listed under `listed`: the type of its own config class (`config_class`,
    which every transformers model class names), where the class is listed under more than one."""
    if len(listed) == 1:
        return listed[0]
    import transformers

    own = getattr(getattr(transformers, model_class, None), "config_class", None)
    own_type = getattr(own, "model_type", None)
    if own_type in listed:
        return str(own_type)
    by_config = [t for t in listed if configs.get(t) == getattr(own, "__name__", None)]
    return by_config[0] if by_config else listed[0]


def is_causal_lm(model_class: str) -> bool:
    """Whether transformers lists `model_class` as a causal language model (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return any(model_class == cls or (not isinstance(cls, str) and model_class in cls)
               for cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def default_model_class(model_type: str) -> str:
    """The class built for a model type: its causal LM, else its base model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    found = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(model_type)
    if found is None:
        raise SpecError(f"Hugging Face model type {model_type!r} has no causal LM or base model class in transformers")
    return found if isinstance(found, str) else str(found[0])


def resolve_hf_name(name: str) -> HFArch:
    """The model type and classes of an `hf:` name (config class or architecture); SpecError if unknown."""
    configs = _config_classes()
    by_config = {cls: model_type for model_type, cls in configs.items()}
    if name in by_config:
        model_type = by_config[name]
        return HFArch(model_type, name, default_model_class(model_type))
    models = _model_classes()
    if name in models:
        model_type = _model_type_of(name, models[name], configs)
        return HFArch(model_type, configs[model_type], name)
    raise _unknown("Hugging Face config class or architecture", name, [*by_config, *models])


def config_path(path: str) -> Path:
    """The config.json a SPEC path names (the file, or `config.json` in a directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / _CONFIG_FILE
    if not p.is_file():
        raise SpecError(f"Hugging Face config {str(p)!r} does not exist (give a config.json or a directory "
                        "holding one)")
    return p


def is_hf_config(data: Any) -> bool:
    """True when parsed JSON looks like a Hugging Face config.json (not a tagplan graph)."""
    return isinstance(data, dict) and "blocks" not in data and ("model_type" in data or "architectures" in data)


def read_hf_config(path: str) -> tuple[Any, HFArch]:
    """(config object with use_cache off, HFArch) of a config.json file or a directory holding one."""
    file = config_path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{file}: not a readable JSON config: {exc}") from None
    return config_from_dict(data, str(file))


def config_from_dict(data: Any, source: str) -> tuple[Any, HFArch]:
    """The config object and HFArch of a parsed config.json (`source` names it in errors)."""
    if not is_hf_config(data):
        raise SpecError(f"{source}: a Hugging Face config.json needs 'model_type' (or 'architectures')")
    arch = _arch_of(data, source)
    from transformers import AutoConfig

    fields = {k: v for k, v in data.items() if k not in _HUB_ONLY}
    fields["use_cache"] = False
    try:
        config = AutoConfig.for_model(arch.model_type, **fields)
    except Exception as exc:
        raise SpecError(f"{source}: transformers rejects this {arch.config_class}: {exc}") from exc
    return config, arch


def _arch_of(data: dict[str, Any], source: str) -> HFArch:
    """The HFArch of a config.json: `model_type` and the first `architectures` class transformers has."""
    import transformers

    configs = _config_classes()
    architectures = [a for a in data.get("architectures") or [] if isinstance(a, str)]
    model_type = data.get("model_type")
    if model_type is None:
        models = _model_classes()
        model_type = next((_model_type_of(a, models[a], configs) for a in architectures if a in models), None)
        if model_type is None:
            raise SpecError(f"{source}: no 'model_type', and architectures {architectures} are not in transformers")
    if model_type not in configs:
        raise _unknown(f"{source}: Hugging Face model_type", str(model_type), list(configs))
    model_class = next((a for a in architectures if hasattr(transformers, a)), None)
    return HFArch(str(model_type), configs[model_type], model_class or default_model_class(str(model_type)))


def _unknown(field: str, value: str, choices: list[str]) -> SpecError:
    """An error naming the nearest of many choices (transformers knows thousands of classes)."""
    close = nearest(value, choices, n=5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return SpecError(f"unknown {field} {value!r}.{hint} ({len(choices)} names in transformers "
                     f"{_version()} are accepted, e.g. MistralForCausalLM or MistralConfig)")


def _version() -> str:
    import transformers

    return str(transformers.__version__)
